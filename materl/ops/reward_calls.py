"""The reward-calling contract: what a reward function is called with (the batch, ``BATCH_KEYS``
and dataset columns, plus its own parameters) and what it may return (B numbers, or token-level
scores), checked and shaped into float32 tensors; and the sum of several rewards' scores (a
per-completion score summed with token-level ones lands on the completion's last trained token).
``ops.rewards`` composes rewards on top of this.
"""

from __future__ import annotations

import difflib
import inspect
import numbers
import reprlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio
import torch
from torch import Tensor

from materl.errors import ConfigError, MaterlError, RewardError, ShapeError
from materl.ops._masked import place_on_last_trained

if TYPE_CHECKING:
    from materl.ops.rewards import Reward

#: Keywords every reward function may receive from the batch (besides dataset columns).
BATCH_KEYS = ("completions", "prompts", "completion_ids", "rollouts")

_INT_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_repr = reprlib.Repr()
_repr.maxlist, _repr.maxtuple, _repr.maxstring, _repr.maxother = 8, 8, 60, 80
short = _repr.repr


class RewardScores(NamedTuple):
    total: Tensor  # weighted float32 total, (B,) or (B, T)
    components: dict[str, Tensor]  # unweighted score of every leaf reward, by (unique) name


@dataclass(frozen=True)
class BatchInfo:
    size: int
    lengths: tuple[int, ...] | None  # completion lengths in tokens, when the batch has them
    trained: tuple[tuple[int, ...], ...] | None = None  # the rollouts' loss masks, when they align with them

    @property
    def width(self) -> int:
        return max(self.lengths, default=0) if self.lengths is not None else 0


def inspect_batch(batch: Mapping[str, Any]) -> BatchInfo:
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
    return BatchInfo(next(iter(sizes.values())), lengths, trained)


# ----------------------------------------------------------------------------- validation


def _as_number(name: str, i: int, x: Any, out: Any) -> float:
    if isinstance(x, Tensor) and x.numel() == 1:
        return float(x.item())
    if isinstance(x, numbers.Real):  # bool, int, float, numpy scalars
        return float(x)
    if x is None:
        raise RewardError(
            f"reward {name!r} returned None at row {i}: {short(out)}; materl needs a number for every "
            f"completion (TRL would skip the row): return 0.0 or filter the batch"
        )
    raise RewardError(f"reward {name!r} returned a non-number at row {i}: {x!r} ({type(x).__name__}) in {short(out)}")


def _token_rows(name: str, out: Sequence[Sequence[Any]], info: BatchInfo) -> Tensor:
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


def _check_tensor(name: str, t: Tensor, info: BatchInfo) -> Tensor:
    if t.is_complex() or not (t.is_floating_point() or t.dtype in _INT_DTYPES):
        raise RewardError(f"reward {name!r} returned a tensor of dtype {t.dtype}; expected real numbers")
    t = t.detach().to(device="cpu", dtype=torch.float32)
    if t.dim() == 1 and t.shape[0] != info.size:
        raise RewardError(f"reward {name!r} returned {len(t)} values for a batch of {info.size}: {short(t.tolist())}")
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


def _length_mask(info: BatchInfo) -> Tensor:
    lengths = torch.tensor(info.lengths or (), dtype=torch.long)
    return (torch.arange(info.width)[None, :] < lengths[:, None]).float()


def as_scores(name: str, out: Any, info: BatchInfo) -> Tensor:
    """Validate what reward ``name`` returned and convert it to float32 (B,) or (B, T) on CPU.

    Accepts B numbers (list/tuple/tensor/array), a (B, T) tensor with T the longest completion
    (entries past each completion's end are set to 0), or B lists of per-token scores as long as
    each completion. Raises ``RewardError`` naming the reward and showing the bad value.
    """
    if out is None:
        raise RewardError(f"reward {name!r} returned None; expected {info.size} numbers or (B, T) token scores")
    if isinstance(out, (list, tuple)):
        if len(out) != info.size:
            raise RewardError(f"reward {name!r} returned {len(out)} values for a batch of {info.size}: {short(out)}")
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
            f"reward {name!r} returned {type(out).__name__} {short(out)}; expected {info.size} numbers "
            f"(list or tensor) or (B, T) token scores"
        )
    bad = (~torch.isfinite(t)).nonzero()
    if len(bad):
        where = tuple(bad[0].tolist())
        raise RewardError(
            f"reward {name!r} returned non-finite value {t[where].item()} at row {where[0]}: {short(t.tolist())}"
        )
    return t


# ----------------------------------------------------------------------------- calling


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def check_params(name: str, fn: Callable[..., Any], params: Mapping[str, Any]) -> None:
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


async def call_reward(reward: Reward, batch: Mapping[str, Any], info: BatchInfo) -> Tensor:
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
    return as_scores(reward.name, out, info)


async def gather(thunks: Sequence[Callable[[], Any]]) -> list[Any]:
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


def merge_components(dicts: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for d in dicts:
        for key, value in d.items():
            unique, k = key, 2
            while unique in out:
                unique, k = f"{key}_{k}", k + 1
            out[unique] = value
    return out


def _on_last_token(name: str, scores_B: Tensor, info: BatchInfo) -> Tensor:
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


def sum_terms(totals: Sequence[Tensor], names: Sequence[str], info: BatchInfo) -> Tensor:
    if any(t.dim() == 2 for t in totals):
        totals = [t if t.dim() == 2 else _on_last_token(n, t, info) for t, n in zip(totals, names)]
    total = totals[0].clone()
    for t in totals[1:]:
        total += t
    return total
