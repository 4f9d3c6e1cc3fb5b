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
convention of ``Rollout.step_rewards``). The built-in rewards live in ``reward_builtins``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import inspect
import math
import numbers
import reprlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType
from typing import Any, NamedTuple

import anyio
import torch
from torch import Tensor

from materl.errors import ConfigError, MaterlError, RewardError, ShapeError
from materl.ops._masked import place_on_last_trained
from materl.registry import Registry

REWARDS: Registry[Callable[..., Any]] = Registry("reward")
REWARD_AGGREGATORS: Registry[Callable[..., Tensor]] = Registry("reward_aggregator")

#: Keywords every reward function may receive from the batch (besides dataset columns).
BATCH_KEYS = ("completions", "prompts", "completion_ids", "rollouts")

_INT_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_repr = reprlib.Repr()
_repr.maxlist, _repr.maxtuple, _repr.maxstring, _repr.maxother = 8, 8, 60, 80
_short = _repr.repr


class RewardScores(NamedTuple):
    total: Tensor  # weighted float32 total, (B,) or (B, T)
    components: dict[str, Tensor]  # unweighted score of every leaf reward, by (unique) name


@dataclass(frozen=True)
class _BatchInfo:
    size: int
    lengths: tuple[int, ...] | None  # completion lengths in tokens, when the batch has them
    trained: tuple[tuple[int, ...], ...] | None = None  # the rollouts' loss masks, when they align with them

    @property
    def width(self) -> int:
        return max(self.lengths, default=0) if self.lengths is not None else 0


def _inspect_batch(batch: Mapping[str, Any]) -> _BatchInfo:
    sizes = {k: len(batch[k]) for k in BATCH_KEYS if batch.get(k) is not None}
    if not sizes:
        raise ShapeError(
            f"a reward batch needs at least one of {', '.join(BATCH_KEYS)}; got keys: {sorted(batch) or 'none'}"
        )
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{k}={n}" for k, n in sizes.items())
        raise ShapeError(f"reward batch entries disagree on the batch size: {listed}")
    ids = batch.get("completion_ids")
    if isinstance(ids, Tensor):
        raise ShapeError(
            f"completion_ids must be B lists of exact (unpadded) token ids, got a tensor of shape {list(ids.shape)}"
        )
    if ids is None and batch.get("rollouts") is not None:
        ids = [r.completion_ids for r in batch["rollouts"]]
    lengths = tuple(len(row) for row in ids) if ids is not None else None
    rollouts, trained = batch.get("rollouts"), None
    if rollouts is not None and lengths is not None and all(r is not None for r in rollouts) and \
            tuple(len(r.completion_ids) for r in rollouts) == lengths:
        trained = tuple(tuple(r.loss_mask) for r in rollouts)
    return _BatchInfo(next(iter(sizes.values())), lengths, trained)


# ----------------------------------------------------------------------------- validation


def _as_number(name: str, i: int, x: Any, out: Any) -> float:
    if isinstance(x, Tensor) and x.numel() == 1:
        return float(x.item())
    if isinstance(x, numbers.Real):  # bool, int, float, numpy scalars
        return float(x)
    if x is None:
        raise RewardError(
            f"reward {name!r} returned None at row {i}: {_short(out)}; materl needs a number for every "
            f"completion (TRL would skip the row): return 0.0 or filter the batch"
        )
    raise RewardError(f"reward {name!r} returned a non-number at row {i}: {x!r} ({type(x).__name__}) in {_short(out)}")


def _token_rows(name: str, out: Sequence[Sequence[Any]], info: _BatchInfo) -> Tensor:
    if info.lengths is None:
        raise RewardError(f"reward {name!r} returned per-token scores but the batch has no completion_ids or rollouts")
    scores = torch.zeros(info.size, info.width, dtype=torch.float64)
    for i, (row, n) in enumerate(zip(out, info.lengths)):
        if len(row) != n:
            raise RewardError(
                f"reward {name!r} returned {len(row)} token scores for row {i}, whose completion has {n} tokens"
            )
        scores[i, :n] = torch.tensor([_as_number(name, i, x, row) for x in row], dtype=torch.float64)
    return scores.float()


def _check_tensor(name: str, t: Tensor, info: _BatchInfo) -> Tensor:
    if t.is_complex() or not (t.is_floating_point() or t.dtype in _INT_DTYPES):
        raise RewardError(f"reward {name!r} returned a tensor of dtype {t.dtype}; expected real numbers")
    t = t.detach().to(device="cpu", dtype=torch.float32)
    if t.dim() == 1 and t.shape[0] != info.size:
        raise RewardError(f"reward {name!r} returned {len(t)} values for a batch of {info.size}: {_short(t.tolist())}")
    if t.dim() == 2:
        if info.lengths is None:
            raise RewardError(
                f"reward {name!r} returned token scores of shape {list(t.shape)} but the batch has no completion_ids "
                f"or rollouts to check them against"
            )
        if tuple(t.shape) != (info.size, info.width):
            raise RewardError(
                f"reward {name!r} returned token scores of shape {list(t.shape)}; expected [{info.size}, {info.width}] "
                f"(B completions, the longest has {info.width} tokens)"
            )
        t = t * _length_mask(info)  # entries past a completion's end are padding
    if t.dim() not in (1, 2):
        raise RewardError(
            f"reward {name!r} returned a tensor of shape {list(t.shape)}; expected ({info.size},) or "
            f"({info.size}, {info.width})"
        )
    return t


def _length_mask(info: _BatchInfo) -> Tensor:
    lengths = torch.tensor(info.lengths or (), dtype=torch.long)
    return (torch.arange(info.width)[None, :] < lengths[:, None]).float()


def _as_scores(name: str, out: Any, info: _BatchInfo) -> Tensor:
    """Validate what reward ``name`` returned and convert it to float32 (B,) or (B, T) on CPU.

    Accepts B numbers (list/tuple/tensor/array), a (B, T) tensor with T the longest completion
    (entries past each completion's end are set to 0), or B lists of per-token scores as long as
    each completion. Raises ``RewardError`` naming the reward and showing the bad value.
    """
    if out is None:
        raise RewardError(f"reward {name!r} returned None; expected {info.size} numbers or (B, T) token scores")
    if isinstance(out, (list, tuple)):
        if len(out) != info.size:
            raise RewardError(f"reward {name!r} returned {len(out)} values for a batch of {info.size}: {_short(out)}")
        if out and all(isinstance(row, (list, tuple)) for row in out):
            t = _token_rows(name, out, info)
        else:
            t = torch.tensor([_as_number(name, i, x, out) for i, x in enumerate(out)], dtype=torch.float64).float()
    elif isinstance(out, Tensor):
        t = _check_tensor(name, out, info)
    elif hasattr(out, "__array__") and not isinstance(out, (str, bytes)):
        t = _check_tensor(name, torch.as_tensor(out.__array__()), info)
    else:
        raise RewardError(
            f"reward {name!r} returned {type(out).__name__} {_short(out)}; expected {info.size} numbers "
            f"(list or tensor) or (B, T) token scores"
        )
    bad = (~torch.isfinite(t)).nonzero()
    if len(bad):
        where = tuple(bad[0].tolist())
        raise RewardError(
            f"reward {name!r} returned non-finite value {t[where].item()} at row {where[0]}: {_short(t.tolist())}"
        )
    return t


# ----------------------------------------------------------------------------- calling


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _check_params(name: str, fn: Callable[..., Any], params: Mapping[str, Any]) -> None:
    from_batch = sorted(set(params) & set(BATCH_KEYS))
    if from_batch:
        raise ConfigError(f"reward {name!r}: {from_batch} come from the batch and cannot be bound as parameters")
    sig = _signature(fn)
    if sig is None:
        return
    named = [p.name for p in sig.parameters.values()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in BATCH_KEYS]
    for key in params:
        if key not in named:
            close = difflib.get_close_matches(key, named, n=1, cutoff=0.5)
            hint = f". Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"reward {name!r} has no parameter {key!r} (valid: {', '.join(named) or 'none'}){hint} "
                f"(a bound parameter must be a named keyword parameter of the function)"
            )


async def _call(reward: Reward, batch: Mapping[str, Any], info: _BatchInfo) -> Tensor:
    clash = sorted(set(reward.params) & set(batch))
    if clash:
        raise RewardError(
            f"reward {reward.name!r}: parameter(s) {clash} also arrive as batch columns; rename one of them"
        )
    kwargs = {**batch, **reward.params}
    try:
        out = reward.fn(**kwargs)
        if inspect.isawaitable(out):
            out = await out
    except MaterlError:
        raise
    except TypeError as e:
        # the signature is checked only when a call fails, keeping it off the per-episode hot path
        sig = _signature(reward.fn)
        try:
            if sig is not None:
                sig.bind(**kwargs)
        except TypeError as bind_error:
            raise RewardError(
                f"reward {reward.name!r} cannot take this batch ({bind_error}); it is called with the keywords "
                f"{', '.join(sorted(kwargs))}: declare the ones it needs and end with **kwargs"
            ) from None
        raise RewardError(f"reward {reward.name!r} raised TypeError: {e}") from e
    except Exception as e:
        raise RewardError(f"reward {reward.name!r} raised {type(e).__name__}: {e}") from e
    return _as_scores(reward.name, out, info)


async def _gather(thunks: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run the thunks concurrently; re-raise the first failure as itself (not an ExceptionGroup)."""
    if len(thunks) == 1:
        return [await thunks[0]()]
    results: list[Any] = [None] * len(thunks)
    errors: list[BaseException | None] = [None] * len(thunks)

    async def run(i: int) -> None:
        try:
            results[i] = await thunks[i]()
        except Exception as e:  # noqa: BLE001 - re-raised below
            errors[i] = e

    async with anyio.create_task_group() as tg:
        for i in range(len(thunks)):
            tg.start_soon(run, i)
    for e in errors:
        if e is not None:
            raise e
    return results


def _merge(dicts: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for d in dicts:
        for key, value in d.items():
            unique, k = key, 2
            while unique in out:
                unique, k = f"{key}_{k}", k + 1
            out[unique] = value
    return out


def _on_last_token(name: str, scores_B: Tensor, info: _BatchInfo) -> Tensor:
    """A per-completion score summed with token-level ones lands on the completion's last trained
    token (``place_on_last_trained``: tool output after the model's last turn is not trained)."""
    if info.trained is not None:
        mask = torch.zeros(info.size, info.width)
        for i, row in enumerate(info.trained):
            mask[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
    else:
        mask = _length_mask(info)
    empty = (mask.sum(-1) == 0).nonzero()
    if len(empty):
        raise RewardError(
            f"reward {name!r} scores whole completions and is summed with token-level rewards, so it lands on "
            f"each completion's last trained token; row {empty[0].item()} has none"
        )
    return place_on_last_trained(scores_B.float(), mask)


def _sum(totals: Sequence[Tensor], names: Sequence[str], info: _BatchInfo) -> Tensor:
    if any(t.dim() == 2 for t in totals):
        totals = [t if t.dim() == 2 else _on_last_token(n, t, info) for t, n in zip(totals, names)]
    total = totals[0].clone()
    for t in totals[1:]:
        total += t
    return total


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
        return await self._evaluate(batch, _inspect_batch(batch))

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
        _check_params(name, self.fn, self.params)

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

    async def _evaluate(self, batch: Mapping[str, Any], info: _BatchInfo) -> RewardScores:
        scores = await _call(self, batch, info)
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
            raise ConfigError(f"RewardSum needs Reward or VectorReward terms, got {_short(terms)}")
        object.__setattr__(self, "terms", terms)

    @property
    def name(self) -> str:
        return " + ".join(f"{t.weight:g}*{t.name}" for t in self.terms)

    def _scaled(self, k: float) -> RewardSum:
        return RewardSum(tuple(t._scaled(k) for t in self.terms))

    async def _evaluate(self, batch: Mapping[str, Any], info: _BatchInfo) -> RewardScores:
        results = await _gather([partial(t._evaluate, batch, info) for t in self.terms])
        total = _sum([r.total for r in results], [t.name for t in self.terms], info)
        return RewardScores(total, _merge([r.components for r in results]))

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

    async def _evaluate(self, batch: Mapping[str, Any], info: _BatchInfo) -> RewardScores:
        results = await _gather([partial(m._evaluate, batch, info) for m in self.members])
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
        aggregated = _as_scores(self.name, out, info)
        return RewardScores(aggregated * self.weight, _merge([r.components for r in results]))

    def __repr__(self) -> str:
        return f"VectorReward({self.name!r}, weight={self.weight:g})"
