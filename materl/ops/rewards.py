"""Rewards: TRL-style reward functions, weighted, composed and validated.

A reward function is called with keywords only, as TRL's ``GRPOTrainer`` calls its
``reward_funcs``; it takes what it needs and accepts ``**kwargs``::

    def my_reward(*, completions: list[str], answer: list[str], **kwargs) -> list[float]:
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

The batch (one entry per completion, B in all) holds ``completions`` (texts), ``prompts``,
``completion_ids`` (exact token ids, unpadded), ``rollouts`` (``materl.rollout.types.Rollout``
episodes with their tool steps, or None for single-turn batches) and every extra dataset column
(``answer=[...]``, ``group_ids=[...]``). A reward returns B numbers (a list or a (B,) tensor) or
token-level scores: a (B, T) tensor with T the longest completion, or B lists of per-token
numbers, each as long as its completion. It may be ``async def`` (an LLM judge, an HTTP check).

    r = Reward.from_spec("length", weight=0.1, target=64) + 0.9 * Reward.from_spec("diversity")
    total_B = await r.ascore(**batch)          # weighted float32 total, (B,) or (B, T)
    parts = await r.acomponents(**batch)       # {"length": ..., "diversity": ...}, unweighted
    total_B = r.score(**batch)                 # sync, only outside a running event loop

Differences from TRL (deliberate): a reward returning None for a row is an error (TRL turns it
into NaN and skips it with nansum); completions are always strings (TRL passes message lists for
conversational data; here use ``rollouts[i].messages``); sync rewards run inline in the calling
task (a slow sync reward should be written ``async`` or offload itself with
``anyio.to_thread.run_sync``); token-level rewards are allowed, and when they are summed with
per-completion rewards the per-completion score lands on the completion's last token (the
convention of ``Rollout.step_rewards``). The built-in rewards live in ``reward_builtins``; the
calling contract (the batch, the checks and shapes of what a reward returns) in ``reward_calls``;
this module composes rewards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType
from typing import Any

import anyio
import torch
from torch import Tensor

from materl.errors import ConfigError, MaterlError, RewardError
from materl.ops.reward_calls import (  # noqa: F401 (BATCH_KEYS, RewardScores: re-exported)
    BATCH_KEYS,
    BatchInfo,
    RewardScores,
    as_scores,
    call_reward,
    check_params,
    gather,
    inspect_batch,
    merge_components,
    short,
    sum_terms,
)
from materl.registry import Registry

REWARDS: Registry[Callable[..., Any]] = Registry("reward")
REWARD_AGGREGATORS: Registry[Callable[..., Tensor]] = Registry("reward_aggregator")

# ----------------------------------------------------------------------------- composition


class _Arithmetic:
    """``+``, ``-``, scalar ``*`` and the async/sync entry points shared by the reward types."""

    def __add__(self, other: Any) -> RewardSum:
        if not isinstance(other, (Reward, RewardSum, VectorReward)):
            return NotImplemented
        return RewardSum(_terms(self) + _terms(other))

    def __radd__(self, other: Any) -> Any:
        if isinstance(other, numbers.Number) and other == 0:  # sum([r1, r2]) starts from 0
            return self
        return NotImplemented

    def __sub__(self, other: Any) -> RewardSum:
        if not isinstance(other, (Reward, RewardSum, VectorReward)):
            return NotImplemented
        return self + (-other)

    def __neg__(self) -> Any:
        return self._scaled(-1.0)

    def __mul__(self, k: Any) -> Any:
        if not isinstance(k, numbers.Real) or isinstance(k, bool):
            return NotImplemented
        return self._scaled(float(k))

    __rmul__ = __mul__

    # subclasses define _scaled(k) -> a copy scaled by k, and
    # async _evaluate(batch, info) -> RewardScores

    async def aevaluate(self, **batch: Any) -> RewardScores:
        """Weighted total and unweighted components from one evaluation (each reward runs once)."""
        return await self._evaluate(batch, inspect_batch(batch))

    async def ascore(self, **batch: Any) -> Tensor:
        """Weighted float32 total: (B,), or (B, T) when any component is token-level."""
        return (await self.aevaluate(**batch)).total

    async def acomponents(self, **batch: Any) -> dict[str, Tensor]:
        """Each leaf reward's unweighted scores by name (repeated names get ``_2``, ``_3``...)."""
        return (await self.aevaluate(**batch)).components

    def score(self, **batch: Any) -> Tensor:
        """Sync ``ascore`` via ``anyio.run``. Inside a running event loop, ``await ascore`` instead."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return anyio.run(partial(self.ascore, **batch))
        raise RewardError(
            f"{type(self).__name__}.score() was called inside a running event loop; use `await reward.ascore(...)`"
        )


def _terms(x: Any) -> tuple[Reward | VectorReward, ...]:
    return x.terms if isinstance(x, RewardSum) else (x,)


def _check_weight(owner: str, weight: Any) -> float:
    if not isinstance(weight, numbers.Real) or isinstance(weight, bool) or not math.isfinite(weight):
        raise ConfigError(f"reward {owner!r}: weight must be a finite number, got {weight!r}")
    return float(weight)


@dataclass(frozen=True)
class Reward(_Arithmetic):
    """One weighted reward function. ``params`` are bound as keywords on every call.

    ``fn(*, completions, prompts, completion_ids, rollouts, **columns, **params)`` returns B
    numbers or (B, T) token scores (see the module docstring); the total is ``weight * fn(...)``.
    TRL counterpart: one entry of ``reward_funcs`` with its ``reward_weights`` entry.
    """

    fn: Callable[..., Any]
    weight: float = 1.0
    name: str = ""
    params: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ConfigError(f"a Reward needs a callable, got {self.fn!r} ({type(self.fn).__name__})")
        name = self.name or getattr(self.fn, "__name__", type(self.fn).__name__)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "weight", _check_weight(name, self.weight))
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))
        check_params(name, self.fn, self.params)

    @classmethod
    def from_spec(cls, spec: str | Callable[..., Any], weight: float = 1.0, *, name: str | None = None,
                  **params: Any) -> Reward:
        """A registered name (``"length"``; unknown names raise ``UnknownNameError`` with a
        suggestion) or a callable, with its weight and keyword parameters."""
        if isinstance(spec, str):
            return cls(REWARDS.get(spec), weight, name or spec, params)
        if callable(spec):
            return cls(spec, weight, name or "", params)
        raise ConfigError(
            f"a reward is a registered name or a callable, got {spec!r} ({type(spec).__name__}); "
            f"registered: {', '.join(REWARDS.names())}"
        )

    def _scaled(self, k: float) -> Reward:
        return dataclasses.replace(self, weight=self.weight * k)

    async def _evaluate(self, batch: Mapping[str, Any], info: BatchInfo) -> RewardScores:
        scores = await call_reward(self, batch, info)
        return RewardScores(scores * self.weight, {self.name: scores})

    def __repr__(self) -> str:
        params = "".join(f", {k}={v!r}" for k, v in self.params.items())
        return f"Reward({self.name!r}, weight={self.weight:g}{params})"


@dataclass(frozen=True)
class RewardSum(_Arithmetic):
    """``r1 + r2 + ...``: the sum of the terms' weighted totals; the terms run concurrently.

    If any term is token-level the sum is (B, T) and per-completion terms land on each
    completion's last token. TRL counterpart: ``(rewards_per_func * reward_weights).sum(1)``.
    """

    terms: tuple[Reward | VectorReward, ...]

    def __post_init__(self) -> None:
        terms = tuple(self.terms)
        bad = [t for t in terms if not isinstance(t, (Reward, VectorReward))]
        if not terms or bad:
            raise ConfigError(f"RewardSum needs Reward or VectorReward terms, got {short(terms)}")
        object.__setattr__(self, "terms", terms)

    @property
    def name(self) -> str:
        return " + ".join(f"{t.weight:g}*{t.name}" for t in self.terms)

    def _scaled(self, k: float) -> RewardSum:
        return RewardSum(tuple(t._scaled(k) for t in self.terms))

    async def _evaluate(self, batch: Mapping[str, Any], info: BatchInfo) -> RewardScores:
        results = await gather([partial(t._evaluate, batch, info) for t in self.terms])
        total = sum_terms([r.total for r in results], [t.name for t in self.terms], info)
        return RewardScores(total, merge_components([r.components for r in results]))

    def __repr__(self) -> str:
        return f"RewardSum({self.name})"


@dataclass(frozen=True)
class VectorReward(_Arithmetic):
    """Several rewards aggregated into one score per completion by a registered aggregator.

    ``scores_K_B[k] = members[k].ascore(...)`` (each member's own weight applied), then
    ``total_B = weight * REWARD_AGGREGATORS[aggregate](scores_K_B, group_ids=batch[group_ids])``.
    Members must score whole completions (B,). ``group_ids`` names the batch column that holds
    one group id per completion; only group-wise aggregators ("pareto") read it.
    ``acomponents`` returns the members' unweighted components.
    """

    members: Sequence[Any]
    aggregate: str = "weighted_sum"
    group_ids: str = "group_ids"
    weight: float = 1.0
    name: str = ""

    def __post_init__(self) -> None:
        members = tuple(m if isinstance(m, _Arithmetic) else Reward.from_spec(m) for m in self.members)
        if not members:
            raise ConfigError("VectorReward needs at least one member reward, got none")
        REWARD_AGGREGATORS.get(self.aggregate)
        object.__setattr__(self, "members", members)
        name = self.name or f"{self.aggregate}({', '.join(m.name for m in members)})"
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "weight", _check_weight(name, self.weight))

    def _scaled(self, k: float) -> VectorReward:
        return dataclasses.replace(self, weight=self.weight * k)

    async def _evaluate(self, batch: Mapping[str, Any], info: BatchInfo) -> RewardScores:
        results = await gather([partial(m._evaluate, batch, info) for m in self.members])
        for m, r in zip(self.members, results):
            if r.total.dim() != 1:
                raise RewardError(
                    f"VectorReward {self.name!r}: member {m.name!r} returned token-level scores of shape "
                    f"{list(r.total.shape)}; members must give one score per completion"
                )
        scores_K_B = torch.stack([r.total for r in results])
        try:
            out = REWARD_AGGREGATORS.get(self.aggregate)(scores_K_B, group_ids=batch.get(self.group_ids))
        except MaterlError as e:
            raise RewardError(
                f"VectorReward {self.name!r} (aggregate={self.aggregate!r}): {e}; group ids are read from the "
                f"batch column {self.group_ids!r}; batch keys: {', '.join(sorted(batch))}"
            ) from e
        aggregated = as_scores(self.name, out, info)
        return RewardScores(aggregated * self.weight, merge_components([r.components for r in results]))

    def __repr__(self) -> str:
        return f"VectorReward({self.name!r}, weight={self.weight:g})"
