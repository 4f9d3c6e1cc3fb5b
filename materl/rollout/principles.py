"""Principle-based AI feedback: a judge scores each episode against each of a written list of
principles (Constitutional AI, Bai et al. 2022, arXiv:2212.08073; RLAIF, Lee et al. 2023,
arXiv:2309.00267), optionally after a critique-then-revise pass.

    pj = PrincipleJudge(ml.Agent("smollm2-135m-instruct"), ["Be harmless.", {"name": "honest",
                        "text": "Do not make things up.", "weight": 2.0}], aggregate="pareto")
    reward = pj.vector_reward()                  # an ops VectorReward: one member per principle
    scores = await reward.aevaluate(prompts=..., completions=..., rollouts=..., group_ids=...)
    scores.components["honest"]                  # that principle's (unweighted) score per episode

Each principle is one ``materl.rollout.judge.Judge`` whose rubric is the principle's text, so it
scores through the judge's own transport (a materl Agent in process, or an OpenAI-compatible
URL), bounds, timeouts, retries and ``Score:`` grammar. The episode's reward is
``REWARD_AGGREGATORS[aggregate]`` over the principles' weighted scores (``mean``, ``weighted_sum``,
``min``, ``max``, or ``pareto``: minus the non-dominated-front rank within the episode's group).
A local judge at ``temperature=0`` decodes greedily: the same episodes get the same scores.

Critique then revise (``revise=``): the judge first critiques the response against all
principles and writes a revision (``Revision:`` then the revised answer, the rest of its answer).
- ``"score"``: the revision is used only for scoring: each principle's judge sees it as a
  reference answer (reference-guided grading); nothing is trained on it.
- ``"prefer"``: the revision is also a preferred sample: ``preference_pairs`` turns each episode
  into a DPO row (prompt, chosen = revision, rejected = the episode's answer) for ``materl.recipes.dpo``
  (Constitutional AI's SL-CAI revisions, as pairs).
The revision is kept in the rollout's ``metadata["revision"]`` in both modes.
(TRL: ``judges`` score one criterion each; OpenRLHF/verl: a generative reward model per prompt.)
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from materl.errors import ConfigError, RewardError
from materl.ops.rewards import REWARD_AGGREGATORS, Reward, VectorReward
from materl.rollout.judge import Judge, JudgeSpec, delimited
from materl.rollout.types import Rollout

REVISE_MODES = (None, "score", "prefer")

CRITIQUE = ("You are a careful critic. Critique the assistant's response to the task against each principle, "
            "then rewrite it so that it follows all of them.\nPrinciples:\n{principles}\n"
            "End your answer with a line 'Revision:' followed by the revised response and nothing else.")
_REVISION = re.compile(r"revision\s*:\s*", re.IGNORECASE)


@dataclass(frozen=True)
class Principle:
    """One written principle: its ``name`` (in metrics), the ``text`` the judge reads, its weight."""
    name: str
    text: str
    weight: float = 1.0


def as_principles(items: Sequence[Any]) -> tuple[Principle, ...]:
    """Principles from strings (named ``p1``, ``p2``, ... by position), dicts ``{"name", "text",
    "weight"}`` or ``Principle``s; names are unique, texts non-empty."""
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence) or not items:
        raise ConfigError(f"principles must be a non-empty list of strings, dicts or Principles, got {items!r}")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            item = Principle(f"p{i + 1}", item)
        elif isinstance(item, Mapping):
            unknown = sorted(set(item) - {"name", "text", "weight"})
            if unknown or "text" not in item:
                raise ConfigError(f"principles[{i}] = {item!r}: a dict takes 'text' (required), 'name' and 'weight'"
                                  f"{'; unknown: ' + ', '.join(unknown) if unknown else ''}")
            item = Principle(str(item.get("name", f"p{i + 1}")), item["text"], item.get("weight", 1.0))
        if not isinstance(item, Principle):
            raise ConfigError(f"principles[{i}] must be a string, a dict or a Principle, got {item!r}")
        if not isinstance(item.text, str) or not item.text.strip():
            raise ConfigError(f"principles[{i}] ({item.name!r}) has no text: {item.text!r}")
        if isinstance(item.weight, bool) or not isinstance(item.weight, (int, float)):
            raise ConfigError(f"principles[{i}] ({item.name!r}) weight must be a number, got {item.weight!r}")
        out.append(item)
    names = [p.name for p in out]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"principle names must be unique; repeated: {', '.join(dupes)} (names: {', '.join(names)})")
    return tuple(out)


def parse_revision(text: str) -> str:
    """The text after the last ``Revision:`` of the critic's answer (non-empty)."""
    parts = _REVISION.split(text)
    if len(parts) < 2 or not parts[-1].strip():
        raise RewardError(f"the critic's answer has no 'Revision: <text>': {text[-300:]!r}")
    return parts[-1].strip()


@dataclass(frozen=True)
class PrinciplesSpec:
    """What ``ml.judge(principles=...)`` puts in its node: the model, the principles (checked and
    normalised), the aggregate, the revise mode and the judges' options, checked when made.
    ``build()`` makes the ``PrincipleJudge`` (a ``materl.rollout.services.ServiceSpec``)."""

    model: Any
    principles: tuple[Principle, ...]
    aggregate: str = "mean"
    revise: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)  # Judge's keywords

    def __post_init__(self):
        object.__setattr__(self, "principles", as_principles(self.principles))
        REWARD_AGGREGATORS.get(self.aggregate)  # unknown names list the valid ones
        if self.revise not in REVISE_MODES:
            raise ConfigError(f"revise must be one of {', '.join(map(repr, REVISE_MODES))}, got {self.revise!r}")
        object.__setattr__(self, "options", dict(self.options))
        self.judges()  # the judges' settings, checked

    def judges(self) -> tuple[dict[str, JudgeSpec], JudgeSpec | None]:
        """One judge per principle (its text the rubric), and the critic with ``revise``."""
        per = {p.name: JudgeSpec(self.model, p.text, **self.options) for p in self.principles}
        listed = "\n".join(f"- {p.text}" for p in self.principles)
        return per, JudgeSpec(self.model, CRITIQUE.format(principles=listed), **self.options) if self.revise else None

    @property
    def group_wise(self) -> bool:
        """Whether the aggregate compares a group's episodes (pareto): the node is then group-scope."""
        return self.aggregate == "pareto"

    def build(self) -> PrincipleJudge:
        return PrincipleJudge.of(self)

    def __repr__(self) -> str:
        return (f"PrincipleJudge({', '.join(p.name for p in self.principles)}; aggregate={self.aggregate!r}"
                f"{f', revise={self.revise!r}' if self.revise else ''})")


class PrincipleJudge:
    """See the module docstring. ``judge_options``: ``Judge``'s keywords (api_key, model_name,
    parse, max_concurrency, timeout_s, retries, max_new_tokens, temperature). An
    ``EpisodeService`` (``materl.rollout.services``): ``start``/``aclose`` reach its judges."""

    def __init__(self, model: Any, principles: Sequence[Any], *, aggregate: str = "mean", revise: str | None = None,
                 **judge_options: Any):
        self.spec = PrinciplesSpec(model, principles, aggregate, revise, judge_options)
        self.principles, self.aggregate, self.revise = self.spec.principles, aggregate, revise
        judges, critic = self.spec.judges()
        self.judges = {name: j.build() for name, j in judges.items()}
        self.critic = critic.build() if critic is not None else None

    @classmethod
    def of(cls, spec: PrinciplesSpec) -> PrincipleJudge:
        return cls(spec.model, spec.principles, aggregate=spec.aggregate, revise=spec.revise, **spec.options)

    def __repr__(self) -> str:
        return repr(self.spec)

    # -- service (materl.rollout.services.EpisodeService) --
    def _all(self) -> list[Judge]:
        return [*self.judges.values(), *([self.critic] if self.critic is not None else [])]

    @property
    def started(self) -> bool:
        return all(j.started for j in self._all())

    async def start(self) -> PrincipleJudge:
        for j in self._all():
            await j.start()
        return self

    async def end_episode(self, episode_id: str) -> None:
        """Its judges keep nothing per episode."""

    async def aclose(self) -> None:
        for j in self._all():
            await j.aclose()

    @property
    def group_wise(self) -> bool:
        return self.spec.group_wise

    async def critique(self, task: str, rollout: Rollout) -> str:
        """The critic's revision of the episode's answer (also kept in ``metadata["revision"]``)."""
        messages = [{"role": "system", "content": self.critic.rubric},
                    {"role": "user", "content": delimited(task, rollout)}]
        revision = (await self.critic.ask(messages, parse_revision)).value
        rollout.metadata["revision"] = revision
        return revision

    async def score(self, name: str, task: str, rollout: Rollout) -> float:
        """Principle ``name``'s score of the episode (with ``revise="score"``, against its revision)."""
        revision = rollout.metadata.get("revision") if self.revise == "score" else None
        if revision is not None:
            task = (f"{task}\n\nReference answer (a revision that follows the principles; grade the response "
                    f"against it, do not score the reference itself):\n{revision}")
        return await self.judges[name].score(task, rollout)

    def vector_reward(self, *, weight: float = 1.0, name: str = "principles") -> VectorReward:
        """The principles as an ops ``VectorReward``: member k scores principle k (weight = the
        principle's), aggregated by ``aggregate``. Batch keys read: prompts, rollouts, group_ids."""
        return VectorReward([Reward(self._member(p.name), p.weight, p.name) for p in self.principles],
                            aggregate=self.aggregate, weight=weight, name=name)

    def _member(self, name: str):
        async def principle(*, prompts: Sequence[str], rollouts: Sequence[Rollout], **_: Any) -> list[float]:
            scores = [0.0] * len(rollouts)

            async def one(i: int) -> None:
                scores[i] = await self.score(name, prompts[i], rollouts[i])

            async with anyio.create_task_group() as tg:
                for i in range(len(rollouts)):
                    tg.start_soon(one, i)
            return scores

        principle.__name__ = name
        return principle

    async def revise_all(self, prompts: Sequence[str], rollouts: Sequence[Rollout]) -> None:
        """The critique-then-revise pass over a batch (concurrently); no-op without ``revise``."""
        if self.critic is None:
            return
        async with anyio.create_task_group() as tg:
            for task, r in zip(prompts, rollouts):
                tg.start_soon(self.critique, task, r)


def preference_pairs(rollouts: Sequence[Rollout]) -> list[dict[str, str]]:
    """DPO rows from revised episodes (``revise="prefer"``): ``{"prompt", "chosen": revision,
    "rejected": the episode's answer}`` for ``materl.recipes.dpo`` (``step.run(pairs=...)``);
    episodes without a revision (or whose revision equals the answer) give no row."""
    rows = []
    for r in rollouts:
        revision = r.metadata.get("revision")
        if revision is not None and revision.strip() != r.text.strip():
            rows.append({"prompt": r.prompt_text, "chosen": revision, "rejected": r.text})
    return rows
