"""materl vs TRL's GRPOTrainer: seconds per GRPO step and peak RSS, SmolLM2-135M-Instruct on CPU.

The same settings on both sides: SmolLM2-135M-Instruct (TRL loads materl's cached HF folder,
``materl.engines.models.ensure_cached``), 8 completions per step = 2 prompts x 4 generations,
32 new tokens, temperature 1, the same prompts (chat template, SmolLM2's default system turn),
the same reward function (``length_reward`` below, written once in TRL's
``fn(completions, **kw) -> list[float]`` form), beta 0 (no reference model on either side),
per-sequence token-mean loss (TRL ``loss_type="grpo"``, materl ``seq_mean_token_mean``), one
optimizer step per generation batch, AdamW lr 1e-6, weight decay 0, grad-norm clip 1.0, fp32,
no gradient checkpointing (TRL's GRPOConfig turns it on by default; ``--trl-checkpointing``
restores that: less memory for TRL, more time).
Modes: full fine-tune and LoRA (r=16, alpha=32, q/k/v/o projections on both).

- materl: ``ml.compile(recipe, policy=ml.Agent(..., trainable=True[, lora=...]))``, one
  ``compiled.run(prompts)`` per step; recipe = ``materl.recipes.grpo`` with the reward replaced
  and the policy loss replaced by one without the reference term (so ``ref_logprobs`` is pruned).
- TRL: ``GRPOTrainer`` (its Python API, an in-memory ``datasets.Dataset``, ``max_steps``,
  ``use_cpu=True``, no saving, logging or reporting).

Timing (``--mode full|lora|both``): both trainers live in ONE process; a TrainerCallback times
each TRL step (``on_step_begin`` -> ``on_step_end``: generation, reward, loss, backward,
optimizer) and, at each ``on_step_end``, runs and times one materl step, so the two alternate
step by step. The first ``--warmup`` steps of each are dropped; medians of the rest.

Memory (``--memory``): peak RSS of a process that builds ONE trainer and runs it for
``--memory-steps`` steps, psutil RSS sampled every 5 ms in a thread (one subprocess per
framework and mode: in the timing process both models are resident, so its RSS is shared).
These runs also time their steps: a second table, one framework per process. It matters
because some settings are per process: materl keeps one OpenMP pool and keeps freed memory in
the heap (``materl/compute.py``), and in the shared timing process TRL benefits from both.

Profile (``--profile``): cProfile of ``--profile-steps`` materl steps (full fine-tune) in every
thread (event loop, decode worker), merged, top functions by cumulative time.

    OMP_NUM_THREADS=2 python benchmarks/vs_trl.py --mode both --warmup 1 --steps 4 --memory --profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import torch

MODEL = "smollm2-135m-instruct"
PROMPTS = ["Write a short poem about the sea.", "Explain what a CPU does.", "Give me three fruit names.",
           "Describe your favourite season.", "Tell me a fun fact about cats.", "What is a good breakfast?",
           "Summarise why sleep matters.", "Name a famous scientist and say why."]
LR, GROUP, PER_STEP, NEW_TOKENS, SEED = 1e-6, 4, 8, 32, 0
LORA = dict(r=16, alpha=32)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
TRL_CHECKPOINTING = [False]  # GRPOConfig's default is True; materl does not recompute activations


def length_reward(completions, **kw) -> list[float]:
    """Length of the completion text in characters / 100 (TRL reward-function form; TRL passes
    conversational completions as [{"role": "assistant", "content": ...}], materl passes text)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [len(t) / 100.0 for t in texts]


# -- materl --------------------------------------------------------------------------------------

class Materl:
    def __init__(self, lora: bool):
        import materl as ml
        from materl.recipes import grpo

        recipe = ml.replace(grpo, "rewards", lambda g: ml.reward(length_reward))
        recipe = ml.replace(recipe, "policy_loss", lambda g: ml.grpo_loss(g.advantages, g.policy_logprobs))
        kw = {"lora": {**LORA, "targets": LORA_TARGETS}} if lora else {}
        self.policy = ml.Agent(MODEL, trainable=True, **kw)
        # compile asks for every recipe agent, even one only pruned nodes read, and a separate
        # frozen ref Agent would be loaded by Compiled.update_references although ref_logprobs is
        # pruned; binding the policy itself (trainable, so no reference pair) loads nothing more.
        self.compiled = ml.compile(recipe, policy=self.policy, ref_policy=self.policy, group_size=GROUP,
                                   max_new_tokens=NEW_TOKENS,
                                   lr=LR, max_grad_norm=1.0, seed=SEED, temperature=1.0)
        self.i, self.stages = 0, []

    def step(self) -> dict:
        n = PER_STEP // GROUP
        prompts = [PROMPTS[(self.i * n + k) % len(PROMPTS)] for k in range(n)]
        self.i += 1
        metrics = self.compiled.run(prompts)
        self.stages.append((metrics["time/stage/rollout"], metrics["time/stage/learner"]))
        return metrics


# -- TRL -----------------------------------------------------------------------------------------

def trl_trainer(lora: bool, max_steps: int, callbacks=()):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from materl.engines.models import ensure_cached

    folder = str(ensure_cached(MODEL))
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS] * 64})
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="vs_trl_"), per_device_train_batch_size=PER_STEP,
        num_generations=GROUP, max_completion_length=NEW_TOKENS, learning_rate=LR, beta=0.0,
        loss_type="grpo", max_steps=max_steps, num_train_epochs=1, gradient_accumulation_steps=1,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        temperature=1.0, save_strategy="no", logging_strategy="no", report_to=[], use_cpu=True,
        bf16=False, fp16=False, seed=SEED, dataloader_num_workers=0, disable_tqdm=True,
        gradient_checkpointing=TRL_CHECKPOINTING[0])
    peft = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules=LORA_TARGETS,
                      task_type="CAUSAL_LM") if lora else None
    return GRPOTrainer(model=folder, reward_funcs=length_reward, args=args, train_dataset=data,
                       processing_class=AutoTokenizer.from_pretrained(folder), peft_config=peft,
                       callbacks=list(callbacks))


def _callback_class():
    from transformers import TrainerCallback

    class Alternate(TrainerCallback):
        """Times each TRL step; after it, runs and times one step of ``other`` (if given)."""

        def __init__(self, other=None):
            self.other, self.trl, self.materl, self._t0 = other, [], [], 0.0

        def on_step_begin(self, args, state, control, **kw):
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.trl.append(time.perf_counter() - self._t0)
            if self.other is not None:
                t0 = time.perf_counter()
                self.other.step()
                self.materl.append(time.perf_counter() - t0)

    return Alternate


# -- measurements --------------------------------------------------------------------------------

class PeakRSS:
    """Samples this process's RSS every ``period`` seconds in a daemon thread."""

    def __init__(self, period: float = 0.005):
        self.proc, self.period, self.peak, self._stop = psutil.Process(), period, 0, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def timing(mode: str, warmup: int, steps: int) -> dict:
    """Both trainers in this process, alternating step by step; medians after ``warmup``."""
    lora = mode == "lora"
    ours = Materl(lora)
    cb = _callback_class()(other=ours)
    trainer = trl_trainer(lora, warmup + steps, callbacks=[cb])
    torch.manual_seed(SEED)
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    trl_s, ml_s = cb.trl[warmup:], cb.materl[warmup:]
    rollout, learner = (statistics.median(x) for x in zip(*ours.stages[warmup:]))
    return {"mode": mode, "materl": ours, "materl_rollout_s": rollout, "materl_learner_s": learner,
            "trl_steps_s": cb.trl, "materl_steps_s": cb.materl, "wall_s": wall,
            "trl_median_s": statistics.median(trl_s), "materl_median_s": statistics.median(ml_s)}


def isolated(framework: str, mode: str, steps: int) -> dict:
    """One trainer only in this process: peak RSS over build + ``steps`` steps, and each step's
    time (what a user of either framework alone sees: no settings shared with the other)."""
    base = psutil.Process().memory_info().rss
    with PeakRSS() as rss:
        if framework == "materl":
            ours = Materl(mode == "lora")
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                ours.step()
                times.append(time.perf_counter() - t0)
        else:
            cb = _callback_class()()
            trl_trainer(mode == "lora", steps, callbacks=[cb]).train()
            times = cb.trl
    return {"framework": framework, "mode": mode, "peak_rss_mb": rss.peak / 2**20,
            "baseline_rss_mb": base / 2**20, "steps_s": times}


def profile(ours: Materl, steps: int, top: int = 30) -> str:
    """cProfile in every thread started from here on (the portal's event loop, the decode
    worker): ``threading.setprofile`` starts one profiler per thread on its first event."""
    profilers, lock = [], threading.Lock()

    def hook(*_):
        prof = cProfile.Profile()
        with lock:
            profilers.append(prof)
        prof.enable()

    ours.compiled.close()  # threads started earlier would keep no profiler: restart them
    threading.setprofile(hook)
    main = cProfile.Profile()
    main.enable()
    t0 = time.perf_counter()
    for _ in range(steps):
        ours.step()
    wall = time.perf_counter() - t0
    main.disable()
    threading.setprofile(None)
    for p in profilers:
        p.disable()
    out = io.StringIO()
    stats = pstats.Stats(main, stream=out)
    for p in profilers:
        stats.add(p)
    out.write(f"{steps} materl steps, {wall:.2f} s wall ({wall / steps:.2f} s/step); "
              f"threads profiled: main + {len(profilers)}\n")
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["full", "lora", "both"], default="both")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--memory-steps", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--trl-checkpointing", action="store_true",
                    help="TRL with gradient checkpointing (its GRPOConfig default); off by default so "
                         "both sides do the same computation")
    ap.add_argument("--isolated", nargs=2, metavar=("FRAMEWORK", "MODE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    torch.manual_seed(SEED)
    TRL_CHECKPOINTING[0] = a.trl_checkpointing
    if a.isolated:
        print(json.dumps(isolated(*a.isolated, a.memory_steps)))
        return
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, cpus {os.cpu_count()}, "
          f"load {os.getloadavg()[0]:.2f}, TRL gradient checkpointing {a.trl_checkpointing}")
    modes = ["full", "lora"] if a.mode == "both" else [a.mode]
    rows, warm = [], None
    for m in modes:  # (the full-mode materl is kept, warm, for --profile)
        r = timing(m, a.warmup, a.steps)
        ours = r.pop("materl")
        warm = ours if m == "full" else warm
        print(f"[{m}] trl steps {[round(x, 2) for x in r['trl_steps_s']]}  "
              f"materl steps {[round(x, 2) for x in r['materl_steps_s']]}  materl medians: rollout "
              f"{r['materl_rollout_s']:.2f} s, learner {r['materl_learner_s']:.2f} s", flush=True)
        rows.append(r)
    mem = {}
    if a.memory:
        for m in modes:
            for fw in ("trl", "materl"):
                cmd = [sys.executable, __file__, "--isolated", fw, m, "--memory-steps", str(a.memory_steps)]
                cmd += ["--trl-checkpointing"] if a.trl_checkpointing else []
                out = subprocess.run(cmd, capture_output=True, text=True, check=True)
                mem[(fw, m)] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\n| mode | TRL s/step | materl s/step | TRL / materl (goal >= 2.5) | TRL peak RSS MB "
          f"| materl peak RSS MB | materl / TRL (goal <= 0.7) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        m = r["mode"]
        t, o = r["trl_median_s"], r["materl_median_s"]
        mt, mo = (mem[(fw, m)]["peak_rss_mb"] if (fw, m) in mem else None for fw in ("trl", "materl"))
        memcols = f"{mt:.0f} | {mo:.0f} | {mo / mt:.2f}" if mt else "- | - | -"
        print(f"| {m} | {t:.2f} | {o:.2f} | {t / o:.2f} | {memcols} |")
    print(f"\n(one process, alternating step by step; medians of {a.steps} steps each after "
          f"{a.warmup} warm-up; peak RSS over build + {a.memory_steps} steps, one framework per process)")
    if mem and a.memory_steps > 1:
        print("\none framework per process (the --memory runs), median s/step after the first step:\n")
        print("| mode | TRL s/step | materl s/step | TRL / materl | TRL steps | materl steps |")
        print("|---|---|---|---|---|---|")
        for m in modes:
            t, o = (mem[(fw, m)]["steps_s"] for fw in ("trl", "materl"))
            tm, om = statistics.median(t[1:]), statistics.median(o[1:])
            print(f"| {m} | {tm:.2f} | {om:.2f} | {tm / om:.2f} | {[round(x, 2) for x in t]} | "
                  f"{[round(x, 2) for x in o]} |")
    if a.profile:
        print("\n## materl step profile (full fine-tune)\n")
        print(profile(warm or Materl(False), a.profile_steps))


if __name__ == "__main__":
    main()
