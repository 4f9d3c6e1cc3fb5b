"""Environments: tasks that are more than tool calls (dialogue partners, verifiers, games).

An environment is anything with three async methods (no base class to inherit)::

    class Environment(Protocol):
        async def reset(self, prompt, **columns) -> str | list[dict]   # the first user turn(s)
        async def step(self, text: str) -> EnvStep                     # react to a model turn
        def is_done(self) -> bool

``ml.env_rollout(policy, env_factory, prompts)`` (a recipe constructor in ``materl.graph``) runs one
fresh environment per episode: the
model speaks, the environment answers (an untrained user turn, exact tokens appended), until the
environment is done or ``max_turns``. A step reward returned by the environment lands on the
last token of the model turn it judged; score them with ``ml.reward("step_rewards")``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from dataclasses import replace as dc_replace
from typing import Any, Protocol, runtime_checkable

from materl.rollout.multiturn import EpisodeState, append_turn, sample_turn


@dataclass
class EnvStep:
    observation: str | None = None  # the next user turn (None when done)
    reward: float | None = None  # step reward for the model turn just taken
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    async def reset(self, prompt: Any, **columns: Any) -> str | list[dict]: ...

    async def step(self, text: str) -> EnvStep: ...

    def is_done(self) -> bool: ...


async def run_env_episode(engine, tokenizer, env: Environment, prompt: Any, columns: dict, params, *,
                          max_turns: int, system: str | None = None):
    first = await env.reset(prompt, **columns)
    state = EpisodeState.start(tokenizer, first, system=system, tools=getattr(env, "tools", None))
    for turn in range(max_turns):
        if state.steps:
            state = append_turn(tokenizer, state, [{"role": "user", "content": observation}])
        sampled = await sample_turn(engine, tokenizer, state.ids,
                                    dc_replace(params, seed=(params.seed or 0) + 7919 * turn))
        out = await env.step(sampled.text)
        step = dc_replace(sampled, reward=out.reward, metadata={**sampled.metadata, **out.info})
        state = dc_replace(state, ids=state.ids + step.token_ids, steps=state.steps + [step],
                           messages=state.messages + [{"role": "assistant", "content": step.text}])
        observation = out.observation
        if out.done or env.is_done() or observation is None:
            break
    return dc_replace(state, done=True).to_rollout()


# -- example environments ---------------------------------------------------


class SimpleTextEnv:
    """One prompt, one answer; an optional ``score(text, **columns)`` gives the step reward."""

    def __init__(self, score: Callable[..., float] | None = None):
        self.score, self.columns, self.done = score, {}, False

    async def reset(self, prompt, **columns):
        self.columns, self.done = columns, False
        return prompt

    async def step(self, text):
        self.done = True
        return EnvStep(None, self.score(text, **self.columns) if self.score else None, True)

    def is_done(self):
        return self.done


class ConversationEnv:
    """A scripted dialogue partner: after each model turn the next user line is sent, until the
    script (a ``followups`` column or constructor list) runs out."""

    def __init__(self, followups: list[str] | None = None):
        self.default, self.queue = list(followups or []), []

    async def reset(self, prompt, **columns):
        self.queue = list(columns.get("followups") or self.default)
        return prompt

    async def step(self, text):
        if not self.queue:
            return EnvStep(None, None, True)
        return EnvStep(self.queue.pop(0), None, False)

    def is_done(self):
        return False
