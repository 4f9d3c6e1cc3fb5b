"""Environments: tasks that are more than tool calls (dialogue partners, verifiers, games).

An environment is anything with three async methods (no base class to inherit)::

    class Environment(Protocol):
        async def reset(self, prompt, **columns) -> str | list[dict]   # the first user turn(s)
        async def step(self, text: str) -> EnvStep                     # react to a model turn
        def is_done(self) -> bool

``ml.env_rollout(policy, env_factory, prompts)`` runs one fresh environment per episode: the
model speaks, the environment answers (an untrained user turn, exact tokens appended), until the
environment is done or ``max_turns``. A step reward returned by the environment lands on the
last token of the model turn it judged; score them with ``ml.reward("step_rewards")``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from dataclasses import replace as dc_replace
from typing import Any, Protocol, runtime_checkable

from materl.rollout.episode import EpisodeState, append_turn, prompt_messages
from materl.rollout.types import Step


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
        t0 = time.perf_counter()
        gen = await engine.generate(state.ids, dc_replace(params, seed=(params.seed or 0) + 7919 * turn))
        text = tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        out = await env.step(text)
        step = Step("generate", list(gen.token_ids), list(gen.logprobs), text=text, finish_reason=gen.finish_reason,
                    reward=out.reward, latency_s=time.perf_counter() - t0, metadata=dict(out.info))
        state = dc_replace(state, ids=state.ids + list(gen.token_ids), steps=state.steps + [step],
                           messages=state.messages + [{"role": "assistant", "content": text}])
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


class ToolBudgetVerifyEnv:
    """Self-verification with a tool budget (self-verification RL): the model answers ``ANSWER: x`` or
    asks ``VERIFY: <arithmetic>``; each verification costs ``cost`` from ``budget`` and is answered
    by the calculator's parser. The final answer is rewarded 1 if it equals the ``answer`` column,
    minus the verification cost spent; running out of budget ends the episode with reward 0."""

    def __init__(self, *, budget: float = 3.0, cost: float = 1.0):
        self.budget0, self.cost = budget, cost
        self.spent, self.answer, self.done = 0.0, None, False

    async def reset(self, prompt, **columns):
        self.spent, self.answer, self.done = 0.0, str(columns.get("answer", "")), False
        return prompt_messages(prompt) if isinstance(prompt, list) else (
            f"{prompt}\nReply 'VERIFY: <expression>' to check arithmetic (costs {self.cost:g} of a "
            f"{self.budget0:g} budget) or 'ANSWER: <number>'.")

    async def step(self, text):
        from materl.tools.calculator import evaluate as evaluate_expression

        if m := re.search(r"ANSWER:\s*(-?[\d.,]+)", text):
            self.done = True
            ok = m.group(1).replace(",", "").rstrip(".") == self.answer
            return EnvStep(None, float(ok) - self.spent * 0.1, True, {"correct": ok})
        if (m := re.search(r"VERIFY:\s*(.+)", text)) and self.spent + self.cost <= self.budget0:
            self.spent += self.cost
            try:
                result = str(evaluate_expression(m.group(1).strip()))
            except Exception as e:  # a bad expression is feedback, not a crash
                result = f"error: {e}"
            return EnvStep(f"VERIFY result: {result}", None, False, {"verified": True})
        self.done = True
        return EnvStep(None, 0.0, True, {"gave_up": True})

    def is_done(self):
        return self.done


def env_rollout(agent, env: Callable[[], Environment], prompts, *, max_turns: int | None = None,
                name: str | None = None):
    """Recipe constructor: one fresh ``env()`` per episode, driven for up to ``max_turns`` turns."""
    from materl.graph.trace import active_builder

    b = active_builder("ml.env_rollout")
    a = b.agent(agent, "ml.env_rollout")
    params = {"env": env, **({"max_turns": max_turns} if max_turns else {})}
    return b.add("env_rollout", [a, prompts], params, scope="episode", name=name, default_name="rollout",
                 fixed_scope=True)


async def _env_rollout_impl(rt, node, ep, prompt):
    from materl.compiler.impls import sampling

    agent = rt.agents[node.agents[0]]
    env = node.params["env"]()
    return await run_env_episode(agent.engine, agent.tokenizer, env, prompt, ep.columns, sampling(rt, node, ep),
                                 max_turns=node.params.get("max_turns", rt.options.max_turns),
                                 system=rt.options.system_prompt)


def _register() -> None:
    from materl.compiler.impls import register

    register("env_rollout", "engine", episode=_env_rollout_impl)


_register()
