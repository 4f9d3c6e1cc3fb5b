"""Reward kernels on padded token ids: repetition, diversity, length, pattern match.

Inputs: ``ids_B_T`` int64 token ids, padded (entries at ``t >= lengths_B[b]`` are ignored) and
``lengths_B`` int64 completion lengths in ``[0, T]`` (``pad_ids`` builds both from B lists).
Each function returns float64 ``(B,)``: the same numbers, bit for bit, as the Python rewards of
``materl.ops.reward_builtins`` (``repetition``, ``diversity``, ``length``), whose docstrings give
the definitions; ``pattern_match`` has no Python built-in (1.0 where a token sequence occurs).

Every function takes ``impl``: ``"auto"`` (the Mojo kernel ``kernels/rewards.mojo`` when it builds
and the tensors are on the CPU, else torch), ``"mojo"`` (raise ``KernelError`` if it cannot run)
or ``"torch"`` (vectorised torch, same results). The compiler picks; the functions never guess.
No TRL/verl counterparts (see the Python built-ins for the closest ones).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch
from torch import Tensor

from materl.errors import ConfigError, KernelError, ShapeError
from materl.kernels import loader
from materl.ops.reward_builtins import length_interval

IMPLS = ("auto", "mojo", "torch")


# ----------------------------------------------------------------------------- inputs


def pad_ids(completion_ids: Sequence[Sequence[int]], *, pad: int = 0) -> tuple[Tensor, Tensor]:
    """B lists of token ids -> (ids (B, T) int64 padded with ``pad``, lengths (B,) int64), T = longest."""
    lengths = torch.tensor([len(r) for r in completion_ids], dtype=torch.int64)
    T = int(lengths.max()) if len(lengths) else 0
    ids = torch.full((len(completion_ids), T), pad, dtype=torch.int64)
    flat = array("q")
    for row in completion_ids:
        flat.extend(row.tolist() if isinstance(row, Tensor) else row)
    if len(flat):
        ids.masked_scatter_(torch.arange(T)[None, :] < lengths[:, None], torch.frombuffer(flat, dtype=torch.int64))
    return ids, lengths


def _check_ids(op: str, ids: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    if ids.dim() != 2 or lengths.dim() != 1 or lengths.shape[0] != ids.shape[0]:
        raise ShapeError(
            f"{op}: need ids (B,T) and lengths (B,); got ids{list(ids.shape)}, lengths{list(lengths.shape)}")
    if ids.is_floating_point() or lengths.is_floating_point():
        raise ShapeError(f"{op}: ids and lengths must be integer tensors; got {ids.dtype}, {lengths.dtype}")
    return ids.to(torch.int64).contiguous(), lengths.to(torch.int64).contiguous()


def _check_range(op: str, lengths: Tensor, T: int) -> None:
    if len(lengths) and (int(lengths.min()) < 0 or int(lengths.max()) > T):
        raise ShapeError(
            f"{op}: lengths must lie in [0, T={T}]; got min {int(lengths.min())}, max {int(lengths.max())}")


def _check_n(op: str, n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"{op}: n must be an integer >= 1, got {n!r}")
    return n


def _kernel(op: str, impl: str, *tensors: Tensor) -> loader.Kernel | None:
    """The rewards kernel to use, or None for torch (see the module docstring for ``impl``)."""
    if impl not in IMPLS:
        raise ConfigError(f"{op}: impl must be one of {', '.join(IMPLS)}; got {impl!r}")
    if impl == "torch":
        return None
    on_cpu = all(t.device.type == "cpu" for t in tensors)
    if impl == "mojo":
        if not on_cpu:
            raise KernelError(f"{op}: the Mojo kernel runs on CPU tensors; got {tensors[0].device}")
        kernel, why = loader.load_or_reason("rewards")
        if kernel is None:
            raise KernelError(f"{op}: Mojo kernel unavailable: {why}")
        return kernel
    return loader.load("rewards") if on_cpu else None


def _call(kernel: loader.Kernel, op: str, symbol: str, signature: str, *args) -> None:
    rc = kernel.function(symbol, signature)(*args)
    if rc == -1:
        raise ShapeError(f"{op}: a length lies outside [0, T]")
    if rc != 0:
        raise KernelError(f"{op}: kernel rewards.{symbol} returned error code {rc}")


def scratch_capacity(T: int) -> int:
    """Slots of the per-row n-gram hash set: the power of two >= 2T (at least 2)."""
    cap = 2
    while cap < 2 * T:
        cap *= 2
    return cap


# ----------------------------------------------------------------------------- n-gram rewards


def ngram_counts_torch(ids_B_T: Tensor, lengths_B: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """(W_B windows, U_B distinct windows) of every row, int64, vectorised (no Python loop over rows)."""
    B, T = ids_B_T.shape
    windows_B = (lengths_B - n + 1).clamp(min=0)
    if B == 0 or T < n or int(windows_B.max()) == 0:
        return windows_B, torch.zeros_like(windows_B)
    win = ids_B_T.unfold(1, n, 1)  # (B, T-n+1, n), a view
    valid = torch.arange(T - n + 1)[None, :] < windows_B[:, None]
    rows_N = torch.arange(B)[:, None].expand(B, T - n + 1)[valid]
    win_N_n = win[valid]
    lo, hi = int(win_N_n.min()), int(win_N_n.max())
    span = hi - lo + 1
    if B * span**n < 2**62:  # encode (row, window) exactly as one int64, then a 1-D unique
        key = rows_N.clone()
        for k in range(n):
            key = key * span + (win_N_n[:, k] - lo)
        uniq_rows = torch.unique(key) // span**n
    else:
        uniq_rows = torch.unique(torch.cat([rows_N[:, None], win_N_n], dim=1), dim=0)[:, 0]
    return windows_B, torch.bincount(uniq_rows, minlength=B)


def _ratio(num_B: Tensor, den_B: Tensor) -> Tensor:
    return torch.where(den_B > 0, num_B.double() / den_B.clamp(min=1).double(), torch.zeros((), dtype=torch.float64))


def _ngram_reward(op: str, ids_B_T: Tensor, lengths_B: Tensor, n: int, impl: str) -> Tensor:
    n = _check_n(op, n)
    ids, lengths = _check_ids(op, ids_B_T, lengths_B)
    B, T = ids.shape
    kernel = _kernel(op, impl, ids, lengths)
    if kernel is None:
        _check_range(op, lengths, T)
        windows, distinct = ngram_counts_torch(ids, lengths, n)
        if op == "repetition":
            return 0.0 - _ratio(windows - distinct, windows)
        return _ratio(distinct, windows)
    out = torch.empty(B, dtype=torch.float64)
    cap = scratch_capacity(T)
    scratch = torch.empty(2 * cap, dtype=torch.int64)
    _call(kernel, op, op, "iiiiiiii", ids.data_ptr(), lengths.data_ptr(), B, T, n, scratch.data_ptr(), cap,
          out.data_ptr())
    return out


def repetition(ids_B_T: Tensor, lengths_B: Tensor, *, n: int = 3, impl: str = "auto") -> Tensor:
    """Minus the fraction of repeated token n-grams per row: ``-(W - U) / W``, 0 when ``L < n``.

    W = L - n + 1 windows ``ids[j:j+n]``, U distinct ones (materl.ops.reward_builtins.repetition;
    e.g. n=2, ids [1,2,1,2,1] -> -0.5). (B,T), (B,) -> float64 (B,).
    """
    return _ngram_reward("repetition", ids_B_T, lengths_B, n, impl)


def diversity(ids_B_T: Tensor, lengths_B: Tensor, *, n: int = 1, impl: str = "auto") -> Tensor:
    """Fraction of distinct token n-grams per row: ``U / W``, 0 when ``L < n``
    (materl.ops.reward_builtins.diversity; n=1: distinct tokens / tokens). (B,T), (B,) -> float64 (B,)."""
    return _ngram_reward("diversity", ids_B_T, lengths_B, n, impl)


# ----------------------------------------------------------------------------- length


def length(lengths_B: Tensor, *, target: int | None = None, range: tuple[int, int] | None = None,  # noqa: A002
           scale: float | None = None, impl: str = "auto") -> Tensor:
    """1 inside the target length, falling linearly to 0 with the distance from it.

        d = max(lo - L, 0, L - hi),   r = max(0, 1 - d / scale)

    [lo, hi] = ``range`` or (target, target) (default 128); scale defaults to max(hi, 1)
    (materl.ops.reward_builtins.length; DAPO's soft overlong punishment is
    ``length(range=(0, L_max - L_cache), scale=L_cache) - 1``). (B,) -> float64 (B,).
    """
    lo, hi, scale = length_interval(target=target, range=range, scale=scale)
    lengths = _check_lengths_only("length", lengths_B)
    kernel = _kernel("length", impl, lengths)
    if kernel is None:
        d = torch.maximum((lo - lengths).clamp(min=0), lengths - hi)
        return (1.0 - d.double() / scale).clamp(min=0.0)
    out = torch.empty(len(lengths), dtype=torch.float64)
    _call(kernel, "length", "length_reward", "iiiifi", lengths.data_ptr(), len(lengths), lo, hi, scale, out.data_ptr())
    return out


def _check_lengths_only(op: str, lengths_B: Tensor) -> Tensor:
    if lengths_B.dim() != 1 or lengths_B.is_floating_point():
        raise ShapeError(f"{op}: lengths must be an integer (B,) tensor; got {lengths_B.dtype}{list(lengths_B.shape)}")
    return lengths_B.to(torch.int64).contiguous()


LENGTH_STATS = ("mean", "std", "min", "max", "clip_ratio")


def length_stats(lengths_B: Tensor, *, max_length: int, impl: str = "auto") -> dict[str, float]:
    """Length distribution of a batch: mean, unbiased std (0 for B < 2), min, max and
    ``clip_ratio`` = fraction with L >= ``max_length`` (truncated by the generation budget).
    All 0 for an empty batch. verl reports the same as ``response_length/{mean,max,min,clip_ratio}``."""
    lengths = _check_lengths_only("length_stats", lengths_B)
    kernel = _kernel("length_stats", impl, lengths)
    if kernel is None:
        if len(lengths) == 0:
            return dict.fromkeys(LENGTH_STATS, 0.0)
        L = lengths.double()
        std = float(L.std()) if len(L) > 1 else 0.0
        clip = float((lengths >= max_length).double().mean())
        return dict(zip(LENGTH_STATS, (float(L.mean()), std, float(L.min()), float(L.max()), clip)))
    out = torch.empty(5, dtype=torch.float64)
    _call(kernel, "length_stats", "length_stats", "iiii", lengths.data_ptr(), len(lengths), int(max_length),
          out.data_ptr())
    return dict(zip(LENGTH_STATS, out.tolist()))


# ----------------------------------------------------------------------------- pattern match


def as_pattern(pattern: Sequence[int] | Tensor) -> Tensor:
    p = torch.as_tensor(pattern, dtype=torch.int64).reshape(-1).contiguous()
    if len(p) == 0:
        raise ConfigError("pattern_match: the pattern needs at least one token id, got an empty one")
    return p


def pattern_match(ids_B_T: Tensor, lengths_B: Tensor, pattern: Sequence[int] | Tensor, *,
                  impl: str = "auto") -> Tensor:
    """1.0 where the token sequence ``pattern`` occurs contiguously within a row's first L tokens.

        r_b = 1  if  exists j <= L_b - m :  ids[b, j:j+m] == pattern,   else 0

    (B,T), (B,), (m,) -> float64 (B,). No TRL/verl built-in (the text-level analogue is the
    ``format`` reward's regex search).
    """
    ids, lengths = _check_ids("pattern_match", ids_B_T, lengths_B)
    pat = as_pattern(pattern)
    B, T = ids.shape
    kernel = _kernel("pattern_match", impl, ids, lengths)
    if kernel is None:
        _check_range("pattern_match", lengths, T)
        m = len(pat)
        if T < m or B == 0:
            return torch.zeros(B, dtype=torch.float64)
        hit = (ids.unfold(1, m, 1) == pat).all(-1)  # (B, T-m+1)
        hit &= torch.arange(T - m + 1)[None, :] <= (lengths - m)[:, None]
        return hit.any(-1).double()
    out = torch.empty(B, dtype=torch.float64)
    _call(kernel, "pattern_match", "pattern_match", "iiiiiii", ids.data_ptr(), lengths.data_ptr(), B, T,
          pat.data_ptr(), len(pat), out.data_ptr())
    return out


#: Kernel rewards by the name of the Python reward they reproduce (``pattern_match`` is kernel-only).
KERNEL_REWARDS = {"repetition": repetition, "diversity": diversity, "length": length, "pattern_match": pattern_match}


def score_completions(name: str, completion_ids: Sequence[Sequence[int]], *, impl: str = "auto",
                      **params) -> Tensor:
    """Run kernel reward ``name`` on B lists of token ids (the batch form the Python rewards take)."""
    if name not in KERNEL_REWARDS:
        raise ConfigError(f"no reward kernel {name!r}; valid: {', '.join(KERNEL_REWARDS)}")
    ids, lengths = pad_ids(completion_ids)
    if name == "length":
        return length(lengths, impl=impl, **params)
    return KERNEL_REWARDS[name](ids, lengths, impl=impl, **params)
