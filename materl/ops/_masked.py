"""Masked reductions and group bookkeeping shared by the ops. Pure tensor functions.

Shapes: B rows, T tokens; ``mask_B_T`` is 1 where a token counts.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from materl.errors import ShapeError


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over the entries where mask is 1 (verl: ``masked_mean``). An all-zero mask gives 0."""
    denom = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / denom.clamp(min=1)


def place_on_last_trained(values_B: Tensor, mask_B_T: Tensor) -> Tensor:
    """(B, T): each row's value on its last trained token (the last one where the mask is set:
    the model's own final token, never tool output after it); 0 elsewhere, and a row with no
    trained token gets none. The one rule for where a per-completion score lands among tokens
    (outcome rewards summed with token-level ones, advantages, value targets)."""
    T = mask_B_T.shape[1]
    pos = torch.arange(T, device=mask_B_T.device).expand_as(mask_B_T)
    last_B = torch.where(mask_B_T > 0, pos, -1).amax(-1) if T else torch.full((len(values_B),), -1)
    out = torch.zeros(mask_B_T.shape, dtype=values_B.dtype, device=mask_B_T.device)
    has = last_B >= 0
    out[has.nonzero()[:, 0], last_B[has]] = values_B[has]
    return out


def masked_var(x: Tensor, mask: Tensor, *, unbiased: bool = True) -> Tensor:
    """Variance over masked entries; unbiased (n-1) like verl's ``masked_var``."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        var = var * n / (n - 1).clamp(min=1)
    return var


def masked_whiten(x: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) over masked entries (verl: ``masked_whiten``).

    Masked entries that are all equal have no spread to whiten: they give exactly 0 (the mean
    with ``shift_mean=False``), where verl's formula multiplies a rounding residue by
    ``1 / sqrt(eps)`` = 1e4."""
    mean = masked_mean(x, mask)
    x_b, mask_b = torch.broadcast_tensors(x, mask)
    kept = x_b[mask_b != 0]
    if kept.numel() and bool(kept.max() == kept.min()):
        return torch.zeros_like(x) if shift_mean else torch.zeros_like(x) + kept[0]
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    return whitened if shift_mean else whitened + mean


def group_index(
    n: int, *, group_ids: Sequence[Hashable] | Tensor | None = None, group_size: int | None = None
) -> tuple[Tensor, int]:
    """Map rows to dense group indices 0..G-1 (in order of first appearance).

    Exactly one of ``group_ids`` (any hashables, one per row) or ``group_size`` (consecutive
    rows of that size) is given. Returns ``(index_B, num_groups)``.
    """
    if (group_ids is None) == (group_size is None):
        raise ShapeError(
            f"give exactly one of group_ids or group_size (got group_ids={'set' if group_ids is not None else None}, "
            f"group_size={group_size})"
        )
    if group_size is not None:
        if group_size < 1 or n % group_size:
            raise ShapeError(f"group_size={group_size} does not divide the batch of {n} rows")
        return torch.arange(n) // group_size, n // group_size
    ids = group_ids.tolist() if isinstance(group_ids, Tensor) else list(group_ids)
    if len(ids) != n:
        raise ShapeError(f"group_ids has {len(ids)} entries for a batch of {n} rows")
    dense: dict[Hashable, int] = {}
    index = [dense.setdefault(g, len(dense)) for g in ids]
    return torch.tensor(index, dtype=torch.long), len(dense)


def group_stats(scores_B: Tensor, index_B: Tensor, num_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row group mean, unbiased group std (0 for singleton groups) and group size.

    A group whose scores are all equal gets that score as its mean and a std of exactly 0 (the
    two-pass sum would leave a rounding residue, e.g. mean(0.1, 0.1, 0.1) = 0.10000000000000002,
    which a division by ``std + eps`` would turn into a spurious advantage)."""
    ones = torch.ones_like(scores_B)
    index_B = index_B.to(scores_B.device)
    zeros_G = torch.zeros(num_groups, dtype=scores_B.dtype, device=scores_B.device)
    count_G = zeros_G.clone().index_add_(0, index_B, ones)
    sum_G = zeros_G.clone().index_add_(0, index_B, scores_B)
    max_G = zeros_G.clone().scatter_reduce_(0, index_B, scores_B, "amax", include_self=False)
    min_G = zeros_G.clone().scatter_reduce_(0, index_B, scores_B, "amin", include_self=False)
    flat_G = max_G == min_G
    mean_G = torch.where(flat_G, max_G, sum_G / count_G)
    dev_B = scores_B - mean_G[index_B]
    sq_G = zeros_G.clone().index_add_(0, index_B, dev_B**2)
    std_G = torch.where((count_G > 1) & ~flat_G, (sq_G / (count_G - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq_G))
    return mean_G[index_B], std_G[index_B], count_G[index_B]


def check_same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{k}{list(v)}" for k, v in shapes.items())
        raise ShapeError(f"shapes must match: {listed}")
