"""Where a materl GRPO step's time goes: the vs_trl.py step (SmolLM2-135M-Instruct, 2 prompts x 4
completions, 32 new tokens, beta 0), split into phases by wall-clock timers.

Phases (seconds per step, median over ``--steps`` after ``--warmup``):
  rollout          the rollout stage (decode with the agent's engine, rewards, advantages)
  prepare          the learner's no-gradient prepare (old log-probs, reference forwards)
  decoder fwd      the backbone forward of the update (``completion_hidden``)
  LM head fwd      the chunked LM-head log-probs forward (``ops.logprobs``)
  loss + glue      the rest of the micro-batch forward (loss, batch tensors)
  LM head bwd      the chunked LM-head backward
  decoder bwd      the rest of ``loss.backward()``
  optimizer        grad-norm clip, AdamW step, zero_grad
  after learner    weight sync of the engine, references, metrics
The timers wrap module attributes of materl in this process only (a benchmark's stopwatch, not a
change of behaviour); ``--torch-profile`` adds torch.profiler's top ops of one step.

    OMP_NUM_THREADS=2 python benchmarks/learner_time.py --mode both --warmup 1 --steps 4
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl import Materl  # noqa: E402 - the benchmark's own materl step

PHASES = ["rollout", "prepare", "decoder fwd", "LM head fwd", "loss + glue", "LM head bwd", "decoder bwd",
          "optimizer", "after learner", "step"]


class Stopwatch:
    """Seconds per named timer, accumulated until ``take``; and the peak RSS seen while each
    timer was the innermost one running (psutil, sampled every 5 ms in a thread)."""

    def __init__(self):
        self.acc: dict[str, float] = defaultdict(float)
        self.stack: list[str] = ["other"]
        self.peak_mb: dict[str, float] = defaultdict(float)
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        proc = psutil.Process()
        while True:
            rss = proc.memory_info().rss / 2**20
            name = self.stack[-1]
            self.peak_mb[name] = max(self.peak_mb[name], rss)
            time.sleep(0.005)

    def wrap(self, owner, attr: str, name: str, *, static: bool = False) -> None:
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            self.stack.append(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stack.pop()
                self.acc[name] += time.perf_counter() - t0

        setattr(owner, attr, staticmethod(timed) if static else timed)

    def wrap_async(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        async def timed(*args, **kwargs):
            self.stack.append(name)
            try:
                return await fn(*args, **kwargs)
            finally:
                self.stack.remove(name)

        setattr(owner, attr, timed)

    def take(self) -> dict[str, float]:
        out, self.acc = dict(self.acc), defaultdict(float)
        return out


def instrument(watch: Stopwatch) -> None:
    from materl.compiler import learner as learner_mod
    from materl.compiler.compiled import Compiled
    from materl.compiler.kinds import forward
    from materl.ops import logprobs

    watch.wrap(forward, "completion_hidden", "decoder fwd")
    watch.wrap(logprobs._ChunkedLogprobs, "forward", "LM head fwd", static=True)
    watch.wrap(logprobs._ChunkedLogprobs, "backward", "LM head bwd", static=True)
    watch.wrap(learner_mod.Learner, "micro_step", "micro_step")
    watch.wrap(torch.Tensor, "backward", "backward")
    watch.wrap(Compiled, "optimizer_step", "optimizer")
    watch.wrap_async(Compiled, "rollout", "rollout")


def phases(metrics: dict, t: dict[str, float], step_s: float) -> dict[str, float]:
    rollout, prepare = metrics["time/stage/rollout"], metrics.get("time/stage/prepare", 0.0)
    learner = metrics["time/stage/learner"]
    out = {"rollout": rollout, "prepare": prepare, "decoder fwd": t.get("decoder fwd", 0.0),
           "LM head fwd": t.get("LM head fwd", 0.0), "LM head bwd": t.get("LM head bwd", 0.0),
           "optimizer": t.get("optimizer", 0.0), "step": step_s}
    out["loss + glue"] = t.get("micro_step", 0.0) - out["decoder fwd"] - out["LM head fwd"]
    out["decoder bwd"] = t.get("backward", 0.0) - out["LM head bwd"]
    out["after learner"] = step_s - rollout - prepare - learner
    return out


def measure(mode: str, warmup: int, steps: int, torch_profile: bool) -> dict[str, float]:
    watch = Stopwatch()
    ours = Materl(mode == "lora")
    instrument(watch)
    rows = []
    for i in range(warmup + steps):
        watch.take()
        t0 = time.perf_counter()
        metrics = ours.step()
        step_s = time.perf_counter() - t0
        if i >= warmup:
            rows.append(phases(metrics, watch.take(), step_s))
    if torch_profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            ours.step()
        print(f"\n[{mode}] torch.profiler, one step, top ops by self CPU time\n")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    ours.compiled.close()
    peaks = ", ".join(f"{k} {v:.0f}" for k, v in sorted(watch.peak_mb.items(), key=lambda kv: -kv[1]))
    print(f"[{mode}] peak RSS MB while each timer was innermost: {peaks}", flush=True)
    return {k: statistics.median(r[k] for r in rows) for k in PHASES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["full", "lora", "both"], default="both")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--torch-profile", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")
    modes = ["full", "lora"] if a.mode == "both" else [a.mode]
    table = {m: measure(m, a.warmup, a.steps, a.torch_profile) for m in modes}
    print(f"\nload {os.getloadavg()[0]:.2f}; s/step, median of {a.steps} after {a.warmup} warm-up\n")
    print("| phase | " + " | ".join(modes) + " |")
    print("|---|" + "---|" * len(modes))
    for p in PHASES:
        print(f"| {p} | " + " | ".join(f"{table[m][p]:.3f}" for m in modes) + " |")


if __name__ == "__main__":
    main()
