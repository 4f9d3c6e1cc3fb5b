"""Group-relative advantages (GRPO, RLOO) of outcome scores in one kernel call.

    adv_B_T = group_advantages(scores_B, mask_B_T, estimator="grpo", group_size=8)

equals ``materl.ops.advantages.ADVANTAGES[estimator](scores_B, mask_B_T, group_ids=..., ...)[0]``
for (B,) outcome rewards (the common case; token-level rewards go through the op):

    grpo:  A_i = (S_i - mean_g S) / (std_g S + eps)    singleton group: mean 0, std 1 (verl)
           scale="batch": std of all B scores; scale="none": no division (Dr. GRPO)
    rloo:  A_i = S_i - (sum_g S - S_i) / (n_g - 1)      singleton: baseline 0

broadcast over the row's trained tokens (mask != 0), 0 elsewhere; with ``mask_B_T=None`` the (B,)
per-row advantages. std is unbiased. Papers: GRPO arXiv:2402.03300, RLOO arXiv:2402.14740.
verl 0.9: ``compute_grpo_outcome_advantage`` (epsilon=1e-6), ``compute_rloo_outcome_advantage``.
``impl`` as in ``materl.kernels.rewards``; the torch path is the op itself.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from materl.errors import ConfigError, KernelError, RewardError, ShapeError
from materl.kernels import loader
from materl.ops._masked import group_index

ESTIMATORS = {"grpo": 0, "rloo": 1}
SCALES = {"group": 0, "batch": 1, "none": 2}


def _check(scores_B: Tensor, mask_B_T: Tensor | None) -> None:
    if scores_B.dim() != 1:
        raise ShapeError(f"group advantages take (B,) outcome scores; got {list(scores_B.shape)}")
    if mask_B_T is not None and (mask_B_T.dim() != 2 or mask_B_T.shape[0] != scores_B.shape[0]):
        raise ShapeError(f"mask must be (B,T) with B={scores_B.shape[0]}; got {list(mask_B_T.shape)}")
    bad = ~torch.isfinite(scores_B)
    if bad.any():
        raise RewardError(f"group advantages: scores are not finite in rows {bad.nonzero()[:10, 0].tolist()}")


def _kernel(impl: str, *tensors: Tensor | None) -> loader.Kernel | None:
    if impl not in ("auto", "mojo", "torch"):
        raise ConfigError(f"impl must be one of auto, mojo, torch; got {impl!r}")
    if impl == "torch":
        return None
    ts = [t for t in tensors if t is not None]
    ok = all(t.device.type == "cpu" for t in ts) and ts[0].dtype in (torch.float32, torch.float64)
    if not ok:
        if impl == "mojo":
            raise KernelError(f"group advantages: the Mojo kernel takes float32/float64 CPU scores; got "
                              f"{ts[0].dtype} on {ts[0].device}")
        return None
    kernel, why = loader.load_or_reason("advantages")
    if kernel is None and impl == "mojo":
        raise KernelError(f"group advantages: Mojo kernel unavailable: {why}")
    return kernel


def group_advantages(scores_B: Tensor, mask_B_T: Tensor | None = None, *, estimator: str = "grpo",
                     group_ids: Sequence[Hashable] | Tensor | None = None, group_size: int | None = None,
                     scale: str = "group", eps: float = 1e-6, impl: str = "auto") -> Tensor:
    """(B,) scores [, (B,T) mask] -> advantages (B,T) (or (B,) without a mask); see the module docstring."""
    if estimator not in ESTIMATORS:
        raise ConfigError(f"group advantages: unknown estimator {estimator!r}; valid: {', '.join(ESTIMATORS)}")
    if scale not in SCALES or (estimator == "rloo" and scale != "group"):
        raise ConfigError(f"group advantages: scale must be one of {', '.join(SCALES)} (grpo only); got {scale!r}")
    if eps < 0:
        raise ConfigError(f"group advantages: eps must be >= 0, got {eps!r}")
    _check(scores_B, mask_B_T)
    if not scores_B.is_floating_point():
        scores_B = scores_B.to(torch.get_default_dtype())
    index_B, num_groups = group_index(scores_B.shape[0], group_ids=group_ids, group_size=group_size)
    kernel = _kernel(impl, scores_B, mask_B_T)
    if kernel is None:
        return _torch(scores_B, mask_B_T, estimator, group_ids, group_size, scale, eps)
    dt = scores_B.dtype
    scores = scores_B.contiguous()
    mask = mask_B_T.to(dt).contiguous() if mask_B_T is not None else None
    index = index_B.to(torch.int64).contiguous()
    B = scores.shape[0]
    T = mask.shape[1] if mask is not None else 1
    out = torch.empty((B, T) if mask is not None else (B,), dtype=dt)
    scratch = torch.empty(5 * max(num_groups, 1), dtype=torch.float64)  # count, mean, std, min, max
    suffix = "f64" if dt == torch.float64 else "f32"
    rc = kernel.function(f"group_advantages_{suffix}", "iiiiiiiifii")(
        scores.data_ptr(), index.data_ptr(), B, num_groups, mask.data_ptr() if mask is not None else 0, T,
        ESTIMATORS[estimator], SCALES[scale], float(eps), scratch.data_ptr(), out.data_ptr())
    if rc != 0:
        raise KernelError(f"group advantages kernel returned error code {rc}")
    return out


def _torch(scores_B: Tensor, mask_B_T: Tensor | None, estimator: str, group_ids, group_size, scale: str,
           eps: float) -> Tensor:
    from materl.ops.advantages import ADVANTAGES

    mask = mask_B_T if mask_B_T is not None else torch.ones(scores_B.shape[0], 1, dtype=scores_B.dtype)
    hp = {"scale": scale, "eps": eps} if estimator == "grpo" else {}
    adv, _ = ADVANTAGES.get(estimator)(scores_B, mask, group_ids=group_ids, group_size=group_size, **hp)
    if mask_B_T is None:
        return adv[:, 0]
    return adv
