"""Small masked statistics for metrics (Python floats, no gradient)."""

from __future__ import annotations

from torch import Tensor


def masked_scalar(x: Tensor, mask: Tensor) -> float:
    """Mean of ``x`` over ``mask`` as a float (0.0 for an empty mask)."""
    x = x.detach().float()
    m = mask.float()
    return float((x * m).sum() / m.sum().clamp(min=1))
