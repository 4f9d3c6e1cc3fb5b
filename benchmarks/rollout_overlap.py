"""Does the rollout scheduler overlap slow tools with generation? Three walls from one run.

64 episodes (16 prompts x group 4) on the tiny model, each: generate -> tool -> generate ->
tool -> generate -> tool -> generate, i.e. 3 tool calls and 4 generate turns. The tool is a real
MCP server (``benchmarks/_servers/sleep_echo.py``, stdio, plugged in with ``ml.mcp_tools``)
whose ``sleep_echo`` awaits ``anyio.sleep(0.2)``. The tiny random model never writes a tool
call, so an async ``@ml.op`` forces one per turn: it rewrites the last generate step to request
``sleep_echo`` (a fixed request), awaits ``toolbox.call``, and hands both to the next
``ml.generate_step``, which appends the result as exact tokens and generates.

- scheduler:  the recipe compiled (rollout stage only), all 64 episodes as async tasks;
- sequential: a plain multi-turn rollout loop: for each episode, for each turn,
  generate, then await the tool (same engine, same toolbox, same materl step functions);
- bound:      the critical path with perfect overlap: 4 batched generations of 64 rows (each
  measured on the real contexts of that turn, the 64 requests in flight at once) + 3 x 0.2 s.

Goals: scheduler / bound <= 1.25, sequential / scheduler >= 10.

    OMP_NUM_THREADS=1 python benchmarks/rollout_overlap.py [--episodes 64] [--tool-calls 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import anyio
import torch

import materl as ml
from materl.compiler.compiled import Compiled
from materl.compiler.context import StageEnv, sampling
from materl.compiler.options import CompileOptions
from materl.rollout.multiturn import EpisodeState, generate_step
from materl.rollout.tool_formats import stop_strings
from materl.rollout.types import ToolCall

SERVER = Path(__file__).resolve().parent / "_servers" / "sleep_echo.py"
TOOL_S = 0.2
PROMPTS = [f"Look up item {i} with the tool." for i in range(16)]


def force_call(state: EpisodeState, turn: int) -> tuple[EpisodeState, ToolCall]:
    """The episode as if its last generate step had requested ``sleep_echo``."""
    call = ToolCall("sleep_echo", {"text": f"result of call {turn}"}, id=f"call_{turn}")
    last = dataclasses.replace(state.steps[-1], tool_calls=[call], finish_reason="tool_call")
    return dataclasses.replace(state, steps=state.steps[:-1] + [last], done=False), call


def overlap_recipe(toolbox, *, tool_calls: int):
    @ml.op
    async def sleep_tool(step) -> {"history": EpisodeState, "results": list}:
        state, call = force_call(step.history, len(step.history.steps))
        result = await toolbox.call(call.name, call.arguments, call_id=call.id)
        return {"history": state, "results": [result]}

    @ml.recipe
    def tool_episodes(policy, prompts):
        step = ml.generate_step(policy, prompts, name="turn_1")
        for t in range(tool_calls):
            tool = sleep_tool(step)
            step = ml.generate_step(policy, tool.history, tool.results, name=f"turn_{t + 2}")
        ml.structure_rollout(step, name="rollout")

    return tool_episodes


async def run_scheduler(compiled: Compiled, group_size: int) -> tuple[float, list]:
    t0 = time.perf_counter()
    episodes = await compiled.rollout(PROMPTS, group_size=group_size)
    wall = time.perf_counter() - t0
    failed = [e.error for e in episodes if e.error]
    if failed:
        raise RuntimeError(f"{len(failed)} episodes failed, first: {failed[0]}")
    return wall, episodes


async def run_sequential(compiled: Compiled, episodes: list, toolbox, *, tool_calls: int) -> float:
    """One episode after another, each turn: generate, then await the tool (a plain for-loop)."""
    agent = compiled.agents["policy"]
    node = compiled.plan.nodes["turn_1"]
    run = StageEnv(compiled.context(), compiled.agents)
    t0 = time.perf_counter()
    for ep in episodes:
        state = EpisodeState.start(agent.tokenizer, ep.prompt)
        res = await generate_step(agent.engine, agent.tokenizer, state, None, sampling(run, node, ep.seed, 0))
        for turn in range(1, tool_calls + 1):
            state, call = force_call(res.history, len(res.history.steps))
            result = await toolbox.call(call.name, call.arguments, call_id=call.id)
            res = await generate_step(agent.engine, agent.tokenizer, state, [result],
                                      sampling(run, node, ep.seed, turn))
    return time.perf_counter() - t0


async def batched_generation(engine, contexts: list[list[int]], params: list) -> tuple[float, int]:
    """Wall of the requests all in flight at once, and how many engine batches they took."""
    b0 = engine.stats.batches
    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for ids, p in zip(contexts, params):
            tg.start_soon(engine.generate, ids, p)
    return time.perf_counter() - t0, engine.stats.batches - b0


def with_parser_stops(params):
    """The sampling params ``generate_step`` really sends (it adds the tool parser's stop strings)."""
    return dataclasses.replace(params, stop_strings=tuple(params.stop_strings) + tuple(stop_strings("hermes")))


async def measure_bound(compiled: Compiled, episodes: list, *, tool_calls: int) -> list[tuple[float, int]]:
    """Per generate turn: one batched generation of every episode's exact context at that turn."""
    agent = compiled.agents["policy"]
    node = compiled.plan.nodes["turn_1"]
    rollouts = [e.values["rollout"] for e in episodes]
    turns = []
    for turn in range(tool_calls + 1):
        contexts = []
        for r in rollouts:
            ids = list(r.prompt_ids)
            gen_seen = 0
            for s in r.steps:
                if s.kind == "generate":
                    if gen_seen == turn:
                        break
                    gen_seen += 1
                ids += s.token_ids
            contexts.append(ids)
        params = [with_parser_stops(sampling(StageEnv(compiled.context(), compiled.agents), node, ep.seed, turn)) for ep in episodes]
        turns.append(await batched_generation(agent.engine, contexts, params))
    return turns


async def experiment(args) -> dict:
    policy = ml.Agent("tiny-random")
    toolbox = ml.mcp_tools(f"{sys.executable} {SERVER}", max_concurrency=args.episodes)
    options = CompileOptions(max_new_tokens=args.max_new_tokens, max_turns=args.tool_calls + 1,
                             group_size=args.episodes // len(PROMPTS))
    compiled = Compiled(overlap_recipe(toolbox, tool_calls=args.tool_calls), {"policy": policy}, options,
                        rollout_only=True)
    engine = policy.engine
    out: dict = {"sched": [], "bound_turns": []}
    async with toolbox:
        await run_scheduler(compiled, options.group_size)  # warm-up: server, engine, templates
        for _ in range(args.repeat):
            b0, r0 = engine.stats.batches, engine.stats.requests
            wall, episodes = await run_scheduler(compiled, options.group_size)
            out["sched"].append(wall)
            out["batches"] = engine.stats.batches - b0
            out["requests"] = engine.stats.requests - r0
            out["bound_turns"].append(await measure_bound(compiled, episodes, tool_calls=args.tool_calls))
        steps = [s for e in episodes for s in e.values["rollout"].steps]
        out["tool_latency"] = [r.latency_s for s in steps if s.kind == "tool" for r in s.tool_results]
        out["tool_errors"] = sum(r.is_error for s in steps if s.kind == "tool" for r in s.tool_results)
        out["gen_steps"] = sum(s.kind == "generate" for s in steps) / len(episodes)
        out["tokens"] = sum(len(s.token_ids) for s in steps if s.kind == "generate") / len(episodes)
        out["sequential"] = await run_sequential(compiled, episodes, toolbox, tool_calls=args.tool_calls)
    return out


def report(out: dict, args) -> None:
    sched = statistics.median(out["sched"])
    per_turn = [statistics.median(run[t][0] for run in out["bound_turns"]) for t in range(args.tool_calls + 1)]
    split = max(n for run in out["bound_turns"] for _, n in run)
    bound = sum(per_turn) + args.tool_calls * TOOL_S
    seq = out["sequential"]
    lat = out["tool_latency"]
    print(f"torch threads: {torch.get_num_threads()}; {args.episodes} episodes x {args.tool_calls} tool calls "
          f"({out['gen_steps']:.0f} generate turns, {out['tokens']:.1f} generated tokens per episode), "
          f"tool sleeps {TOOL_S} s; scheduler median of {args.repeat} runs")
    print(f"tool latency seen by episodes (MCP round trip): median {statistics.median(lat) * 1e3:.0f} ms, "
          f"max {max(lat) * 1e3:.0f} ms, errors {out['tool_errors']}")
    print(f"engine batches in the last scheduler run: {out['batches']} for {out['requests']} requests "
          f"(mean {out['requests'] / out['batches']:.1f} rows per batch)")
    print(f"batched generation per turn ({args.episodes} requests in flight, one engine batch each"
          f"{'' if split == 1 else f'; up to {split} batches'}): "
          + ", ".join(f"turn {t + 1} {s * 1e3:.0f} ms" for t, s in enumerate(per_turn)))
    print("\n| rollout | wall | vs bound |")
    print("|---|---|---|")
    print(f"| materl scheduler | {sched:.2f} s | {sched / bound:.2f} |")
    print(f"| sequential loop (a plain for-loop) | {seq:.2f} s | {seq / bound:.1f} |")
    print(f"| critical-path bound ({args.tool_calls + 1} batched generations + {args.tool_calls} x {TOOL_S} s) | "
          f"{bound:.2f} s | 1.00 |")
    ok1, ok2 = sched / bound <= 1.25, seq / sched >= 10
    print(f"\nscheduler / bound = {sched / bound:.2f}   (goal <= 1.25: {'met' if ok1 else 'MISSED'})")
    print(f"sequential / scheduler = {seq / sched:.1f}   (goal >= 10: {'met' if ok2 else 'MISSED'})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=64, help="a multiple of 16 (16 prompts x group)")
    ap.add_argument("--tool-calls", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3, help="scheduler runs (median); the sequential loop runs once")
    args = ap.parse_args()
    if args.episodes % len(PROMPTS):
        ap.error(f"--episodes must be a multiple of {len(PROMPTS)}, got {args.episodes}")
    report(anyio.run(experiment, args), args)


if __name__ == "__main__":
    main()
