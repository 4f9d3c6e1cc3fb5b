"""Rollout-stage op kinds: data inputs, generation (single turn, multi-turn steps, environments),
tool calls and the structured rollout. Each runs once per episode; the engine batches the
generation requests of concurrent episodes."""

from __future__ import annotations

from dataclasses import replace as dc_replace

import anyio

from materl.compiler.context import StageEnv, sampling
from materl.compiler.episode import Episode
from materl.compiler.spec import Impl, Kind, OpSpec, Output, Role, may_be_turn, spec_of
from materl.errors import EpisodeError
from materl.graph.node import Node
from materl.rollout.env import run_env_episode
from materl.rollout.multiturn import EpisodeState, TurnResult, generate_step, sample_turn
from materl.rollout.types import Rollout


def _system(run: StageEnv, node: Node) -> str | None:
    return node.params.get("system", run.options.system_prompt)


async def generate(run: StageEnv, node: Node, ep: Episode, prompt) -> Rollout:
    agent = run.agent(node)
    state = EpisodeState.start(agent.tokenizer, prompt, system=_system(run, node))
    step = await sample_turn(agent.engine, agent.tokenizer, state.ids, sampling(run, node, ep.seed))
    return Rollout(state.ids, [step], messages=state.messages + [{"role": "assistant", "content": step.text}])


async def generate_step_impl(run: StageEnv, node: Node, ep: Episode, history, tool_responses=None) -> TurnResult:
    agent = run.agent(node)
    toolbox = run.services.get(node.name, "tools")  # None: no tools, or OpenAI function specs in the node
    specs = toolbox.tools if toolbox is not None else node.params.get("tools")
    if isinstance(history, TurnResult):
        state = history.history
    elif isinstance(history, EpisodeState):
        state = history
    else:
        state = EpisodeState.start(agent.tokenizer, history, tools=specs, system=_system(run, node))
    turn = len([s for s in state.steps if s.kind == "generate"])
    if turn >= run.options.max_turns and not state.done:
        state = dc_replace(state, done=True)
    return await generate_step(agent.engine, agent.tokenizer, state, tool_responses,
                               sampling(run, node, ep.seed, turn), parser=node.params.get("parser", "auto"),
                               max_tool_output_tokens=run.options.max_tool_output_tokens,
                               parallel_tool_calls=node.params.get("parallel_tool_calls", True),
                               max_context=getattr(agent, "context_length", None),
                               context_limit=run.options.context_limit)


async def structure_rollout(run: StageEnv, node: Node, ep: Episode, *parts) -> Rollout:
    states = [p.history if isinstance(p, TurnResult) else p for p in parts if isinstance(p, (TurnResult, EpisodeState))]
    if not states:
        raise EpisodeError(f"structure_rollout {node.name!r} got no generate steps")
    rollout = max(states, key=lambda s: len(s.steps)).to_rollout()
    gamma = node.params.get("turn_gamma")
    if gamma is not None:
        rollout.metadata["turn_gamma"] = gamma
    return rollout


async def env_rollout(run: StageEnv, node: Node, ep: Episode, prompt) -> Rollout:
    agent = run.agent(node)
    env = node.params["env"]()
    return await run_env_episode(agent.engine, agent.tokenizer, env, prompt, ep.columns, sampling(run, node, ep.seed),
                                 max_turns=node.params.get("max_turns", run.options.max_turns),
                                 system=run.options.system_prompt)


async def call_tools(run: StageEnv, node: Node, ep: Episode, step) -> list:
    toolbox = run.service(node, "tools")
    calls = step.tool_requests if isinstance(step, TurnResult) else list(step or [])
    results: list = [None] * len(calls)

    async def one(i, call):
        results[i] = await toolbox.execute(call, episode_id=ep.uid, timeout_s=run.options.tool_timeout_s)

    async with anyio.create_task_group() as tg:
        for i, call in enumerate(calls):
            tg.start_soon(one, i, call)
    return results


# -- compile-time checks ----------------------------------------------------------------------


def check_generate_step(node: Node, info) -> list[str]:
    """A turn that continues a model turn must answer that turn's tool calls."""
    history, *rest = [r for r in node.inputs if not r.startswith("@")]
    prev = info.producer(history)
    if prev is not None and spec_of(prev).turn and not rest:
        return [f"generate_step {node.name!r} continues {prev.name!r} without its tool results, so a call "
                f"{prev.name!r} makes would get an empty tool turn; write ml.generate_step(policy, "
                f"{prev.name}.history, ml.call_tools({prev.name}, tools=toolbox), ...)"]
    return []


def check_call_tools(node: Node, info) -> list[str]:
    """call_tools runs a model turn's calls: it reads a generate_step (or a custom op's value)."""
    step_ref = next(r for r in node.inputs if not r.startswith("@"))
    prev = info.producer(step_ref)
    if prev is not None and not may_be_turn(prev):
        return [f"call_tools {node.name!r} reads {step_ref!r} (op {prev.op}); it runs the tool calls of a "
                f"generate_step: ml.call_tools(<a generate_step value>, tools=toolbox)"]
    return []


_ROLLOUT = (Output("rollout", Kind.ROLLOUT),)

SPECS = (
    OpSpec("input", Role.DATA, (Output("row", Kind.OBJECT),), (Impl("data"),), locality="episode",
           doc="a recipe parameter used as data: one dataset row per episode"),
    OpSpec("generate", Role.ROLLOUT, _ROLLOUT, (Impl("engine", episode=generate),), locality="episode",
           doc="one sampled completion (a one-step Rollout)"),
    OpSpec("generate_step", Role.ROLLOUT, (Output("step", Kind.ROLLOUT),),
           (Impl("engine", episode=generate_step_impl),), locality="episode", check=check_generate_step,
           turn=True, may_call_tools=lambda node: bool(node.params.get("tools")), services=("tools",),
           doc="one model turn of a multi-turn episode (after the previous turn's tool results)"),
    OpSpec("structure_rollout", Role.ROLLOUT, _ROLLOUT, (Impl("python", episode=structure_rollout),),
           locality="episode", doc="the episode's Rollout: ordered generate and tool steps with loss masks"),
    OpSpec("env_rollout", Role.ROLLOUT, _ROLLOUT, (Impl("engine", episode=env_rollout),), locality="episode",
           doc="a multi-turn episode against a fresh environment"),
    OpSpec("call_tools", Role.TOOLS, (Output("results", Kind.OBJECT),), (Impl("mcp", episode=call_tools),),
           locality="episode", check=check_call_tools, may_call_tools=lambda node: True, services=("tools",),
           doc="a generate step's tool calls, run concurrently"),
)
