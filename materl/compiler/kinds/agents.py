"""The agent_episodes op kind: the user's own agent code, run once per episode against an
OpenAI-compatible endpoint that the policy's engine serves (``materl.rollout.endpoint``).

    async def my_agent(client: openai.AsyncOpenAI, task: dict) -> Any: ...
    rollout = ml.agent_episodes(policy, prompts, agent=my_agent)

Each episode gets its own API key and an ``openai.AsyncOpenAI`` client for it; the agent's
requests are sampled by the policy's engine (any engine: through ``model_turn``, like
``generate_step``) with the episode's seed schedule (request k samples with the seed of turn k).
Its value is the Rollout of the requests' exact token ids (``AgentTrace.episode``), with the
agent's return value in ``rollout.metadata["result"]``; rewards, advantages and the learner take it
like ``structure_rollout``'s; ``request_reward=`` scores each request (a step reward on its last
token, read by ``ml.reward("step_rewards")``). An agent that raises, sends a request the endpoint
refuses, or runs past ``episode_timeout_s`` fails its own episode, with the error recorded.

When the agent rewrote its history the Rollout holds every segment's steps in order, one turn
sequence (``materl.rollout.types.join_segments``): rewards, groups and the advantage estimator see
the episode once, and the learner trains each segment as a row of its own carrying the episode's
per-token advantages at its tokens (``materl.compiler.batch``). ``agent/segments`` counts them.
"""

from __future__ import annotations

import inspect

from materl.compiler.context import Run, sampling
from materl.compiler.episode import Episode
from materl.compiler.spec import Impl, Kind, OpSpec, Output, Role
from materl.errors import EpisodeError
from materl.graph.node import Node
from materl.rollout.endpoint import AgentSession
from materl.rollout.types import Rollout


def task_of(ep: Episode) -> dict:
    """What the agent is given: the dataset row (``prompt`` plus its other columns)."""
    return {"prompt": ep.prompt, **ep.columns}


async def agent_episode(run: Run, node: Node, ep: Episode, prompt) -> Rollout:
    agent, endpoint = run.agent(node), node.params["endpoint"]
    if not endpoint.started:  # started with the step's toolboxes; here when a caller runs the stage alone
        await endpoint.start()
    session = AgentSession(agent.engine, agent.tokenizer, lambda k: sampling(run, node, ep.seed, k),
                           parser=node.params.get("parser", "auto"), model=agent.name)
    key = endpoint.open(ep.uid, session)
    client = endpoint.client(key, timeout_s=run.options.episode_timeout_s)
    try:
        result = node.params["agent"](client, task_of(ep))
        if inspect.isawaitable(result):
            result = await result
    finally:
        await client.close()
        endpoint.close(key)
    if session.errors:
        raise EpisodeError(f"agent {_name(node)!r} sent {len(session.errors)} request(s) the endpoint refused; "
                           f"first: {session.errors[0]}")
    rollout = session.trace.episode()
    rollout.metadata["result"] = result
    if node.params.get("request_reward") is not None:
        await _request_rewards(node.params["request_reward"], session.trace, task_of(ep))
    ep.metrics["agent/segments"] = float(rollout.metadata["num_segments"])  # 1 unless the agent rewrote history
    ep.metrics["agent/requests"] = float(rollout.metadata["requests"])
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
    return getattr(node.params["agent"], "__name__", repr(node.params["agent"]))


SPECS = (
    OpSpec("agent_episodes", Role.ROLLOUT, (Output("rollout", Kind.ROLLOUT),),
           (Impl("endpoint", episode=agent_episode),), locality="episode",
           doc="the user's agent code against an OpenAI-compatible endpoint served by the policy"),
)
