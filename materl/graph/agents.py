"""Recipe constructors for existing agent code: ``ml.agent_episodes`` (the agent's episodes
through an OpenAI-compatible endpoint served by the policy)."""

from __future__ import annotations

import inspect

from materl.errors import RecipeError
from materl.graph.trace import Value, active_builder


def agent_episodes(policy, prompts, *, agent, name: str | None = None, parser: str = "auto",
                   max_new_tokens: int | None = None, temperature: float | None = None,
                   greedy: bool | None = None) -> Value:
    """Run ``agent`` (``async def my_agent(client, task) -> result``) once per episode, where
    ``client`` is an ``openai.AsyncOpenAI`` pointed at a local endpoint (127.0.0.1, one API key
    per episode) that ``policy`` serves, and ``task`` is the dataset row (``{"prompt": ...,
    **columns}``). The value is the episode's Rollout: the exact token ids and sampling log-probs
    of every request, prompts and tool results untrained, the agent's return value in
    ``.metadata["result"]``. ``parser``: the tool-call format of the answers (``"auto"``: the one
    the chat template declares). ``max_new_tokens``/``temperature``: per request (default: the
    compile options'); ``greedy=True`` decodes greedily. See ``materl.compiler.kinds.agents``."""
    if not (inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(getattr(agent, "__call__", None))):
        raise RecipeError(f"ml.agent_episodes(agent=...) needs an async function (client, task) -> result, "
                          f"got {agent!r}")
    from materl.rollout.endpoint import AgentEndpoint

    b = active_builder("ml.agent_episodes")
    a = b.agent(policy, "ml.agent_episodes")
    params = {"agent": agent, "endpoint": AgentEndpoint(), "parser": parser,
              **{k: v for k, v in (("max_new_tokens", max_new_tokens), ("temperature", temperature),
                                                          ("greedy", greedy)) if v is not None}}
    return b.add("agent_episodes", [a, prompts], params, scope="episode", name=name, default_name="rollout",
                 fixed_scope=True)
