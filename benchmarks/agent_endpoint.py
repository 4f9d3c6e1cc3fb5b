"""What does the OpenAI-compatible endpoint cost, and does a slow judge overlap the rollout?

Episodes: 64 (16 prompts x group 4) on the tiny model (``--model``: another), each two turns: turn 1 (with the
calculator's schema in the prompt), a tool result, turn 2. The tiny random model never writes a
tool call, so both paths give turn 1 one and answer it with "5":

- generate_step: the recipe ``generate_step -> @ml.op (forced call + result) -> generate_step ->
  structure_rollout``, compiled (rollout stage only);
- endpoint:      ``ml.agent_episodes`` with an agent that sends request 1 over the ``openai``
  client, appends the reply and a tool message, and sends request 2.

Both sample with the same seeds (request k of an episode = turn k), so their token ids must be
identical; the log-probs may differ in the last bits (engine batches form differently). Walls:
median over ``--rounds`` alternating rounds. Goal: endpoint / generate_step <= 1.15.

Judge overlap: full training steps of the endpoint recipe, rewarded by an exact check, with and
without (alternating rounds) ``ml.judge`` against a judge server that answers after 200 ms
(``benchmarks/_servers/slow_judge.py``, a separate process). Goal: the judge adds <= 10%.

    OMP_NUM_THREADS=1 python benchmarks/agent_endpoint.py [--rounds 5] [--judge-latency 0.2]
        [--model smollm2-135m-instruct] [--parts endpoint,judge]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import time
from pathlib import Path

import anyio

import materl as ml
from materl.compiler.compiled import Compiled
from materl.compiler.options import CompileOptions
from materl.rollout.multiturn import TurnResult
from materl.rollout.types import ToolCall, ToolResult

JUDGE = Path(__file__).resolve().parent / "_servers" / "slow_judge.py"
PROMPTS = [f"What is {i} + {i + 3}?" for i in range(16)]
CALC = {"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


@ml.op
async def answer_with_tool(step) -> {"step": TurnResult, "results": list}:
    """Turn 1 as if it had called the calculator, and the tool's answer."""
    state = step.history
    last = dataclasses.replace(state.steps[-1], tool_calls=[ToolCall("calculate", {"expression": "2+3"}, id="c0")],
                               finish_reason="tool_call")
    state = dataclasses.replace(state, steps=state.steps[:-1] + [last], done=False)
    return {"step": TurnResult(state, last), "results": [ToolResult("calculate", "5", call_id="c0")]}


@ml.recipe
def recipe_steps(policy, prompts):
    first = ml.generate_step(policy, prompts, tools=[CALC], name="turn_1")
    called = answer_with_tool(first)
    second = ml.generate_step(policy, called.step.history, called.results, tools=[CALC], name="turn_2")
    ml.structure_rollout(second, name="rollout")


async def two_turn_agent(client, task):
    messages = [{"role": "user", "content": task["prompt"]}]
    first = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": "c0", "name": "calculate", "content": "5"}]
    second = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
    return second.choices[0].message.content


def correct(*, rollouts, **_):
    return [float("5" in str(r.metadata.get("result", r.text))) for r in rollouts]


def endpoint_recipe(judge_url: str | None):
    @ml.recipe
    def agent_steps(policy, prompts):
        rollout = ml.agent_episodes(policy, prompts, agent=two_turn_agent, name="rollout")
        rewards = ml.reward(correct, rollout=rollout, name="answer")
        if judge_url:
            rewards = rewards + ml.judge("Is the answer right?", model=judge_url, rollout=rollout, name="judge",
                                         max_concurrency=64, retries=0)
        advantages = ml.advantages(rewards, estimator="grpo", completions=rollout)
        ml.set_loss(ml.policy_loss(advantages, ml.logprobs(policy, prompts, rollout)))
    return agent_steps


async def rollout_wall(compiled: Compiled) -> tuple[float, list]:
    t0 = time.perf_counter()
    episodes = await compiled.rollout(PROMPTS)
    wall = time.perf_counter() - t0
    failed = [e.error for e in episodes if e.error]
    if failed:
        raise RuntimeError(f"{len(failed)} episodes failed, first: {failed[0]}")
    return wall, [e.values["rollout"] for e in episodes]


async def endpoint_vs_generate_step(args) -> None:
    options = CompileOptions(max_new_tokens=args.max_new_tokens, group_size=4, max_turns=2, seed=0)
    policy = ml.Agent(args.model, trainable=True)  # the endpoint recipe has a loss; only rollouts run here
    steps = Compiled(recipe_steps, {"policy": policy}, options, rollout_only=True)
    agents = Compiled(endpoint_recipe(None), {"policy": policy}, options, rollout_only=True)
    walls: dict[str, list[float]] = {"generate_step": [], "endpoint": []}
    try:
        for _ in range(2):  # warm-up: engine, endpoint, openai import
            await rollout_wall(steps)
            await rollout_wall(agents)
        for r in range(args.rounds):
            for name, compiled in (("generate_step", steps), ("endpoint", agents))[:: 1 if r % 2 == 0 else -1]:
                wall, rollouts = await rollout_wall(compiled)
                walls[name].append(wall)
                if name == "generate_step":
                    ref = rollouts
                else:
                    got = rollouts
        same = [(a.prompt_ids, a.completion_ids) == (b.prompt_ids, b.completion_ids) for a, b in zip(ref, got)]
        drift = max(abs(x - y) for a, b in zip(ref, got) for x, y in zip(a.sampling_logprobs, b.sampling_logprobs))
    finally:
        await steps.aclose()
        await agents.aclose()
    g, e = statistics.median(walls["generate_step"]), statistics.median(walls["endpoint"])
    print(f"{args.model}: 64 two-turn episodes, {args.max_new_tokens} new tokens a turn, median of {args.rounds} rounds")
    print(f"  generate_step  {g:7.3f} s   (all: {', '.join(f'{w:.3f}' for w in walls['generate_step'])})")
    print(f"  endpoint       {e:7.3f} s   (all: {', '.join(f'{w:.3f}' for w in walls['endpoint'])})")
    print(f"  endpoint / generate_step = {e / g:.3f}x   (goal <= 1.15)")
    print(f"  identical token ids: {sum(same)}/{len(same)} episodes; max |delta sampling log-prob| {drift:.2e}")


def judge_overlap(args) -> None:
    """Alternating rounds of two compiled steps (no judge, judge) on one judge server."""
    server = subprocess.Popen([sys.executable, str(JUDGE), "--latency", str(args.judge_latency)],
                              stdout=subprocess.PIPE, text=True)
    steps = {}
    try:
        url = server.stdout.readline().strip()
        for name, judge_url in (("no judge", None), ("judge", url)):
            steps[name] = ml.compile(endpoint_recipe(judge_url), policy=ml.Agent(args.model, trainable=True),
                                     group_size=4, max_new_tokens=args.max_new_tokens, lr=1e-4, seed=0)
            steps[name].run(prompts=PROMPTS)  # warm-up
        walls: dict[str, list[float]] = {name: [] for name in steps}
        for r in range(args.rounds):
            for name in list(steps)[:: 1 if r % 2 == 0 else -1]:
                t0 = time.perf_counter()
                m = steps[name].run(prompts=PROMPTS)
                walls[name].append(time.perf_counter() - t0)
                assert m["failed_episodes"] == 0, m
    finally:
        for step in steps.values():
            step.close()
        server.kill()
        server.wait()
    a, b = statistics.median(walls["no judge"]), statistics.median(walls["judge"])
    print(f"training step, 64 endpoint episodes, judge latency {args.judge_latency * 1000:.0f} ms, "
          f"median of {args.rounds} alternating rounds")
    print(f"  no judge   {a:7.3f} s   (all: {', '.join(f'{w:.3f}' for w in walls['no judge'])})")
    print(f"  judge      {b:7.3f} s   (all: {', '.join(f'{w:.3f}' for w in walls['judge'])})")
    print(f"  judge / no judge = {b / a:.3f}x   (goal <= 1.10)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--judge-latency", type=float, default=0.2)
    p.add_argument("--model", default="tiny-random",
                   help="tiny-random: per-request overhead at its largest share; smollm2-135m-instruct: the demo's model")
    p.add_argument("--parts", default="endpoint,judge", help="comma-separated: endpoint, judge")
    args = p.parse_args()
    parts = args.parts.split(",")
    if "endpoint" in parts:
        anyio.run(endpoint_vs_generate_step, args)
    if "judge" in parts:
        judge_overlap(args)


if __name__ == "__main__":
    main()
