"""Asynchronous rollouts vs lock-step on a tool-use task whose tool latency has a long tail.

Every episode makes one real MCP tool call (``benchmarks/_servers/sleep_echo.py`` over stdio)
that takes a lognormal time: median ``--median`` s, sigma 0.99, so p99 is about 10x the median
(the latency is drawn from the episode's sampled tokens, so every configuration sees the same
draws for the same samples). The tiny random model never writes a tool call, so an async
``@ml.op`` turns turn 1 into one (its sampled ids stay); turn 2 reads the tool's answer.

One run, configurations in turn on the same data and seed: lock-step (``max_staleness=0``),
``max_staleness`` 1, 2, 4 in process, then S=2 with 1 and 2 Ray rollout workers. Printed per
configuration: episodes per second over the steps after the first, the ratio to lock-step, the
mean reward of the first and the last half of the steps, staleness, and the weight-publication
time per step.

    OMP_NUM_THREADS=1 python benchmarks/async_pipeline.py [--steps 10] [--batch 4] [--group 4] [--median 1.0]
                                                          [--model tiny-random] [--no-ray]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

import materl as ml
from materl.distributed.cost_model import Stages, expected_max_lognormal, step_time
from materl.rollout.multiturn import TurnResult
from materl.rollout.types import ToolCall
from materl.runtime.tasks import arithmetic_rows
from materl.runtime.train import train

SERVER = f"{sys.executable} {Path(__file__).resolve().parent / '_servers/sleep_echo.py'}"
SIGMA = math.log(10) / 2.326  # p99 / median = exp(2.326 sigma) = 10


def latency(token_ids: list[int], median: float) -> float:
    """A lognormal draw keyed by the sampled tokens (the same samples wait the same time)."""
    digest = hashlib.sha256(repr(token_ids).encode()).digest()
    u1, u2 = (int.from_bytes(digest[i:i + 8], "big") / 2**64 for i in (0, 8))
    z = math.sqrt(-2 * math.log(max(u1, 1e-12))) * math.cos(2 * math.pi * u2)  # Box-Muller
    return median * math.exp(SIGMA * z)


def even_tokens(*, completion_ids, **_) -> list[float]:
    """A reward a random model can learn: the share of even token ids (tool tokens included)."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def slow_tool_recipe(toolbox, median: float):
    @ml.op
    async def call_slow_tool(step) -> {"step": TurnResult}:
        state = step.history
        call = ToolCall("sleep_echo", {"text": "done", "seconds": latency(step.token_ids, median)}, id="call_0")
        last = dataclasses.replace(state.steps[-1], tool_calls=[call], finish_reason="tool_call")
        return {"step": TurnResult(dataclasses.replace(state, steps=state.steps[:-1] + [last], done=False), last)}

    @ml.recipe
    def slow_tool_grpo(policy, prompts):
        turn_1 = call_slow_tool(ml.generate_step(policy, prompts, name="turn_1"))
        results = ml.call_tools(turn_1, tools=toolbox, name="tool_results")
        rollout = ml.structure_rollout(ml.generate_step(policy, turn_1.history, results, tools=toolbox,
                                                        name="turn_2"), name="rollout")
        rewards = ml.reward(even_tokens, rollout=rollout)
        ml.set_loss(ml.policy_loss(ml.advantages(rewards, completions=rollout), ml.logprobs(policy, prompts, rollout)))

    return slow_tool_grpo


def one_run(args, *, staleness: int, workers: int = 0, median: float | None = None) -> dict:
    median = args.median if median is None else median
    recipe = slow_tool_recipe(ml.mcp_tools(SERVER, max_concurrency=64), median)  # a service sized for the load
    step = ml.compile(recipe, policy=ml.Agent(args.model, trainable=True), group_size=args.group,
                      max_new_tokens=args.max_new_tokens, lr=1e-4, seed=0, max_staleness=staleness)
    done: list[float] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = train(step, arithmetic_rows(args.steps * args.batch, seed=1), steps=args.steps, batch_size=args.batch,
                        run_dir=tmp, progress=False, tensorboard=False, workers=workers,
                        on_step=lambda k, m: done.append(time.perf_counter()))
    finally:
        step.close()
    h = out["history"]
    episodes = sum(m["episodes"] for m in h[1:])
    half = len(h) // 2
    return {"history": h, "eps_per_s": episodes / (done[-1] - done[0]),
            "reward_first": statistics.fmean(m["reward"] for m in h[:half]),
            "reward_last": statistics.fmean(m["reward"] for m in h[half:]),
            "staleness_mean": statistics.fmean(m["async/staleness_mean"] for m in h),
            "staleness_max": max(m["async/staleness_max"] for m in h),
            "dropped": sum(m["async/dropped_stale"] for m in h),
            "publish_ms": 1e3 * statistics.median(m["time/publish"] for m in h)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--median", type=float, default=1.0, help="median tool latency, seconds")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray worker configurations")
    args = parser.parse_args()
    configs = [("lock-step (S=0)", 0, 0), ("S=1", 1, 0), ("S=2", 2, 0), ("S=4", 4, 0)]
    if not args.no_ray:
        configs += [("S=2, 1 Ray worker", 2, 1), ("S=2, 2 Ray workers", 2, 2)]
    print(f"{args.model}: {args.steps} steps x {args.batch} prompts x {args.group} episodes, one MCP call each, "
          f"lognormal latency median {args.median}s (p99 ~{10 * args.median:.1f}s)", flush=True)
    print("| configuration | episodes/s | vs lock-step | reward first half | reward last half | staleness mean / max "
          "| dropped | publish ms/step |")
    print("|---|---|---|---|---|---|---|---|")
    results = {}
    for label, staleness, workers in configs:
        r = results[label] = one_run(args, staleness=staleness, workers=workers)
        base = results["lock-step (S=0)"]["eps_per_s"]
        print(f"| {label} | {r['eps_per_s']:.2f} | {r['eps_per_s'] / base:.2f}x | {r['reward_first']:.3f} | "
              f"{r['reward_last']:.3f} | {r['staleness_mean']:.2f} / {r['staleness_max']:.0f} | {r['dropped']:.0f} | "
              f"{r['publish_ms']:.1f} |", flush=True)
    cost_model(args, results)


def cost_model(args, results: dict) -> None:
    """The cost model fitted on the lock-step run: its prediction for the measured
    configurations, then for 8 and 64 workers."""
    fast = one_run(args, staleness=0, median=1e-3)["history"]  # tools that answer at once: generation alone
    generate = statistics.median(m["time/stage/rollout"] for m in fast[1:])
    tail = [latency([i], args.median) for i in range(2_000)]  # one episode's wait: the task's lognormal
    s = Stages.measured(results["lock-step (S=0)"]["history"], generate_s=generate, tail=tail)
    print(f"\ncost model from the lock-step runs: generation {s.generate_s:.2f}s (tools answering at once), tool wait "
          f"{s.tool_wait_s:.2f}s (E[max] of {s.episodes} lognormal waits: "
          f"{expected_max_lognormal(args.median, SIGMA, s.episodes):.2f}s), learner {s.learn_s:.2f}s, publish "
          f"{1e3 * s.publish_s:.1f}ms per step")
    print("| configuration | measured episodes/s | predicted | predicted / measured |")
    print("|---|---|---|---|")
    for label, S, n in [("S=1", 1, 0), ("S=2", 2, 0), ("S=4", 4, 0), ("S=2, 1 Ray worker", 2, 1),
                        ("S=2, 2 Ray workers", 2, 2)]:
        if label in results:
            predicted = s.episodes / step_time(s, workers=max(n, 1), staleness=S, in_process=n == 0)
            print(f"| {label} | {results[label]['eps_per_s']:.2f} | {predicted:.2f} | "
                  f"{predicted / results[label]['eps_per_s']:.2f} |")
    heavy = s.scaled(20)  # the same task with 20x the model work per episode (a bigger model)
    print(f"\npredicted episodes/s, this task and the same task with 20x the generation and learner work:")
    print("| workers | lock-step | S=2 | S=2, 8 learner ranks | 20x: lock-step | 20x: S=2 | 20x: S=2, 8 learner ranks |")
    print("|---|---|---|---|---|---|---|")
    for n in (1, 8, 64):
        row = [st.episodes / step_time(st, workers=n, staleness=S, learner_ranks=r)
               for st in (s, heavy) for S, r in ((0, 1), (2, 1), (2, 8))]
        print(f"| {n} | " + " | ".join(f"{x:.1f}" for x in row) + " |")


if __name__ == "__main__":
    main()
