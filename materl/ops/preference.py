"""Pairwise preference losses (DPO family) over sequence log-probs.

Every loss has one contract::

    fn(chosen_logp_B, rejected_logp_B, ref_chosen_logp_B, ref_rejected_logp_B, *, beta=0.1, ...)
        -> PreferenceOut(losses_B, chosen_rewards_B, rejected_rewards_B)

B preference pairs. ``*_logp_B`` are sequence log-probs from :func:`sequence_logps`: summed
over the completion's tokens, except for the losses in :data:`LENGTH_NORMALISED` (ipo, simpo),
which take the per-token mean (``average=True``). ``losses_B`` is per pair; the learner takes
its mean (TRL: ``per_sequence_loss.mean()``). The rewards are ``beta * (logp - ref_logp)``
(simpo: ``beta * logp``), detached, for logging exactly as TRL logs ``rewards/chosen``.

Counterparts: TRL 1.16 ``DPOTrainer._compute_loss`` (``loss_type`` sigmoid, hinge, ipo, robust;
``f_divergence_type="reverse_kl"``, ``ld_alpha=None``, ``use_weighting=False``) and TRL 1.16
``trl.experimental.cpo.CPOTrainer.cpo_loss`` (``loss_type="simpo"``, ``alpha=0``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from materl.errors import ConfigError, ShapeError
from materl.ops._masked import check_same_shape
from materl.registry import Registry

PREFERENCE_LOSSES = Registry("preference_loss")

# Losses whose *_logp inputs are per-token means (sequence_logps(..., average=True)).
LENGTH_NORMALISED = frozenset({"ipo", "simpo"})
# Losses that ignore the reference log-probs (the learner need not run a reference model).
REFERENCE_FREE = frozenset({"simpo"})


class PreferenceOut(NamedTuple):
    losses_B: Tensor
    chosen_rewards_B: Tensor
    rejected_rewards_B: Tensor


def sequence_logps(token_logp_B_T: Tensor, mask_B_T: Tensor, *, average: bool = False) -> Tensor:
    """Sequence log-prob of each row: ``sum_t mask*logp`` or, with ``average``, that sum over
    ``max(1, sum_t mask)``.

    Shapes: (B,T), (B,T) -> (B,). TRL: ``per_token_logps.sum(dim=1)`` in ``DPOTrainer`` and
    ``CPOTrainer.get_batch_logps(average_log_prob=...)``. Deliberate difference: an all-masked
    row averages to 0 (TRL's CPO divides by 0 and gives NaN).
    """
    check_same_shape(token_logp_B_T=token_logp_B_T, mask_B_T=mask_B_T)
    if token_logp_B_T.dim() != 2:
        raise ShapeError(f"sequence_logps expects (B,T) tensors, got shape {list(token_logp_B_T.shape)}")
    mask = mask_B_T.to(token_logp_B_T.dtype)
    total_B = (token_logp_B_T * mask).sum(-1)
    return total_B / mask.sum(-1).clamp(min=1) if average else total_B


def _check(beta: float, **tensors: Tensor | None) -> None:
    if not beta > 0:
        raise ConfigError(f"preference loss needs beta > 0, got beta={beta!r}")
    given = {k: v for k, v in tensors.items() if v is not None}
    check_same_shape(**given)
    shape = next(iter(given.values())).shape
    if len(shape) != 1:
        raise ShapeError(f"preference losses take sequence log-probs of shape (B,), got {list(shape)}")


def _logratios(c: Tensor, r: Tensor, rc: Tensor, rr: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    _check(beta, chosen_logp=c, rejected_logp=r, ref_chosen_logp=rc, ref_rejected_logp=rr)
    return c - rc, r - rr


def _out(losses_B: Tensor, chosen_logratio_B: Tensor, rejected_logratio_B: Tensor, beta: float) -> PreferenceOut:
    return PreferenceOut(losses_B, beta * chosen_logratio_B.detach(), beta * rejected_logratio_B.detach())


@PREFERENCE_LOSSES.register("sigmoid")
def sigmoid(
    chosen_logp: Tensor, rejected_logp: Tensor, ref_chosen_logp: Tensor, ref_rejected_logp: Tensor,
    *, beta: float = 0.1,
) -> PreferenceOut:
    """DPO (Rafailov et al. 2023, arXiv:2305.18290): ``loss = -log sigmoid(beta * delta)``,
    ``delta = (logp_c - ref_c) - (logp_r - ref_r)`` on summed sequence log-probs.

    Shapes: four (B,) -> PreferenceOut of (B,). TRL 1.16: ``DPOTrainer`` ``loss_type="sigmoid"``
    (which, unlike TRL < 1.0, takes no label smoothing: use ``robust`` for that).
    """
    chosen_lr, rejected_lr = _logratios(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, beta)
    losses_B = -F.logsigmoid(beta * (chosen_lr - rejected_lr))
    return _out(losses_B, chosen_lr, rejected_lr, beta)


@PREFERENCE_LOSSES.register("hinge")
def hinge(
    chosen_logp: Tensor, rejected_logp: Tensor, ref_chosen_logp: Tensor, ref_rejected_logp: Tensor,
    *, beta: float = 0.1,
) -> PreferenceOut:
    """SLiC hinge (Zhao et al. 2023, arXiv:2305.10425): ``loss = relu(1 - beta * delta)``, delta
    as in :func:`sigmoid`; ``1/beta`` is the margin.

    Shapes: four (B,) -> PreferenceOut of (B,). TRL 1.16: ``DPOTrainer`` ``loss_type="hinge"``.
    """
    chosen_lr, rejected_lr = _logratios(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, beta)
    losses_B = torch.relu(1 - beta * (chosen_lr - rejected_lr))
    return _out(losses_B, chosen_lr, rejected_lr, beta)


@PREFERENCE_LOSSES.register("ipo")
def ipo(
    chosen_logp: Tensor, rejected_logp: Tensor, ref_chosen_logp: Tensor, ref_rejected_logp: Tensor,
    *, beta: float = 0.1,
) -> PreferenceOut:
    """IPO (Azar et al. 2023, arXiv:2310.12036, eq. 17, beta = tau):
    ``loss = (delta - 1/(2*beta))**2`` with delta on per-token MEAN log-probs.

    Shapes: four (B,) -> PreferenceOut of (B,). TRL 1.16: ``DPOTrainer`` ``loss_type="ipo"``
    divides each summed log-ratio by its completion's token count; passing
    ``sequence_logps(..., average=True)`` here gives the same loss and gradient, because the
    policy and reference share a completion mask. Deliberate difference: the rewards are
    ``beta`` times the mean log-ratio (TRL logs ``beta`` times the summed log-ratio).
    """
    chosen_lr, rejected_lr = _logratios(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, beta)
    losses_B = (chosen_lr - rejected_lr - 1 / (2 * beta)) ** 2
    return _out(losses_B, chosen_lr, rejected_lr, beta)


@PREFERENCE_LOSSES.register("robust")
def robust(
    chosen_logp: Tensor, rejected_logp: Tensor, ref_chosen_logp: Tensor, ref_rejected_logp: Tensor,
    *, beta: float = 0.1, label_smoothing: float = 0.0,
) -> PreferenceOut:
    """Robust DPO (Chowdhury et al. 2024, arXiv:2403.00409), an unbiased loss under label-flip
    rate ``eps = label_smoothing``:
    ``loss = (-(1-eps) * log sigmoid(beta*delta) + eps * log sigmoid(-beta*delta)) / (1 - 2*eps)``.
    ``eps = 0`` is :func:`sigmoid`.

    Shapes: four (B,) -> PreferenceOut of (B,). TRL 1.16: ``DPOTrainer`` ``loss_type="robust"``
    (TRL also requires ``0 <= label_smoothing < 0.5``).
    """
    if not 0.0 <= label_smoothing < 0.5:
        raise ConfigError(f"robust preference loss needs 0 <= label_smoothing < 0.5, got {label_smoothing!r}")
    chosen_lr, rejected_lr = _logratios(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, beta)
    logits_B = beta * (chosen_lr - rejected_lr)
    clean_B = -(1 - label_smoothing) * F.logsigmoid(logits_B)
    flipped_B = -label_smoothing * F.logsigmoid(-logits_B)
    losses_B = (clean_B - flipped_B) / (1 - 2 * label_smoothing)
    return _out(losses_B, chosen_lr, rejected_lr, beta)


@PREFERENCE_LOSSES.register("simpo")
def simpo(
    chosen_logp: Tensor, rejected_logp: Tensor,
    ref_chosen_logp: Tensor | None = None, ref_rejected_logp: Tensor | None = None,
    *, beta: float = 0.1, gamma: float = 0.5, label_smoothing: float = 0.0,
) -> PreferenceOut:
    """SimPO (Meng et al. 2024, arXiv:2405.14734), reference-free, on per-token MEAN log-probs:
    ``z = beta * (logp_c - logp_r) - gamma``,
    ``loss = -(1-eps) * log sigmoid(z) - eps * log sigmoid(-z)``; rewards ``beta * logp``.
    The reference arguments are accepted for the common contract and ignored (may be None).

    Shapes: two (B,) (+ two ignored) -> PreferenceOut of (B,). TRL 1.16:
    ``trl.experimental.cpo.CPOTrainer.cpo_loss`` with ``loss_type="simpo"``, ``simpo_gamma=gamma``,
    ``alpha=0``, ``cpo_alpha=0`` (the CPO NLL term is a separate loss here).
    """
    if not 0.0 <= label_smoothing < 0.5:
        raise ConfigError(f"simpo needs 0 <= label_smoothing < 0.5, got {label_smoothing!r}")
    _check(beta, chosen_logp=chosen_logp, rejected_logp=rejected_logp)
    logits_B = beta * (chosen_logp - rejected_logp - gamma / beta)
    losses_B = -F.logsigmoid(logits_B) * (1 - label_smoothing) - F.logsigmoid(-logits_B) * label_smoothing
    return _out(losses_B, chosen_logp, rejected_logp, beta)
