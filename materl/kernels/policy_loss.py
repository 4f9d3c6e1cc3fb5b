"""Fused policy loss: loss x aggregation x KL term, metrics and d loss / d logp, one sweep each.

    loss, metrics = fused_policy_loss(logp, old_logp, advantages, mask, ref_logp=ref,
                                      loss="ppo_clip", agg="token_mean", kl="k3", kl_coef=0.04)
    loss.backward()                       # logp.grad, from one more sweep

computes, in ONE pass over the (B,T) inputs (``kernels/policy_loss.mojo``)::

    L = agg(w * l(logp, old_logp, A), mask) + kl_coef * agg(kl(logp, ref_logp), mask)

``w`` is an optional per-token weight (``weights=``, constant: an off-policy correction's, see
``materl.ops.offpolicy``; 1 when omitted). ``kl`` is clamped to [-kl_clamp, kl_clamp] (omitted:
the estimator's own default, e.g. 10 for k3; None: no clamp) and with
``kl_bias_correction=True`` multiplied by r = exp(clamp(logp - old_logp, -20, 20)) with its
gradient (``materl.ops.kl.bias_corrected_kl``: TRL's default ``use_bias_correction_kl``).

with ``l`` one of ``materl.ops.losses`` ``ppo_clip`` (eps_low/eps_high, dual clip), ``gspo``
(sequence-level ratio), ``cispo``; ``agg`` one of ``materl.ops.aggregate`` (``token_mean``,
``token_sum``, ``seq_mean_token_sum``, ``seq_mean_token_mean``, ``seq_mean_token_sum_norm``; with
``denom`` / ``norm``); ``kl`` one of ``materl.ops.kl`` (k1, k2, k3, abs, k3_plus, or verl's aliases
kl, mse, low_var_kl; each with its default clamp unless ``kl_clamp`` is given). The value and gradient
equal the op path (loss op, then LOSS_AGG, then kl_penalty; torch's conventions at ties and clamp
edges) to float64 rounding; that path is also the fallback (``impl="torch"``, no Mojo, CUDA or
half-precision tensors). No intermediate (B,T) tensor is allocated besides the gradient (pass
the mask in logp's dtype, else one converted copy is made). Gradients flow to ``logp`` only
(old_logp, advantages, ref_logp and weights are constants, as in verl and TRL).

``metrics`` are Python floats, the masked means of the loss's per-token stats as the learner's
torch path reports them: ``ppo_kl`` (mean of old_logp - logp, verl ``ppo_kl``), ``clipfrac``
(verl ``pg_clipfrac``), ``clipfrac_lower`` (ppo_clip: the dual clip bound was taken) and, when
``ref_logp`` is given, ``kl`` (masked mean of the per-token KL term, bias-corrected if asked).
The weights scale the loss only; the stats are those of the unweighted loss.
Hyperparameters left as None take the loss's own default (``inspect.signature`` of the op):
ppo_clip eps_low=0.2, eps_high=eps_low; gspo 3e-4/4e-4; cispo eps_high=0.28, one-sided.
verl counterpart: ``compute_policy_loss_{vanilla,gspo,cispo}`` + ``agg_loss`` + ``kl_penalty``
(see those ops' docstrings for the deliberate differences, e.g. dual clip off by default).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from materl.errors import ConfigError, KernelError, ShapeError, UnknownNameError
from materl.kernels import loader
from materl.ops.kl import ESTIMATOR_DEFAULT, KL_ALIASES, KL_ESTIMATORS, bias_corrected_kl, kl_penalty
from materl.ops.losses import POLICY_LOSSES

LOSSES = {"ppo_clip": 0, "gspo": 1, "cispo": 2}
AGGS = {"token_mean": 0, "token_sum": 1, "seq_mean_token_sum": 2, "seq_mean_token_mean": 3,
        "seq_mean_token_sum_norm": 4}
KLS = {"k1": 1, "k2": 2, "k3": 3, "abs": 4, "k3_plus": 5}
HPARAMS = {"ppo_clip": ("eps_low", "eps_high", "dual_clip"), "gspo": ("eps_low", "eps_high"),
           "cispo": ("eps_low", "eps_high")}
# node params the kernel runs for any loss: the aggregation's norm, the KL term's settings, and an
# off-policy correction (its weights are computed before the kernel and passed in)
KERNEL_PARAMS = ("kl_coef", "norm", "kl_clamp", "kl_bias_correction", "correction")
_OUT = ("loss", "pg", "kl_agg", "clipfrac", "clipfrac_lower", "ppo_kl", "ratio", "kl", "tokens", "seqs", "denom")
_FWD_SIG = "i" * 6 + "i" * 9 + "fffffff" + "i"  # 6 pointers, 9 ints, 7 floats, out
_BWD_SIG = "i" * 6 + "i" * 9 + "fffffff" + "ffi"


def _pick(kind: str, name: str, table: dict) -> int:
    if name not in table:
        raise UnknownNameError(f"fused policy loss: unknown {kind} {name!r}; valid: {', '.join(table)}")
    return table[name]


@functools.lru_cache(maxsize=None)
def _signature_defaults(loss: str) -> tuple[tuple[str, Any], ...]:
    params = inspect.signature(POLICY_LOSSES.get(loss)).parameters.values()
    return tuple((p.name, p.default) for p in params if p.kind is p.KEYWORD_ONLY)


def loss_defaults(loss: str) -> dict[str, Any]:
    """The keyword defaults of ``POLICY_LOSSES[loss]`` (the single source of truth)."""
    return dict(_signature_defaults(loss))


@functools.lru_cache(maxsize=None)
def kl_default_clamp(kl: str) -> float | None:
    param = inspect.signature(KL_ESTIMATORS.get(kl)).parameters["clamp"]
    return None if param.default is inspect.Parameter.empty else param.default


def _hyper(loss: str, eps_low, eps_high, dual_clip) -> tuple[float, float, float, int]:
    """(eps_low, eps_high, dual (0 = off), one_sided) with the loss's defaults, checked as the op does."""
    d = loss_defaults(loss)
    if dual_clip is not None and loss != "ppo_clip":
        raise ConfigError(f"dual_clip applies to ppo_clip only, not {loss!r}; got dual_clip={dual_clip!r}")
    eps_low = d.get("eps_low") if eps_low is None else eps_low
    eps_high = d.get("eps_high") if eps_high is None else eps_high
    one_sided = loss == "cispo" and eps_low is None
    if loss == "ppo_clip" and eps_high is None:
        eps_high = eps_low
    for name, v, upper in (("eps_low", eps_low, 1.0), ("eps_high", eps_high, None)):
        if v is not None and (not v >= 0 or (upper is not None and v >= upper)):
            raise ConfigError(f"{name} must be >= 0{' and < 1' if upper else ''}; got {v!r}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ConfigError(f"dual_clip must be > 1 (a lower bound on the ratio for A < 0); got {dual_clip!r}")
    return float(eps_low or 0.0), float(eps_high), float(dual_clip or 0.0), int(one_sided)


def _kl_clamp(kl: str, kl_clamp) -> float:
    """The clamp the kernel applies (0 = none): the estimator's default unless ``kl_clamp`` is given."""
    clamp = kl_default_clamp(kl) if kl_clamp is ESTIMATOR_DEFAULT else kl_clamp
    if clamp is not None and not (isinstance(clamp, (int, float)) and clamp > 0):
        raise ConfigError(f"kl_clamp must be > 0 or None; got {clamp!r}")
    return float(clamp or 0.0)


def _denom_norm(agg: str, denom, norm, T: int) -> tuple[float, float]:
    if norm is not None and agg != "seq_mean_token_sum_norm":
        raise ConfigError(f"norm={norm!r} applies only to seq_mean_token_sum_norm, not {agg}")
    norm = float(T if norm is None else norm)
    if agg == "seq_mean_token_sum_norm" and not norm > 0:
        raise ConfigError(f"norm must be > 0; got {norm!r}")
    d = -1.0 if denom is None else float(denom)
    if denom is not None and not d >= 0:
        raise ConfigError(f"denom must be >= 0; got {d!r}")
    return d, norm


class _Fused(torch.autograd.Function):
    """Forward: one kernel call -> (loss, results vector). Backward: one kernel call -> grad logp."""

    @staticmethod
    def forward(ctx, logp, old_logp, adv, mask, ref_logp, weights, kernel, head, floats):
        suffix = "f64" if logp.dtype == torch.float64 else "f32"
        ptrs = [t.data_ptr() if t is not None else 0 for t in (logp, old_logp, ref_logp, adv, mask, weights)]
        out = torch.empty(len(_OUT), dtype=torch.float64)
        kernel.call(f"policy_loss_fwd_{suffix}", _FWD_SIG, *ptrs, *head, *floats, out.data_ptr())
        ctx.kernel, ctx.head, ctx.floats, ctx.suffix, ctx.D = kernel, head, floats, suffix, float(out[-1])
        ctx.save_for_backward(logp, old_logp, adv, mask, ref_logp, weights)
        ctx.mark_non_differentiable(out)
        return logp.new_tensor(float(out[0])), out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_out):
        logp, old_logp, adv, mask, ref_logp, weights = ctx.saved_tensors
        grad = torch.empty_like(logp)
        ptrs = [t.data_ptr() if t is not None else 0 for t in (logp, old_logp, ref_logp, adv, mask, weights)]
        ctx.kernel.call(f"policy_loss_bwd_{ctx.suffix}", _BWD_SIG, *ptrs, *ctx.head, *ctx.floats,
                        float(grad_loss), ctx.D, grad.data_ptr())
        return grad, None, None, None, None, None, None, None, None


def _check_shapes(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, ref_logp: Tensor | None,
                  weights: Tensor | None = None) -> None:
    if logp.dim() != 2:
        raise ShapeError(f"fused policy loss takes (B,T) tensors; got logp{list(logp.shape)}")
    optional = {"ref_logp": ref_logp, "weights": weights}
    others = {"old_logp": old_logp, "mask": mask} | {k: t for k, t in optional.items() if t is not None}
    for name, t in others.items():
        if t.shape != logp.shape:
            raise ShapeError(f"shapes must match: logp{list(logp.shape)}, {name}{list(t.shape)}")
    if advantages.shape != logp.shape and tuple(advantages.shape) != (logp.shape[0],):
        raise ShapeError(f"advantages must be (B,T) or (B,); got {list(advantages.shape)} for logp{list(logp.shape)}")


def _mojo_ok(impl: str, *tensors: Tensor | None) -> loader.Kernel | None:
    if impl not in ("auto", "mojo", "torch"):
        raise ConfigError(f"impl must be one of auto, mojo, torch; got {impl!r}")
    if impl == "torch":
        return None
    ts = [t for t in tensors if t is not None]
    why = ""
    if any(t.device.type != "cpu" for t in ts):
        why = f"the Mojo kernel runs on CPU tensors, got {ts[0].device}"
    elif ts[0].dtype not in (torch.float32, torch.float64):
        why = f"the Mojo kernel takes float32/float64 log-probs, got {ts[0].dtype}"
    if why:
        if impl == "mojo":
            raise KernelError(f"fused policy loss: {why}")
        return None
    kernel, reason = loader.load_or_reason("policy_loss")
    if kernel is None and impl == "mojo":
        raise KernelError(f"fused policy loss: Mojo kernel unavailable: {reason}")
    return kernel


def fused_policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                      ref_logp: Tensor | None = None, weights: Tensor | None = None, loss: str = "ppo_clip",
                      agg: str = "token_mean", kl: str = "k3", kl_coef: float = 0.0,
                      kl_clamp: float | None = ESTIMATOR_DEFAULT, kl_bias_correction: bool = False,
                      eps_low: float | None = None, eps_high: float | None = None, dual_clip: float | None = None,
                      denom=None, norm: float | None = None, impl: str = "auto") -> tuple[Tensor, dict[str, float]]:
    """Scalar loss (0-dim, logp's dtype, differentiable w.r.t. ``logp``) and metrics; see the module
    docstring. Shapes: logp, old_logp, mask, ref_logp, weights (B,T); advantages (B,T) or (B,)."""
    _check_shapes(logp, old_logp, advantages, mask, ref_logp, weights)
    loss_id, agg_id = _pick("loss", loss, LOSSES), _pick("aggregation", agg, AGGS)
    kl_name = KL_ALIASES.get(kl, kl)
    kl_id = _pick("kl estimator", kl_name, KLS) if ref_logp is not None else 0
    lo, hi, dual, one_sided = _hyper(loss, eps_low, eps_high, dual_clip)
    d, nrm = _denom_norm(agg, denom, norm, logp.shape[1])
    clamp = _kl_clamp(kl_name, kl_clamp) if ref_logp is not None else 0.0
    kernel = _mojo_ok(impl, logp, old_logp, advantages, mask, ref_logp, weights)
    if kernel is None:
        hp = {"eps_low": eps_low, "eps_high": eps_high, "dual_clip": dual_clip}
        hp = {k: v for k, v in hp.items() if v is not None}
        return policy_loss_torch(logp, old_logp, advantages, mask, ref_logp=ref_logp, weights=weights, loss=loss,
                                 agg=agg, kl=kl_name, kl_coef=kl_coef, kl_clamp=kl_clamp,
                                 kl_bias_correction=kl_bias_correction, denom=denom, norm=norm, **hp)
    dt = logp.dtype
    logp_c = logp.contiguous()
    old_c, mask_c = old_logp.to(dt).contiguous(), mask.to(dt).contiguous()
    ref_c = ref_logp.to(dt).contiguous() if ref_logp is not None else None
    w_c = weights.detach().to(dt).contiguous() if weights is not None else None
    adv_c = advantages.to(dt).contiguous()
    B, T = logp.shape
    strides = (T, 1) if adv_c.dim() == 2 else (1, 0)
    head = (B, T, *strides, loss_id, agg_id, kl_id, one_sided, int(bool(kl_bias_correction)))
    floats = (lo, hi, dual, clamp, float(kl_coef), d, nrm)
    value, out = _Fused.apply(logp_c, old_c, adv_c, mask_c, ref_c, w_c, kernel, head, floats)
    return value, _metrics(loss, dict(zip(_OUT, out.tolist())), ref_logp is not None)


def _metrics(loss: str, out: dict[str, float], has_ref: bool) -> dict[str, float]:
    keys = ["ppo_kl", "clipfrac"] + (["clipfrac_lower"] if loss == "ppo_clip" else [])
    metrics = {k: out[k] for k in keys}
    if has_ref:
        metrics["kl"] = out["kl"]
    return metrics


def policy_loss_torch(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                      ref_logp: Tensor | None = None, weights: Tensor | None = None, loss: str = "ppo_clip",
                      agg: str = "token_mean", kl: str = "k3", kl_coef: float = 0.0,
                      kl_clamp: float | None = ESTIMATOR_DEFAULT, kl_bias_correction: bool = False, denom=None,
                      norm: float | None = None, **hparams) -> tuple[Tensor, dict[str, float]]:
    """The op path the kernel reproduces: ``POLICY_LOSSES[loss]`` (times ``weights``) ->
    ``LOSS_AGG[agg]`` (+ kl_coef x aggregated ``kl_penalty`` or ``bias_corrected_kl``), metrics as
    masked means. Any registered loss/aggregation works here."""
    from materl.ops.aggregate import LOSS_AGG

    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    per_token, stats = POLICY_LOSSES.get(loss)(logp, old_logp, advantages, mask, **hparams)
    if weights is not None:
        per_token = per_token * weights.detach()
    reduce = LOSS_AGG.get(agg)
    value = reduce(per_token, mask, denom=denom, norm=norm)
    m = mask.to(torch.float64)
    n = m.sum().clamp(min=1)
    metrics = {k: float((v.double() * m).sum() / n) for k, v in stats.items() if k != "ratio"}
    if ref_logp is not None:
        if kl_bias_correction:
            kl_B_T = bias_corrected_kl(logp, ref_logp, old_logp, estimator=kl, clamp=kl_clamp)
        else:
            kl_B_T = kl_penalty(logp, ref_logp, estimator=kl, clamp=kl_clamp)
        metrics["kl"] = float((kl_B_T.detach().double() * m).sum() / n)
        if kl_coef:
            value = value + kl_coef * reduce(kl_B_T, mask, denom=denom, norm=norm)
    return value, metrics


# ----------------------------------------------------------------------------- compiler hooks


def supports(op: str, params: dict) -> tuple[bool, str]:
    """Whether the fused kernel can run a ``policy_loss`` node with these params (and why not)."""
    if op != "policy_loss":
        return False, f"no fused kernel for op {op!r}"
    p = dict(params)
    loss, agg, kl = p.pop("loss", "ppo_clip"), p.pop("agg", "token_mean"), p.pop("kl", None)
    for key in KERNEL_PARAMS:  # handled by the kernel whatever their value (checked where they are set)
        p.pop(key, None)
    if loss not in LOSSES:
        return False, f"loss {loss!r} has no fused kernel (fused: {', '.join(LOSSES)})"
    if agg not in AGGS:
        return False, f"aggregation {agg!r} has no fused kernel (fused: {', '.join(AGGS)})"
    if kl is not None and KL_ALIASES.get(kl, kl) not in KLS:
        return False, f"kl estimator {kl!r} has no fused kernel (fused: {', '.join(KLS)})"
    extra = sorted(k for k, v in p.items() if k not in HPARAMS[loss] and v is not None)
    if extra:
        return False, f"{loss} hyperparameters {extra} are not fused (fused: {', '.join(HPARAMS[loss])})"
    kernel, why = loader.load_or_reason("policy_loss")
    return (True, "") if kernel is not None else (False, f"Mojo kernel unavailable: {why}")


def learner_policy_loss(node, logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor,
                        ref_logp: Tensor | None, *, denom: float | None,
                        weights: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """``materl.compiler.kinds.losses.torch_policy_loss``'s contract, run by the fused kernel."""
    params = dict(node.params)
    params.pop("correction", None)  # its weights come in as ``weights``
    kw = {k: params.pop(k) for k in ("kl_clamp", "kl_bias_correction") if k in params}  # None is a value here
    p = {k: v for k, v in params.items() if v is not None}
    kw |= {k: p.pop(k) for k in ("loss", "agg", "kl_coef", "norm") if k in p}
    kw["kl"] = p.pop("kl", "k3")
    return fused_policy_loss(logp, old_logp, adv, mask, ref_logp=ref_logp, weights=weights, denom=denom, **kw, **p)
