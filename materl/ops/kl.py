"""Per-token KL estimators from sampled tokens. Pure tensor functions.

Every estimator has one contract::

    kl_B_T = KL_ESTIMATORS.get(name)(logp, ref_logp, *, clamp=..., **hparams)

``logp`` and ``ref_logp`` are log-probs (B,T) of tokens SAMPLED FROM pi; the result estimates
KL(pi || ref) per token (reduce it with ``materl.ops.aggregate``). ``clamp`` clips the result to
[-clamp, clamp] (None: no clip). Notation: d = logp - ref_logp, so ref/pi = exp(-d).

========  ================================  ===========  ======================================
name      value                             unbiased?    verl ``kl_penalty`` name
========  ================================  ===========  ======================================
k1        d                                 yes          kl, k1
k2        d^2 / 2                           no (low var) mse, k2
k3        exp(-d) + d - 1, clamp 10         yes, >= 0    low_var_kl, k3
abs       |d|                               no           abs
k3_plus   value of k3, gradient of k2       value yes    k3+, low_var_kl+
truncated min(d, threshold)                 no           (none)
adaptive  d where pi(token) > threshold     no           (none)
========  ================================  ===========  ======================================

Estimators after J. Schulman, "Approximating KL divergence" (2020); TRL GRPOTrainer's per-token KL
is k3 without the clamp. ``kl_penalty`` is the front door, with verl's names as aliases and a
``direction="forward"`` that estimates KL(ref || pi) from the same samples. ``bias_corrected_kl``
is TRL's default (``use_bias_correction_kl=True``): the estimator times the importance ratio
pi/pi_old, with its gradient.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from materl.errors import ConfigError, ShapeError
from materl.ops._masked import check_same_shape
from materl.registry import Registry

KL_ESTIMATORS = Registry("kl_estimator")

_LOG_RATIO_BOUND = 20.0  # verl clamps the log-ratio to [-20, 20] before exp
KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3", "k3+": "k3_plus", "low_var_kl+": "k3_plus"}


def _check(logp: Tensor, ref_logp: Tensor) -> None:
    check_same_shape(logp=logp, ref_logp=ref_logp)


def _clip(x: Tensor, clamp: float | None) -> Tensor:
    if clamp is None:
        return x
    if not clamp > 0:
        raise ConfigError(f"clamp must be > 0 or None; got {clamp!r}")
    return x.clamp(-clamp, clamp)


@KL_ESTIMATORS.register("k1")
def k1(logp: Tensor, ref_logp: Tensor, *, clamp: float | None = None) -> Tensor:
    """k1 = logp - ref_logp: unbiased, high variance, can be negative. verl ``kl``/``k1``."""
    _check(logp, ref_logp)
    return _clip(logp - ref_logp, clamp)


@KL_ESTIMATORS.register("k2")
def k2(logp: Tensor, ref_logp: Tensor, *, clamp: float | None = None) -> Tensor:
    """k2 = (logp - ref_logp)^2 / 2: biased, low variance; its gradient (logp - ref) grad logp is
    the on-policy gradient of KL(pi||ref). verl ``mse``/``k2``."""
    _check(logp, ref_logp)
    return _clip(0.5 * (logp - ref_logp).square(), clamp)


@KL_ESTIMATORS.register("k3")
def k3(logp: Tensor, ref_logp: Tensor, *, clamp: float | None = 10.0) -> Tensor:
    """k3 = exp(x) - x - 1, x = clamp(ref_logp - logp, -20, 20): unbiased and >= 0 (Schulman's
    low-variance estimator). verl ``low_var_kl``/``k3``, which clamps the result to [-10, 10]
    (the default here); TRL GRPOTrainer uses it unclamped (``clamp=None``)."""
    _check(logp, ref_logp)
    x = (ref_logp - logp).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    return _clip(torch.exp(x) - x - 1.0, clamp)


@KL_ESTIMATORS.register("abs")
def abs_(logp: Tensor, ref_logp: Tensor, *, clamp: float | None = None) -> Tensor:
    """|logp - ref_logp|. verl ``abs``."""
    _check(logp, ref_logp)
    return _clip((logp - ref_logp).abs(), clamp)


@KL_ESTIMATORS.register("k3_plus")
def k3_plus(logp: Tensor, ref_logp: Tensor, *, clamp: float | None = 10.0) -> Tensor:
    """Straight-through: the VALUE of k3 (clamped as k3) with the GRADIENT of k2.

        out = k2 - sg(k2) + sg(k3)

    k1 and k3 estimate the KL's value without bias but not its gradient; k2's gradient is the right
    one. verl ``kl_penalty(..., "k3+")`` / ``"low_var_kl+"``.
    """
    value = k3(logp, ref_logp, clamp=clamp)
    surrogate = 0.5 * (logp - ref_logp).square()
    return surrogate - surrogate.detach() + value.detach()


@KL_ESTIMATORS.register("truncated")
def truncated(logp: Tensor, ref_logp: Tensor, *, threshold: float = 1.0, clamp: float | None = None) -> Tensor:
    """k1 truncated from above: min(logp - ref_logp, threshold).

    ``(policy_lp - ref_lp).clamp(max=threshold)``, meant to stop a few far-off tokens from
    dominating the penalty. Tokens above
    the threshold get no gradient. Biased (it under-estimates). No verl counterpart.
    """
    _check(logp, ref_logp)
    return _clip((logp - ref_logp).clamp(max=threshold), clamp)


def confidence_mask(logp: Tensor, *, confidence_threshold: float = 0.1) -> Tensor:
    """1.0 where pi(token) = exp(logp) > confidence_threshold, else 0.0 (no gradient)."""
    return (logp.detach().exp() > confidence_threshold).to(logp.dtype)


@KL_ESTIMATORS.register("adaptive")
def adaptive(logp: Tensor, ref_logp: Tensor, *, confidence_threshold: float = 0.1,
             clamp: float | None = None) -> Tensor:
    """Confidence-masked k1: (logp - ref_logp) where pi(token) > confidence_threshold, else 0.

    Only tokens the policy is confident about are pulled toward the reference. To average each
    sequence over the confident tokens only, aggregate with ``mask * confidence_mask(logp)``
    (aggregating with ``mask`` averages over all tokens, counting the others as 0). Biased.
    No verl counterpart.
    """
    _check(logp, ref_logp)
    keep = confidence_mask(logp, confidence_threshold=confidence_threshold)
    return _clip((logp - ref_logp) * keep, clamp)


# ----------------------------------------------------------------------------- front door
class _EstimatorDefault:
    """The ``clamp`` of a caller that did not choose one: the estimator's own default."""

    def __repr__(self) -> str:
        return "ESTIMATOR_DEFAULT"


ESTIMATOR_DEFAULT = _EstimatorDefault()


def _default_clamp(fn) -> float | None:
    param = inspect.signature(fn).parameters.get("clamp")
    if param is None or param.kind is not inspect.Parameter.KEYWORD_ONLY:
        raise ConfigError(f"kl estimator {fn.__name__!r} must take a keyword-only 'clamp' argument")
    return None if param.default is inspect.Parameter.empty else param.default


def _forward(name: str, fn, logp: Tensor, ref_logp: Tensor, clamp: float | None, hparams: dict) -> Tensor:
    """KL(ref || pi) from samples of pi, importance-weighted by r = ref/pi (see kl_penalty)."""
    log_r = (ref_logp - logp).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    r = torch.exp(log_r)
    if name == "k3_plus":
        value = _clip(r * k3(ref_logp, logp, clamp=None), clamp)
        surrogate = -r.detach() * logp  # its gradient -r grad logp: on-policy grad of KL(ref||pi)
        return surrogate - surrogate.detach() + value.detach()
    return _clip(r * fn(ref_logp, logp, clamp=None, **hparams), clamp)


def kl_penalty(logp: Tensor, ref_logp: Tensor, *, estimator: str = "k3", direction: str = "reverse",
               clamp: float | None = ESTIMATOR_DEFAULT, **hparams) -> Tensor:  # type: ignore[assignment]
    """Per-token KL estimate (B,T) between pi and ref from tokens sampled from pi.

    ``estimator``: a KL_ESTIMATORS name or a verl alias (kl, mse, low_var_kl, k3+, low_var_kl+).
    ``clamp``: omitted = the estimator's own default (10 for k3/k3_plus, else none); None = no clamp.
    ``hparams``: the estimator's own keywords (e.g. ``threshold`` for truncated).

    direction="reverse": KL(pi || ref), the usual RLHF penalty -> ``estimator(logp, ref_logp)``.
    With k1/k2/k3/abs/k3_plus it equals verl ``kl_penalty`` in value and gradient.

    direction="forward": KL(ref || pi) = E_ref[log ref - log pi], estimated from samples of pi by
    importance weighting with r = ref/pi = exp(clamp(ref_logp - logp, -20, 20)): swap the roles
    and weight, value = r * estimator(ref_logp, logp), then clamp. So forward k1 = r log r
    (unbiased), forward k3 = r log r - r + 1 (unbiased, >= 0), forward k2 = r (log r)^2 / 2.
    Gradients flow through the formula, except forward k3_plus: the value of forward k3 with the
    gradient of the surrogate -sg(r) logp, i.e. -r grad logp, whose expectation under pi is the
    gradient of KL(ref || pi). For ``adaptive`` the swap makes the mask the reference's
    confidence. No verl counterpart. materl follows the usual convention: forward =
    KL(target || model) with ref as the target (some code calls KL(pi || ref) "forward").
    """
    name = KL_ALIASES.get(estimator, estimator)
    fn = KL_ESTIMATORS.get(name)
    if direction not in ("reverse", "forward"):
        raise ConfigError(f"direction must be 'reverse' (KL(pi||ref)) or 'forward' (KL(ref||pi)); got {direction!r}")
    if logp.shape != ref_logp.shape:
        raise ShapeError(f"shapes must match: logp{list(logp.shape)}, ref_logp{list(ref_logp.shape)}")
    if direction == "reverse":
        if clamp is ESTIMATOR_DEFAULT:
            return fn(logp, ref_logp, **hparams)
        return fn(logp, ref_logp, clamp=clamp, **hparams)
    clamp = _default_clamp(fn) if clamp is ESTIMATOR_DEFAULT else clamp
    return _forward(name, fn, logp, ref_logp, clamp, hparams)


def bias_corrected_kl(logp: Tensor, ref_logp: Tensor, old_logp: Tensor, *, estimator: str = "k3",
                      clamp: float | None = ESTIMATOR_DEFAULT, **hparams) -> Tensor:  # type: ignore[assignment]
    """The per-token KL estimate times the importance ratio r = pi / pi_old, with its gradient::

        r   = exp(clamp(logp - old_logp, -20, 20))
        out = r * kl_penalty(logp, ref_logp, estimator=estimator, clamp=clamp)
        d out / d logp = r * (d kl / d logp + kl)          (inside the [-20, 20] bound)

    The tokens were sampled from pi_old, so E_old[r kl] = E_pi[kl]: the penalty and its gradient
    estimate the reverse KL of the policy being optimised, not of pi_old (DeepSeek-V3.2,
    arXiv:2512.02556). The ratio moves the gradient even where its value is 1. TRL 1.16
    GRPOTrainer ``use_bias_correction_kl=True`` (its default) with the unclamped k3:
    ``bias_corrected_kl(logp, ref, old, estimator="k3", clamp=None)`` equals TRL's
    ``per_token_kl * coef_1`` in value and gradient. Deliberate differences: the log-ratio is
    clamped to [-20, 20] before exp (verl's bound; TRL does not clamp), a ``clamp`` on the
    estimator applies before the ratio, and the ratio is always per token (TRL with
    ``importance_sampling_level="sequence"`` broadcasts the sequence ratio, for which the
    estimate is no longer unbiased). ``old_logp`` is a constant (no gradient flows to it).
    """
    check_same_shape(logp=logp, ref_logp=ref_logp, old_logp=old_logp)
    kl_B_T = kl_penalty(logp, ref_logp, estimator=estimator, clamp=clamp, **hparams)
    ratio = torch.exp((logp - old_logp.detach()).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))
    return ratio * kl_B_T
