"""Loss aggregation: a per-token loss (B,T) and its mask -> one scalar. Pure tensor functions.

Every mode has one contract::

    scalar = LOSS_AGG.get(name)(loss_B_T, mask_B_T, *, denom=None, norm=None)

``denom`` replaces the normaliser computed from this call's mask: the token count for
``token_mean``, the count of sequences with at least one token for the ``seq_*`` modes, 1 for
``token_sum``. Give every micro-batch the full batch's ``agg_denominator(name, mask)`` and the
micro-batch aggregates SUM to the full-batch aggregate, so gradient accumulation (sum of
micro-batch gradients) equals one full-batch step. ``norm`` is the constant of
``seq_mean_token_sum_norm`` only.

Tokens off the mask never contribute, even if their loss is inf or NaN; an empty mask gives 0.
Counterpart: verl ``core_algos.agg_loss`` (``token-mean``, ``seq-mean-token-sum``,
``seq-mean-token-mean``, ``seq-mean-token-sum-norm``; ``batch_num_tokens``/``global_batch_size``
are materl's ``denom``, ``loss_scale_factor`` is ``norm``; verl's ``dp_size`` factor is the
caller's business). ``token_sum`` is verl's ``token-sum`` (verl 0.9.1).
"""

from __future__ import annotations

import torch
from torch import Tensor

from materl.errors import ConfigError, ShapeError
from materl.ops._masked import check_same_shape
from materl.registry import Registry

LOSS_AGG = Registry("loss_agg")

Denom = Tensor | float | int | None


def _prep(loss_B_T: Tensor, mask_B_T: Tensor, name: str, norm: float | None) -> tuple[Tensor, Tensor]:
    """Check shapes, refuse a stray ``norm``, and return (loss with off-mask entries zeroed, mask)."""
    check_same_shape(loss=loss_B_T, mask=mask_B_T)
    if loss_B_T.dim() != 2:
        raise ShapeError(f"{name} takes (B,T) loss and mask; got loss{list(loss_B_T.shape)}")
    if norm is not None and name != "seq_mean_token_sum_norm":
        raise ConfigError(f"norm={norm!r} applies only to seq_mean_token_sum_norm, not {name}")
    m = mask_B_T.to(loss_B_T.dtype)
    return torch.where(m != 0, loss_B_T, torch.zeros_like(loss_B_T)) * m, m


def _divide(total: Tensor, denom: Denom) -> Tensor:
    """total / denom, and 0 (with a zero gradient, never NaN) when denom is 0."""
    d = torch.as_tensor(denom, dtype=total.dtype, device=total.device)
    if (d < 0).any():
        raise ConfigError(f"denom must be >= 0; got {d.item()!r}")
    safe = torch.where(d > 0, d, torch.ones_like(d))
    return torch.where(d > 0, total / safe, torch.zeros_like(total))


def _seqs(m: Tensor) -> Tensor:
    """Number of rows with at least one token (verl: fully masked sequences are excluded)."""
    return (m.sum(-1) > 0).to(m.dtype).sum()


@LOSS_AGG.register("token_mean")
def token_mean(loss_B_T: Tensor, mask_B_T: Tensor, *, denom: Denom = None, norm: float | None = None) -> Tensor:
    """sum_{i,t} m l / N,  N = sum m (or ``denom``: the global token count).

    DAPO's token-level loss (arXiv:2503.14476). verl ``token-mean``; TRL ``loss_type="dapo"``.
    """
    x, m = _prep(loss_B_T, mask_B_T, "token_mean", norm)
    return _divide(x.sum(), m.sum() if denom is None else denom)


@LOSS_AGG.register("token_sum")
def token_sum(loss_B_T: Tensor, mask_B_T: Tensor, *, denom: Denom = None, norm: float | None = None) -> Tensor:
    """sum_{i,t} m l  (divided by ``denom`` if given). verl 0.9.1 ``token-sum``."""
    x, _ = _prep(loss_B_T, mask_B_T, "token_sum", norm)
    return x.sum() if denom is None else _divide(x.sum(), denom)


@LOSS_AGG.register("seq_mean_token_sum")
def seq_mean_token_sum(loss_B_T: Tensor, mask_B_T: Tensor, *, denom: Denom = None,
                       norm: float | None = None) -> Tensor:
    """(1/S) sum_i sum_t m l,  S = rows with a token (or ``denom``: the global count).

    verl ``seq-mean-token-sum``. Older verl divided by all B rows, empty ones included.
    """
    x, m = _prep(loss_B_T, mask_B_T, "seq_mean_token_sum", norm)
    return _divide(x.sum(), _seqs(m) if denom is None else denom)


@LOSS_AGG.register("seq_mean_token_mean")
def seq_mean_token_mean(loss_B_T: Tensor, mask_B_T: Tensor, *, denom: Denom = None,
                        norm: float | None = None) -> Tensor:
    """(1/S) sum_i (sum_t m l / sum_t m),  S = rows with a token (or ``denom``).

    The original GRPO loss (arXiv:2402.03300); TRL ``loss_type="grpo"``. verl
    ``seq-mean-token-mean`` (which divides by sum_t m + 1e-8; materl divides exactly and gives an
    empty row 0).
    """
    x, m = _prep(loss_B_T, mask_B_T, "seq_mean_token_mean", norm)
    count = m.sum(-1)
    per_seq = x.sum(-1) / torch.where(count > 0, count, torch.ones_like(count))
    return _divide(per_seq.sum(), _seqs(m) if denom is None else denom)


@LOSS_AGG.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(loss_B_T: Tensor, mask_B_T: Tensor, *, denom: Denom = None,
                            norm: float | None = None) -> Tensor:
    """(1/S) sum_i sum_t m l / norm,  norm = T = mask.shape[-1] unless given; S as above.

    Dr.GRPO's constant normaliser (arXiv:2503.20783, MAX_TOKENS): the per-sequence token sum is
    divided by a constant, not by the sequence's length. Set ``norm`` to the generation budget so
    it stays constant when batches are padded to different T. verl ``seq-mean-token-sum-norm``
    (``loss_scale_factor``); older verl divided the batch's token sum by T without the 1/S.
    TRL ``loss_type="dr_grpo"`` uses B * max_completion_length.
    """
    x, m = _prep(loss_B_T, mask_B_T, "seq_mean_token_sum_norm", norm)
    norm = m.shape[-1] if norm is None else norm
    if not norm > 0:
        raise ConfigError(f"norm must be > 0; got {norm!r}")
    return _divide(x.sum(), _seqs(m) if denom is None else denom) / norm


def agg_denominator(name: str, mask_B_T: Tensor) -> Tensor:
    """The normaliser ``name`` computes from ``mask_B_T``: pass the FULL batch's value as ``denom``
    to every micro-batch so that the micro-batch aggregates sum to the full-batch aggregate."""
    LOSS_AGG.get(name)  # unknown names fail here, with the valid choices
    m = mask_B_T.to(torch.get_default_dtype()) if not mask_B_T.is_floating_point() else mask_B_T
    if name == "token_mean":
        return m.sum()
    if name == "token_sum":
        return torch.ones((), dtype=m.dtype, device=m.device)
    if name.startswith("seq_mean_"):
        return _seqs(m)
    raise ConfigError(f"no built-in denominator for loss_agg {name!r}; pass denom yourself")


def aggregate(loss_B_T: Tensor, mask_B_T: Tensor, *, mode: str = "token_mean", denom: Denom = None,
              norm: float | None = None) -> Tensor:
    """``LOSS_AGG.get(mode)(loss_B_T, mask_B_T, denom=denom, norm=norm)`` (verl: ``agg_loss``)."""
    return LOSS_AGG.get(mode)(loss_B_T, mask_B_T, denom=denom, norm=norm)
