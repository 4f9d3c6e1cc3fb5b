"""What the compiler costs: the compiled ``materl.recipes.grpo`` step vs the hand-written loop.

Both run in ONE process on the same tiny model ("tiny-random"), 4 prompts x group 4 = 16
episodes, max_new_tokens 16, the same reward (0.1 length + 0.9 diversity), k3 KL 0.04, AdamW:

- compiled:  ``ml.compile(grpo, ...).run(prompts)`` (rollout scheduler, group nodes, learner);
- reference: ``examples/reference_grpo_loop.py`` — ``sample``, the reward, then ``grpo_update``
  (the loop a reader would write by hand with ``materl.ops``). ``sample`` runs on one
  long-lived event loop (a blocking portal), as ``Compiled.run`` does: the example's
  ``anyio.run`` per step starts a new loop, hence a new decode worker thread, every step.

Like for like: the compiled learner's shared-prompt forward is off (``share_prompts=False``; it
is a saving in model compute, not framework overhead) and both use fused AdamW; both sample
through the same engine, and both tell it after each update that the weights changed
(``sync_engine``; fused AdamW leaves the version counters the engine also checks unchanged). Both are warmed up, then run alternately (the first of each pair alternates too) for N rounds;
the table shows medians of wall time and of process CPU time (all threads; steadier than wall
time on a shared machine). Goal (issue 38): compiled / reference <= 1.03.

Then: the compiled step's scoring and bookkeeping pieces, each timed alone beside the
reference's one reward call and one advantage call; and the scheduler's per-node overhead, measured with a recipe of K trivial async
``@ml.op`` nodes (each returns its input) over E episodes, rollout stage only:
``(rollout wall - the same K awaits per episode in bare anyio tasks) / (K x E)``, and the same
in the event-loop thread's CPU time (less sensitive to other processes on a shared machine).
With ``--profile``, cProfile of the compiled step (event-loop thread) and of the scheduler
micro-benchmark's rollouts are printed too.

    OMP_NUM_THREADS=1 python benchmarks/overhead.py [--rounds 100] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import pstats
import statistics
import time
from pathlib import Path

import anyio
import anyio.from_thread
import torch

import materl as ml
from materl.compiler.compiled import Compiled
from materl.compiler.context import StageEnv
from materl.compiler.options import CompileOptions
from materl.compiler.scheduler import call_batch
from materl.ops.advantages import ADVANTAGES
from materl.ops.rewards import Reward
from materl.recipes import grpo

ROOT = Path(__file__).resolve().parents[1]
SITE = str(Path(anyio.__file__).resolve().parents[1]) + "/"
PROMPTS = ["Say something short.", "Answer briefly: 2+2?", "Name a colour.", "Count to three."]
GOAL = 1.03  # compiled / reference, issue 38 item 5


def load_reference():
    spec = importlib.util.spec_from_file_location("reference_grpo_loop", ROOT / "examples" / "reference_grpo_loop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Reference:
    """examples/reference_grpo_loop.py's ``main`` loop body, one step per call; ``sample`` runs
    on a long-lived event loop (like ``Compiled.run``)."""

    def __init__(self, *, group_size: int, max_new_tokens: int, lr: float):
        self.loop = load_reference()
        self.policy, self.ref = ml.Agent("tiny-random", trainable=True), ml.Agent("tiny-random")
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=lr, weight_decay=0.0, fused=True)
        self.reward = Reward.from_spec("length", 0.1) + Reward.from_spec("diversity", 0.9)
        self.group_size, self.max_new_tokens, self.steps = group_size, max_new_tokens, 0
        self.parts: dict[str, float] = {}
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self.portal = self._portal_cm.__enter__()

    def close(self) -> None:
        self._portal_cm.__exit__(None, None, None)

    def step(self, prompts: list[str]) -> int:
        g, loop = self.group_size, self.loop
        t0 = time.perf_counter()
        prompt_ids, gens = self.portal.call(lambda: loop.sample(self.policy, prompts, g,
                                                                max_new_tokens=self.max_new_tokens, seed=self.steps))
        completion_ids = [x.token_ids for x in gens]
        texts = [self.policy.tokenizer.decode(c, skip_special_tokens=True) for c in completion_ids]
        rewards_B = self.reward.score(completions=texts, completion_ids=completion_ids)
        group_ids = [i // g for i in range(len(gens))]
        t1 = time.perf_counter()
        loop.grpo_update(self.policy, self.ref, self.optimizer, prompt_ids, completion_ids,
                         [x.logprobs for x in gens], rewards_B, group_ids)
        # as the compiled step does after its update: a fused AdamW step does not bump the
        # parameters' version counters, so without this the engine would not see the new weights
        # and would keep serving prompt prefixes cached under the old ones (4 prompt tokens
        # prefilled a step instead of ~127: less work than the compiled step, and stale)
        self.policy.sync_engine()
        self.parts = {"rollout": t1 - t0, "learner": time.perf_counter() - t1}
        self.steps += 1
        return sum(len(c) for c in completion_ids)


class CompiledGRPO:
    def __init__(self, *, group_size: int, max_new_tokens: int, lr: float, kernels: str):
        self.policy, self.ref = ml.Agent("tiny-random", trainable=True), ml.Agent("tiny-random")
        self.step_fn = ml.compile(grpo, policy=self.policy, ref_policy=self.ref, group_size=group_size,
                                  max_new_tokens=max_new_tokens, lr=lr, kernels=kernels, share_prompts=False)
        self.parts: dict[str, float] = {}

    def step(self, prompts: list[str]) -> int:
        m = self.step_fn.run(prompts)
        self.parts = {"rollout": m["time/stage/rollout"],
                      "learner": m["time/stage/prepare"] + m["time/stage/learner"]}
        return int(m["tokens"])


def timed(runner, prompts: list[str]) -> dict[str, float]:
    """Wall and process CPU seconds of one step (CPU: all threads, so the decode thread too;
    it is less sensitive than wall time to other processes on a shared machine), completion
    tokens, and the engine's decode seconds inside the step."""
    engine = runner.policy.engine
    d0 = engine.stats.decode_s
    c0, t0 = time.process_time(), time.perf_counter()
    tokens = runner.step(prompts)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"step": wall, "cpu": cpu, "tokens": tokens, "decode": engine.stats.decode_s - d0}


def compare(rounds: int, warmup: int, kernels: str) -> dict:
    torch.manual_seed(0)
    kw = dict(group_size=4, max_new_tokens=16, lr=1e-6)
    runners = {"compiled": CompiledGRPO(kernels=kernels, **kw), "reference": Reference(**kw)}
    for _ in range(warmup):
        for r in runners.values():
            r.step(PROMPTS)
    rows: dict[str, dict[str, list[float]]] = {k: {} for k in runners}
    ratios = []
    for i in range(rounds):
        order = ["compiled", "reference"] if i % 2 == 0 else ["reference", "compiled"]
        got = {}
        for name in order:
            got[name] = timed(runners[name], PROMPTS)
            for key, v in {**got[name], **runners[name].parts}.items():
                rows[name].setdefault(key, []).append(v)
        ratios.append(got["compiled"]["step"] / got["reference"]["step"])
    runners["reference"].close()
    return {"rows": rows, "ratios": ratios, "runners": runners}


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def print_compare(res: dict, rounds: int) -> float:
    rows = res["rows"]
    print(f"\n## compiled grpo vs reference loop ({rounds} alternating rounds, medians)\n")
    print("| path | step (wall) | step (CPU) | rollout stage | engine decode | learner | other | tokens/step |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        other = [s - a - b for s, a, b in zip(r["step"], r["rollout"], r["learner"])]
        print(f"| {name} | {med(r['step']) * 1e3:.1f} ms | {med(r['cpu']) * 1e3:.1f} ms | "
              f"{med(r['rollout']) * 1e3:.1f} ms | "
              f"{med(r['decode']) * 1e3:.1f} ms | {med(r['learner']) * 1e3:.1f} ms | {med(other) * 1e3:.2f} ms | "
              f"{statistics.mean(r['tokens']):.1f} |")
    ratio = med(rows["compiled"]["step"]) / med(rows["reference"]["step"])
    cpu_ratio = med(rows["compiled"]["cpu"]) / med(rows["reference"]["cpu"])
    q = statistics.quantiles(res["ratios"], n=4)
    print(f"\ncompiled / reference, wall (ratio of medians): {ratio:.3f}   (goal <= {GOAL}: "
          f"{'met' if ratio <= GOAL else 'MISSED'})")
    print(f"compiled / reference, CPU  (ratio of medians): {cpu_ratio:.3f}   (goal <= {GOAL}: "
          f"{'met' if cpu_ratio <= GOAL else 'MISSED'})")
    print(f"per-round wall ratio: median {med(res['ratios']):.3f}, quartiles {q[0]:.3f} .. {q[2]:.3f}")
    print("(rollout stage = sampling + rewards, incl. the engine's batch forming and thread hop; "
          "learner = reference forward + policy forward/backward + optimizer step; other = the rest of the step)")
    return ratio


# -- per-node scheduler overhead -------------------------------------------------------------


@ml.op
async def passthrough(x):
    return x


def trivial_recipe(k: int):
    @ml.recipe
    def chain(prompts):
        v = prompts
        for _ in range(k):
            v = passthrough(v)
        return v

    return chain


async def bare(prompts: list[str], k: int) -> None:
    """The same work without materl: K awaits of the op's function per episode, one task each."""

    async def one(p):
        v = p
        for _ in range(k):
            v = await passthrough.fn(v)

    async with anyio.create_task_group() as tg:
        for p in prompts:
            tg.start_soon(one, p)


def node_overhead(k: int, episodes: int, repeat: int) -> dict:
    compiled = Compiled(trivial_recipe(k), {}, CompileOptions(), rollout_only=True)
    prompts = [f"p{i}" for i in range(episodes)]

    async def timed_run(fn) -> tuple[float, float]:
        """Wall seconds and the event-loop thread's CPU seconds (steadier on a shared machine)."""
        c0, t0 = time.thread_time(), time.perf_counter()
        await fn()
        return time.perf_counter() - t0, time.thread_time() - c0

    sched, base = [], []
    for i in range(repeat + 3):
        a = compiled.call_blocking(timed_run, lambda: compiled.rollout(prompts))
        b = compiled.call_blocking(timed_run, lambda: bare(prompts, k))
        if i >= 3:
            sched.append(a)
            base.append(b)
    compiled.close()
    out = {"k": k, "episodes": episodes}
    for j, key in enumerate(("", "_cpu")):
        s, b = med([x[j] for x in sched]), med([x[j] for x in base])
        out |= {f"sched{key}": s, f"bare{key}": b, f"per_node{key}": (s - b) / (k * episodes),
                f"per_node_gross{key}": s / (k * episodes)}
    return out


def print_node_overhead(r: dict) -> None:
    print(f"\n## scheduler overhead per node per episode ({r['k']} trivial async @ml.op nodes x "
          f"{r['episodes']} episodes, rollout stage, medians)\n")
    print("| time | rollout (materl) | same awaits in bare anyio tasks | per node per episode (net) | gross |")
    print("|---|---|---|---|---|")
    for key, what in (("", "wall"), ("_cpu", "event-loop thread CPU")):
        print(f"| {what} | {r['sched' + key] * 1e3:.2f} ms | {r['bare' + key] * 1e3:.2f} ms | "
              f"{r['per_node' + key] * 1e6:.1f} us | {r['per_node_gross' + key] * 1e6:.1f} us |")


def grpo_node_accounting(res: dict) -> None:
    """The grpo plan has 6 nodes over 16 episodes; (compiled - reference) spread over them."""
    rows = res["rows"]
    for key in ("step", "cpu"):
        diff = med(rows["compiled"][key]) - med(rows["reference"][key])
        print(f"grpo step {'wall' if key == 'step' else 'CPU '}: (compiled - reference) medians = {diff * 1e3:+.2f} ms "
              f"= {diff / (6 * 16) * 1e6:+.1f} us per node per episode (6 nodes x 16 episodes)")


def atimeit(fn, repeat: int = 100) -> float:
    """Median seconds of ``await fn()``, all calls in one event loop (``anyio.run`` per call
    would time the loop's start too)."""
    async def go() -> list[float]:
        await fn()
        samples = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            await fn()
            samples.append(time.perf_counter() - t0)
        return samples

    return med(anyio.run(go))


def timeit(fn, repeat: int = 100) -> float:
    fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return med(samples)


def attribute(runner: CompiledGRPO) -> None:
    """Time the compiled step's scoring and bookkeeping pieces alone, on one step's real
    episodes, beside what the hand-written loop does for the same work (one reward call over the
    batch, one advantage call); the rest of a step is the same model work on both sides."""
    st = runner.step_fn
    eps = st.call_blocking(st.rollout, PROMPTS)
    run = StageEnv(st.context(), st.agents)
    reward = Reward.from_spec("length", 0.1) + Reward.from_spec("diversity", 0.9)
    rollouts = [st.episode_rollout(e) for e in eps]
    texts, ids = [r.text for r in rollouts], [r.completion_ids for r in rollouts]
    scores = reward.score(completions=texts, completion_ids=ids)
    mask = torch.nn.utils.rnn.pad_sequence([torch.tensor(r.loss_mask, dtype=torch.float64) for r in rollouts],
                                           batch_first=True)
    for e, v in zip(eps, anyio.run(call_batch, run, "rewards", eps)):
        e.store("rewards", v)
    rows = [
        ("rewards", "kinds/rewards.py (one call per tick)", atimeit(lambda: call_batch(run, "rewards", eps)),
         timeit(lambda: reward.score(completions=texts, completion_ids=ids))),
        ("advantages", "kinds/advantages.py (groups together)",
         atimeit(lambda: call_batch(run, "advantages", eps)),
         timeit(lambda: ADVANTAGES.get("grpo")(scores.double(), mask, group_ids=[e.group for e in eps]))),
        ("metrics", "compiled.py:rollout_metrics", timeit(lambda: st.rollout_metrics(eps)), 0.0),
        ("reference update", "compiled.py:update_references", timeit(lambda: st.update_references(0.0)), 0.0),
    ]
    print("\n## the compiled step's scoring and bookkeeping, each piece timed alone (medians)\n")
    print("| piece | where | compiled | hand-written loop | extra |")
    print("|---|---|---|---|---|")
    total = 0.0
    for what, where, plan_s, once_s in rows:
        total += plan_s - once_s
        print(f"| {what} | materl/compiler/{where} | {plan_s * 1e3:.2f} ms | {once_s * 1e3:.2f} ms | "
              f"{(plan_s - once_s) * 1e3:+.2f} ms |")
    print(f"| total | | | | {total * 1e3:+.2f} ms |")


def profile_compiled(steps: int, kernels: str) -> None:
    """cProfile ``arun`` in this thread's event loop (``run`` would hop to the portal thread,
    which cProfile does not see). The engine's decode runs in a worker thread and is not shown."""
    runner = CompiledGRPO(group_size=4, max_new_tokens=16, lr=1e-6, kernels=kernels)

    async def go(n: int) -> None:
        for _ in range(n):
            await runner.step_fn.arun(PROMPTS)

    anyio.run(go, 3)
    prof = cProfile.Profile()
    prof.enable()
    anyio.run(go, steps)
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(20)
    print(f"\n## cProfile of {steps} compiled steps (event-loop thread only), top 20 by own time\n")
    print("```")
    print("\n".join(line.replace(str(ROOT) + "/", "").replace(SITE, "") for line in out.getvalue().splitlines()
                    if line.strip()))
    print("```")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(r"materl/", 25)
    print("\n## same profile, materl functions by cumulative time\n")
    print("```")
    print("\n".join(line.replace(str(ROOT) + "/", "").replace(SITE, "") for line in out.getvalue().splitlines()
                    if line.strip()))
    print("```")


def profile_nodes(k: int, episodes: int, rollouts: int = 20) -> None:
    """cProfile of the scheduler micro-benchmark's rollouts (``node_overhead``'s recipe), top 15
    by own time: what a node costs beyond the bare awaits."""
    compiled = Compiled(trivial_recipe(k), {}, CompileOptions(), rollout_only=True)
    prompts = [f"p{i}" for i in range(episodes)]

    async def go() -> None:
        for _ in range(rollouts):
            await compiled.rollout(prompts)

    anyio.run(go)
    prof = cProfile.Profile()
    prof.enable()
    anyio.run(go)
    prof.disable()
    compiled.close()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
    print(f"\n## cProfile of {rollouts} rollouts of {k} trivial nodes x {episodes} episodes, top 15 by own time\n")
    print("```")
    print("\n".join(line.replace(str(ROOT) + "/", "").replace(SITE, "") for line in out.getvalue().splitlines()
                    if line.strip()))
    print("```")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--kernels", default="torch", choices=("torch", "auto", "mojo"),
                    help="policy-loss implementation of the compiled step (reference uses torch ops)")
    ap.add_argument("--nodes", type=int, default=16, help="trivial nodes per episode")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    print(f"torch threads: {torch.get_num_threads()}, kernels={args.kernels}")
    res = compare(args.rounds, args.warmup, args.kernels)
    print_compare(res, args.rounds)
    grpo_node_accounting(res)
    attribute(res["runners"]["compiled"])
    res["runners"]["compiled"].step_fn.close()
    print_node_overhead(node_overhead(args.nodes, args.episodes, repeat=30))
    if args.profile:
        profile_compiled(30, args.kernels)
        profile_nodes(args.nodes, args.episodes)


if __name__ == "__main__":
    main()
