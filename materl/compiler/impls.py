"""The implementation table: op kind -> {implementation name -> function}.

Ops never decide where they run; the compiler picks one entry per node (``choose``) and
``compiled.explain()`` shows the choice. Episode implementations are async and see one episode;
group/batch implementations see collated values over a list of episodes.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import replace as dc_replace
from typing import Any

import torch

from materl.compiler.values import Episode, RolloutBatch, collate, resolve, to_tensor
from materl.engines.base import SamplingParams
from materl.errors import CompileError, EpisodeError
from materl.graph.node import Node
from materl.rollout.episode import EpisodeState, StepResult, generate_step
from materl.rollout.types import Rollout, Step

@dataclass(frozen=True)
class Impl:
    """One way to run an op. ``episode(rt, node, ep, *values)`` is async and sees one episode;
    ``batch(rt, node, eps, inputs)`` sees, per input, the list of its per-episode values (it may be
    async). Learner ops (logprobs, losses, ...) live in compile/learner.py."""

    episode: Callable | None = None
    batch: Callable | None = None


IMPLS: dict[str, dict[str, Impl]] = {}


def register(op: str, name: str, *, episode: Callable | None = None, batch: Callable | None = None) -> None:
    IMPLS.setdefault(op, {})[name] = Impl(episode, batch)


def choose(plan, node: Node) -> str:
    table = IMPLS.get(node.op)
    if table is None:
        raise CompileError(f"node {node.name!r}: no implementation of op {node.op!r}; ops: {', '.join(sorted(IMPLS))}")
    want = plan.options.kernels
    if node.op == "call" and "_mojo" in node.params:
        try:
            node.params["fn"].materl_kernel()
        except Exception as e:
            raise CompileError(f"node {node.name!r}: Mojo kernel {node.params['_mojo']!r} failed to load: {e}") from e
        return "mojo (user kernel)"
    if node.op == "rewards" and want in ("auto", "mojo"):
        from materl.compiler.score_ops import fusable_terms, reward_chain

        if fusable_terms(node):
            try:
                reward_chain(plan, node).kernel()  # built (and cached) now, at compile time
                return "mojo-fused"
            except Exception as e:
                if want == "mojo":
                    raise CompileError(f"node {node.name!r}: kernels='mojo' but the reward chain failed: {e}") from e
        return "python"
    if node.op == "policy_loss" and want in ("auto", "mojo"):
        from materl.compiler import kernel_impls

        ok, why = kernel_impls.supports(node)
        if ok:
            return "mojo"
        if want == "mojo":
            raise CompileError(f"node {node.name!r}: kernels='mojo' but {why}")
    return next(iter(table))


# -- rollout helpers ---------------------------------------------------------------------------


def sampling(rt, node: Node, ep: Episode, turn: int = 0) -> SamplingParams:
    o, p = rt.options, node.params
    stop = tuple(p.get("stop") or ())
    return SamplingParams(
        max_new_tokens=p.get("max_new_tokens", o.max_new_tokens), temperature=p.get("temperature", o.temperature),
        top_p=p.get("top_p", o.top_p), top_k=p.get("top_k", o.top_k), stop_strings=stop,
        greedy=rt.greedy or bool(p.get("greedy", False)), seed=(ep.seed * 1009 + turn * 7919) % (2**63 - 1),
    )


def _agent(rt, node: Node):
    return rt.agents[node.agents[0]]


async def generate(rt, node: Node, ep: Episode, prompt) -> Rollout:
    agent = _agent(rt, node)
    state = EpisodeState.start(agent.tokenizer, prompt, system=node.params.get("system", rt.options.system_prompt))
    t0 = time.perf_counter()
    gen = await agent.engine.generate(state.ids, sampling(rt, node, ep))
    text = agent.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
    step = Step("generate", list(gen.token_ids), list(gen.logprobs), text=text, finish_reason=gen.finish_reason,
                latency_s=time.perf_counter() - t0)
    return Rollout(state.ids, [step], messages=state.messages + [{"role": "assistant", "content": text}])


async def generate_step_impl(rt, node: Node, ep: Episode, history, tool_responses=None) -> StepResult:
    agent = _agent(rt, node)
    tools = node.params.get("tools")
    specs = tools.tools if hasattr(tools, "tools") else tools
    if isinstance(history, StepResult):
        state = history.history
    elif isinstance(history, EpisodeState):
        state = history
    else:
        state = EpisodeState.start(agent.tokenizer, history, tools=specs,
                                   system=node.params.get("system", rt.options.system_prompt))
    turn = len([s for s in state.steps if s.kind == "generate"])
    if turn >= rt.options.max_turns and not state.done:
        state = dc_replace(state, done=True)
    return await generate_step(agent.engine, agent.tokenizer, state, tool_responses,
                               sampling(rt, node, ep, turn), parser=node.params.get("parser", "auto"),
                               max_tool_output_tokens=rt.options.max_tool_output_tokens)


async def structure_rollout(rt, node: Node, ep: Episode, *parts) -> Rollout:
    states = [p.history if isinstance(p, StepResult) else p for p in parts if isinstance(p, (StepResult, EpisodeState))]
    if not states:
        raise EpisodeError(f"structure_rollout {node.name!r} got no generate steps")
    rollout = max(states, key=lambda s: len(s.steps)).to_rollout()
    gamma = node.params.get("turn_gamma")
    if gamma is not None:
        rollout.metadata["turn_gamma"] = gamma
    return rollout


# -- custom ops -------------------------------------------------------------------------------


def _call_args(node: Node, inputs: list) -> dict[str, Any]:
    return {**node.params["_consts"], **dict(zip(node.params["_args"], inputs))}


async def call_episode(rt, node: Node, ep: Episode, *inputs):
    fn = node.params["fn"]
    out = fn(**_call_args(node, list(inputs)))
    if hasattr(out, "__await__"):
        out = await out
    return _check_outputs(node, out)


def call_group(rt, node: Node, eps: list[Episode], inputs: list[list]):
    fn = node.params["fn"]
    out = fn(**_call_args(node, [collate(v) for v in inputs]))
    if hasattr(out, "__await__"):
        raise CompileError(f"op {fn.__name__!r} is async; async ops run per episode (scope='episode')")
    return _check_outputs(node, out)


def _check_outputs(node: Node, out):
    if node.outputs:
        if not isinstance(out, dict) or set(node.outputs) - set(out):
            got = sorted(out) if isinstance(out, dict) else type(out).__name__
            raise EpisodeError(f"op {node.params['fn'].__name__!r} must return a dict with {list(node.outputs)}; got {got}")
    return out


_TOOL_EPISODES: dict[int, str] = {}  # id(episode) -> its tool episode id, until end_tool_episodes
_TOOL_EPISODE_COUNT = itertools.count()


def tool_episode_id(rt, ep: Episode) -> str:
    """The episode id tool servers see: unique in this process (an evaluation rollout and the
    next training step share step_count and episode indices)."""
    key = id(ep)
    if key not in _TOOL_EPISODES:
        _TOOL_EPISODES[key] = f"{rt.step_count}-{ep.index}-{next(_TOOL_EPISODE_COUNT)}"
    return _TOOL_EPISODES[key]


async def end_tool_episodes(rt, ep: Episode) -> None:
    """The episode ended (success, failure or deadline): its per-episode tool state is dropped
    (``Toolbox.end_episode``). The scheduler calls this once per episode; it never raises."""
    import anyio

    episode_id = _TOOL_EPISODES.pop(id(ep), None)
    if episode_id is None:
        return
    with anyio.CancelScope(shield=True), anyio.move_on_after(30):
        for toolbox in rt._toolboxes():
            if hasattr(toolbox, "end_episode"):
                await toolbox.end_episode(episode_id)


async def call_tools(rt, node: Node, ep: Episode, step) -> list:
    import anyio

    toolbox = node.params["tools"]
    calls = step.tool_requests if isinstance(step, StepResult) else list(step or [])
    results: list = [None] * len(calls)

    async def one(i, call):
        results[i] = await toolbox.execute(call, episode_id=tool_episode_id(rt, ep),
                                           timeout_s=rt.options.tool_timeout_s)

    async with anyio.create_task_group() as tg:
        for i, call in enumerate(calls):
            tg.start_soon(one, i, call)
    return results


register("generate", "engine", episode=generate)
register("call_tools", "mcp", episode=call_tools)
register("generate_step", "engine", episode=generate_step_impl)
register("structure_rollout", "python", episode=structure_rollout)
register("call", "python", episode=call_episode, batch=call_group)
IMPLS["call"]["mojo (user kernel)"] = IMPLS["call"]["python"]
