"""The agent_episodes op kind: the user's own agent code, run once per episode against an
OpenAI-compatible endpoint that the policy's engine serves (``materl.rollout.endpoint``).

    async def my_agent(client: openai.AsyncOpenAI, task: dict) -> Any: ...
    def my_sync_agent(client: openai.OpenAI, task: dict) -> Any: ...     # run in a thread
    rollout = ml.agent_episodes(policy, prompts, agent=my_agent)

The node holds the endpoint's spec (``EndpointSpec``); the compiled step (or a rollout worker)
builds the live endpoint, starts it with its other services and closes it (``StageEnv.service``).
Each episode gets its own API key and an ``openai.AsyncOpenAI`` client for it (an ``openai.OpenAI``
for a plain ``def`` agent, which runs in a thread of its own); the agent's
requests are sampled by the policy's engine (any engine: through ``model_turn``, like
``generate_step``) with the episode's seed schedule (request k samples with the seed of turn k).
Its value is the Rollout of the requests' exact token ids (``AgentTrace.episode``), with the
agent's return value in ``rollout.metadata["result"]``; rewards, advantages and the learner take it
like ``structure_rollout``'s; ``request_reward=`` scores each request (a step reward on its last
token, read by ``ml.reward("step_rewards")``). An agent that raises, sends a request the endpoint
refuses, or runs past ``episode_timeout_s`` fails its own episode, with the error recorded, unless
what it raised is the model's mistake (``model_errors``, ``materl.rollout.agent_errors``): then the
episode is scored on the turns answered before it, with no result (``metadata["result"]`` None,
the error in ``metadata["model_error"]`` and on its last turn); ``agent/model_errors`` counts them.

When the agent rewrote its history the Rollout holds every segment's steps in order, one turn
sequence (``materl.rollout.types.join_segments``): rewards, groups and the advantage estimator see
the episode once, and the learner trains each segment as a row of its own carrying the episode's
per-token advantages at its tokens (``materl.compiler.batch``). ``agent/segments`` counts them.
"""

from __future__ import annotations

import inspect

import anyio

from materl.agent import model_context
from materl.compiler.context import StageEnv, sampling
from materl.compiler.episode import Episode
from materl.compiler.spec import Impl, Kind, OpSpec, Output, Role
from materl.errors import EpisodeError
from materl.graph.node import Node
from materl.rollout.agent_errors import MODEL_ERRORS, describe, is_model_error
from materl.rollout.endpoint import AgentSession
from materl.rollout.types import Rollout


def task_of(ep: Episode) -> dict:
    """What the agent is given: the dataset row (``prompt`` plus its other columns)."""
    return {"prompt": ep.prompt, **ep.columns}


async def agent_episode(run: StageEnv, node: Node, ep: Episode, prompt) -> Rollout:
    agent, endpoint = run.agent(node), run.service(node, "endpoint")
    session = AgentSession(agent.engine, agent.tokenizer, lambda k: sampling(run, node, ep.seed, k),
                           parser=node.params.get("parser", "auto"), model=agent.name,
                           context_tokens=model_context(agent))
    key = endpoint.open(ep.uid, session)
    model_error = None
    try:
        result = await _run_agent(node.params["agent"], endpoint, key, task_of(ep),
                                  timeout_s=run.options.episode_timeout_s)
    except Exception as exc:
        if session.errors:  # the agent raised on the endpoint's refusal: the refusal says why
            raise _refused(node, session) from exc
        if not is_model_error(exc, node.params.get("model_errors", MODEL_ERRORS)):
            raise
        result, model_error = None, describe(exc)  # the model's mistake: scored, not dropped
    finally:
        endpoint.close(key)
    if session.errors:
        raise _refused(node, session)
    rollout = _episode(session, model_error)
    rollout.metadata["result"] = result
    if node.params.get("request_reward") is not None:
        await _request_rewards(node.params["request_reward"], session.trace, task_of(ep))
    ep.metrics["agent/segments"] = float(rollout.metadata["num_segments"])  # 1 unless the agent rewrote history
    ep.metrics["agent/requests"] = float(rollout.metadata["requests"])
    ep.metrics["agent/model_errors"] = float(model_error is not None)
    return rollout


async def _run_agent(fn, endpoint, key: str, task: dict, *, timeout_s: float):
    """``fn(client, task)``: an ``async def`` in this event loop with an ``AsyncOpenAI`` client (the
    endpoint watches that it does not hold the loop, ``materl.rollout.loop_watch``), a plain
    ``def`` in a thread of its own with a synchronous ``OpenAI`` client."""
    if _is_async(fn):
        client = endpoint.client(key, timeout_s=timeout_s)
        try:
            with endpoint.watch.agent(_name_of(fn), fn):
                return await fn(client, task)
        finally:
            await client.close()
    client = endpoint.sync_client(key, timeout_s=timeout_s)
    # a limiter of its own: agent threads never wait for the endpoint's parsing threads, nor these for them
    return await anyio.to_thread.run_sync(fn, client, task, abandon_on_cancel=True, limiter=anyio.CapacityLimiter(1))


def _refused(node: Node, session: AgentSession) -> EpisodeError:
    return EpisodeError(f"agent {_name(node)!r} sent {len(session.errors)} request(s) the endpoint refused; "
                        f"first: {session.errors[0]}")


def _is_async(fn) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _episode(session: AgentSession, model_error: str | None) -> Rollout:
    """The episode's Rollout; after a model error, the turns answered before it, the error on the
    last one (``step.error``, shown in samples) and in ``metadata["model_error"]``."""
    if model_error is not None and session.trace.requests == 0:
        raise EpisodeError(f"the agent raised {model_error} before any chat request, so the episode has no tokens "
                           f"to score")
    rollout = session.trace.episode()
    if model_error is not None:
        last = rollout.generate_steps[-1]
        last.error = "; ".join(e for e in (last.error, f"the agent raised {model_error}") if e)
        rollout.metadata["model_error"] = model_error
    return rollout


async def _request_rewards(fn, trace, task: dict) -> None:
    """``fn(messages=, reply=, task=)`` per answered request: a number becomes that request's
    step reward (``Step.reward``, placed on its last token by ``ml.reward("step_rewards")``)."""
    for k, (messages, reply) in enumerate(trace.log):
        value = fn(messages=messages, reply=reply, task=task)
        if inspect.isawaitable(value):
            value = await value
        if value is not None:
            trace.generate_step(k).reward = float(value)


def _name(node: Node) -> str:
    return _name_of(node.params["agent"])


def _name_of(fn) -> str:
    return getattr(fn, "__name__", repr(fn))


SPECS = (
    OpSpec("agent_episodes", Role.ROLLOUT, (Output("rollout", Kind.ROLLOUT),),
           (Impl("endpoint", episode=agent_episode),), locality="episode", may_call_tools=lambda node: True,
           services=("endpoint",),
           doc="the user's agent code against an OpenAI-compatible endpoint served by the policy"),
)
