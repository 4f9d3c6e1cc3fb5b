"""Tool calls under faults: 1,000 calls, 10% crash the server, 10% hang, 10% answer garbage.

Episodes run through the compiled rollout scheduler (rollout stage only, no model): each
episode makes its calls one after another with ``ml.call_tools`` on the faulty MCP server of
the test suite (``tests/tools/faulty_server.py``, stdio; a normal call takes ``--seconds``).
The fault of each call is fixed by a seeded schedule and travels in the call's arguments, so
every failure has a known culprit.

- crash: the server process exits mid-call (the call is retried once and crashes again);
- hang: the call never answers (it must time out at ``tool_timeout_s``, to within 10%);
- garbage: the answer is not a valid MCP result (a protocol error on that call).

Goals: 0 lost episodes, 0 hangs (no call still unanswered at 2x its timeout), hung calls end at
their timeout to within 10% (``ToolResult.server_s``, the time on a live server, which is what
``tool_timeout_s`` bounds), 0 failed calls that had no fault of their own, wall time <= 1.25x
the critical-path bound. The bound is what a runtime
with free recovery would take: the longest episode's own tool time (``--seconds`` per normal
call, ``tool_timeout_s`` per hang, nothing for a crash or garbage); restarting servers,
retrying and handshakes are overhead. ``--isolation episode`` (default) gives each episode
its own server from a pre-started pool; ``--isolation shared`` runs one server for all.
``--parsers`` also times every tool-call parser on adversarial text of growing size (linear
time means 4x the text takes about 4x the time).

    OMP_NUM_THREADS=1 python benchmarks/tool_faults.py [--episodes 10] [--calls 1000] [--isolation episode]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import anyio

import materl as ml
from materl.compiler.compiled import Compiled
from materl.compiler.options import CompileOptions
from materl.rollout.mcp import MCPServer
from materl.rollout.types import ToolCall

FAULTY = Path(__file__).resolve().parents[1] / "tests" / "tools" / "faulty_server.py"
EXPECTED = {"none": None, "crash": "crash", "hang": "timeout", "garbage": "protocol"}


def schedule(episodes: int, calls: int, seed: int) -> list[list[str]]:
    """Exactly 10% crash, 10% hang, 10% garbage, shuffled, split into episodes."""
    n = calls // 10
    faults = ["crash"] * n + ["hang"] * n + ["garbage"] * n + ["none"] * (calls - 3 * n)
    random.Random(seed).shuffle(faults)
    per = calls // episodes
    return [faults[i * per:(i + 1) * per] for i in range(episodes)]


def fault_recipe(toolbox, plan: list[list[str]], seconds: float):
    @ml.op
    async def next_call(prompt, previous=None, *, turn: int) -> {"calls": list}:
        fault = plan[int(prompt.split()[1])][turn]
        return {"calls": [ToolCall("work", {"fault": fault, "seconds": seconds}, id=f"call_{turn}")]}

    @ml.recipe
    def faults(prompts):
        results = None
        for turn in range(len(plan[0])):
            calls = next_call(prompts, results, turn=turn)
            results = ml.call_tools(calls, tools=toolbox, name=f"call_{turn}")

    return faults


async def experiment(args) -> dict:
    plan = schedule(args.episodes, args.calls, args.seed)
    server = MCPServer(command=[sys.executable, "-I", "-S", str(FAULTY)], isolation=args.isolation,
                       pool_size=args.pool_size, max_concurrency=args.episodes)
    toolbox = ml.mcp_tools(server)
    options = CompileOptions(tool_timeout_s=args.timeout, max_concurrent_episodes=args.episodes,
                             episode_timeout_s=3600.0)
    compiled = Compiled(fault_recipe(toolbox, plan, args.seconds), {}, options, rollout_only=True)
    bound = max(sum(args.seconds if f == "none" else args.timeout if f == "hang" else 0.0 for f in ep) for ep in plan)
    async with toolbox:
        await compiled.start_services()
        deadline = time.monotonic() + 60
        while toolbox.stats[toolbox._backends[0].name].get("starts", 0) < 1 + args.pool_size \
                and time.monotonic() < deadline:
            await anyio.sleep(0.05)  # a full pool before the clock starts
        t0 = time.perf_counter()
        with anyio.move_on_after(bound * 4) as watchdog:
            episodes = await compiled.rollout([f"episode {i}" for i in range(args.episodes)])
        wall = time.perf_counter() - t0
        stats = dict(next(iter(toolbox.stats.values())))
    if watchdog.cancelled_caught:
        raise RuntimeError(f"the rollout did not finish within 4x the bound ({bound * 4:.0f} s): a hang")
    return {"plan": plan, "episodes": episodes, "wall": wall, "bound": bound, "stats": stats}


def report(out: dict, args) -> bool:
    plan, episodes, wall, bound = out["plan"], out["episodes"], out["wall"], out["bound"]
    lost = [e for e in episodes if e.error is not None]
    rows = []  # (fault, result)
    for ep in episodes:
        if ep.error is None:
            faults = plan[int(ep.prompt.split()[1])]
            rows += [(faults[t], ep.values[f"call_{t}"][0]) for t in range(len(faults))]
    innocent_failed = [r for f, r in rows if f == "none" and r.is_error]
    wrong_kind = [(f, r.error_kind) for f, r in rows if f != "none" and r.error_kind != EXPECTED[f]]
    hung = [r for f, r in rows if r.latency_s > 2 * args.timeout]  # stuck: 2x its timeout and still waiting
    timeouts = [r.server_s / args.timeout for f, r in rows if f == "hang"]  # what timeout_s bounds
    kinds = Counter(r.error_kind or "ok" for _, r in rows)
    retried = sum(r.attempts > 1 for f, r in rows if f == "none")
    print(f"{len(rows)} tool calls in {args.episodes} episodes of {len(plan[0])} calls, isolation={args.isolation}, "
          f"normal call {args.seconds} s, tool_timeout_s {args.timeout}, pool {args.pool_size}")
    print(f"results by kind: {dict(sorted(kinds.items()))}; fault calls with an unexpected kind: {len(wrong_kind)}")
    print(f"server: {out['stats']}")
    waits = [r.latency_s - r.server_s for _, r in rows]
    print(f"waiting for a (re)starting server or a slot, per call: median {statistics.median(waits) * 1e3:.1f} ms, "
          f"max {max(waits) * 1e3:.0f} ms")
    if lost:
        print(f"lost episodes: {len(lost)}, first error: {lost[0].error}")
    print(f"calls without a fault that were retried after another call's crash (and succeeded): {retried}")
    print("\n| goal | measured | met? |")
    print("|---|---|---|")
    checks = [("lost episodes = 0", str(len(lost)), not lost),
              ("hangs (a call unanswered at 2x its timeout) = 0", str(len(hung)), not hung),
              ("hung calls end at their timeout, to within 10% (time on the server / timeout_s)",
               f"median {statistics.median(timeouts):.3f}, max {max(timeouts):.3f}" if timeouts else "-",
               bool(timeouts) and max(timeouts) <= 1.1),
              ("failed calls with no fault of their own = 0", str(len(innocent_failed)), not innocent_failed),
              ("wall / critical-path bound <= 1.25", f"{wall:.2f} s / {bound:.2f} s = {wall / bound:.3f}",
               wall / bound <= 1.25)]
    for goal, measured, ok in checks:
        print(f"| {goal} | {measured} | {'yes' if ok else '**no**'} |")
    return all(ok for *_, ok in checks)


def parser_scaling() -> None:
    """Each format on adversarial text of 256 KiB and 1 MiB (best of 3): a time ratio ~4 means linear."""
    from materl.rollout.parsers import TOOL_PARSERS

    cases = {"{ x n": "{", "<tool_call> x n": "<tool_call>", '{"name":  x n': '{"name": ', "``` x n": "```",
             "[TOOL_CALLS] x n": "[TOOL_CALLS]", "nested call": None}
    print("\n| parser | input | 256 KiB | 1 MiB | ratio |")
    print("|---|---|---|---|---|")
    for name in TOOL_PARSERS.names():
        fmt = TOOL_PARSERS.get(name)
        for label, unit in cases.items():
            times = []
            for size in (256 << 10, 1 << 20):
                text = (unit * (size // len(unit))) if unit else \
                    '{"name": "f", "arguments": ' + '{"a": ' * (size // 12) + "1" + "}" * (size // 12) + "}"
                best = float("inf")
                for _ in range(3):  # best of 3: garbage-collection pauses are noise here
                    t0 = time.perf_counter()
                    fmt(text)
                    best = min(best, time.perf_counter() - t0)
                times.append(best)
            print(f"| {name} | {label} | {times[0] * 1e3:.0f} ms | {times[1] * 1e3:.0f} ms | "
                  f"{times[1] / max(times[0], 1e-9):.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--episodes", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=0.5, help="duration of a normal call")
    ap.add_argument("--timeout", type=float, default=2.0, help="tool_timeout_s (a hung call's cost)")
    ap.add_argument("--isolation", choices=("episode", "shared"), default="episode")
    ap.add_argument("--pool-size", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parsers", action="store_true", help="also time the parsers on adversarial text")
    args = ap.parse_args()
    if args.calls % args.episodes:
        ap.error(f"--calls must be a multiple of --episodes, got {args.calls} and {args.episodes}")
    ok = report(anyio.run(experiment, args), args)
    if args.parsers:
        parser_scaling()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
