"""On-policy distillation: per-token advantages from a teacher's log-probs of the student's tokens.

Thinking Machines, "On-Policy Distillation" (Lu et al. 2025,
https://thinkingmachines.ai/blog/on-policy-distillation); tinker-cookbook
``distillation/train_on_policy.py`` (``incorporate_kl_penalty``). The student samples; the teacher
scores every sampled token with its own log-prob of the exact same ids; the student learns from
the per-token reverse KL, an estimate of ``KL(student || teacher)`` on its own samples:

    reverse_kl_t = (logp_student_t - logp_teacher_t) * mask_t     logp_student: the sampling log-probs
    a_t          = -coef * reverse_kl_t
    A_t          = sum_{k >= t} discount^(k - t) a_k              (discount = 0: A_t = a_t)
    advantage_t  = (base_t + A_t) * mask_t                         base: task advantages, or 0

The discounted sum runs over every position of the row, as tinker's
``discounted_future_sum_vectorized`` does over the datum: untrained tokens (tool output) contribute
0 but count as positions. Tinker adds ``A`` to the task advantages of the same datum; so does
``base`` here (``ml.with_distillation``). Difference: materl returns 0 at untrained positions
(its convention for every advantage; those tokens carry no gradient either way).
No verl/TRL counterpart with these numbers (TRL's GKDTrainer uses full-vocabulary divergences).
"""

from __future__ import annotations

import torch
from torch import Tensor

from materl.errors import ConfigError, ShapeError


def discounted_future_sum(x_B_T: Tensor, *, gamma: float) -> Tensor:
    """``y_t = x_t + gamma * y_{t+1}`` along the last dimension (tinker: ``discounted_future_sum_vectorized``)."""
    out = torch.empty_like(x_B_T)
    acc = torch.zeros_like(x_B_T[..., 0])
    for t in range(x_B_T.shape[-1] - 1, -1, -1):
        acc = x_B_T[..., t] + gamma * acc
        out[..., t] = acc
    return out


@torch.no_grad()
def distill_advantages(student_logp_B_T: Tensor, teacher_logp_B_T: Tensor, mask_B_T: Tensor,
                       base_B_T: Tensor | None = None, *, coef: float = 1.0,
                       discount: float = 0.0) -> tuple[Tensor, Tensor]:
    """(advantages, reverse_kl), both (B, T) and 0 where ``mask`` is 0; see the module docstring.
    ``student_logp``: the log-probs the student sampled with; ``teacher_logp``: the teacher's of
    the same ids; ``base``: the task advantages the distillation term is added to (None: 0)."""
    shapes = [tuple(t.shape) for t in (student_logp_B_T, teacher_logp_B_T, mask_B_T)]
    if base_B_T is not None:
        shapes.append(tuple(base_B_T.shape))
    if len(set(shapes)) != 1 or len(shapes[0]) != 2:
        raise ShapeError(f"distill_advantages needs (B, T) tensors of one shape (student, teacher, mask"
                         f"{', base' if base_B_T is not None else ''}); got {shapes}")
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not coef >= 0:
        raise ConfigError(f"distill_advantages: coef must be a number >= 0, got {coef!r}")
    if isinstance(discount, bool) or not isinstance(discount, (int, float)) or not 0.0 <= discount <= 1.0:
        raise ConfigError(f"distill_advantages: discount must be in [0, 1], got {discount!r}")
    m = mask_B_T.to(student_logp_B_T.dtype)
    reverse_kl = (student_logp_B_T - teacher_logp_B_T) * m
    adv = -coef * reverse_kl
    if discount > 0:
        adv = discounted_future_sum(adv, gamma=float(discount))
    if base_B_T is not None:
        adv = adv + base_B_T
    return adv * m, reverse_kl
