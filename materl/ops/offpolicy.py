"""Off-policy corrections and the engine-vs-learner log-prob mismatch. Pure tensor functions.

Three policies take part when the tokens were not sampled by the policy being trained (AReaL's
decoupled PPO, arXiv:2505.24298; verl's rollout correction in its decoupled mode):

    mu      behaviour: the engine that sampled the tokens (its log-probs are the rollout's
            sampling log-probs), maybe some weight versions old, always with its own numerics
            (a KV cache, other kernels, another precision)
    prox    proximal: the trainable policy recomputed by the learner, no gradient, under the
            weights at the start of the step
    theta   the policy being optimised

A corrected policy loss anchors its ratio (PPO's trust region) on prox instead of mu, and weights
each token's loss by a stop-gradient function of rho = prox / mu::

    l_t = w_t * loss_t(logp_theta, logp_prox, A)          (a KL term, if any, is not weighted)

Every correction has one contract::

    w_B_T, stats = CORRECTIONS.get(name)(prox_logp, behaviour_logp, mask, **hparams)

``w_B_T`` is 0 off the mask and carries no gradient; ``stats`` maps names to detached per-token
(B,T) tensors that the caller averages with the mask (``is_weight``: w itself; ``is_truncated``:
the cap was taken; ``is_rejected``: the token's weight was zeroed by a bound).

==========  =========================================  ==========================================
name        w                                          counterparts
==========  =========================================  ==========================================
tis         min(rho, cap)                              TIS (Yao et al. 2025); verl ``rollout_is``
                                                       token/sequence + ``rollout_is_threshold``;
                                                       TRL ``vllm_importance_sampling_mode``
                                                       ``token_truncate``/``sequence_truncate``
mis         rho if lower <= rho <= upper, else 0       MIS (Liu, Li et al. 2025, "When speed kills
                                                       stability"); TRL ``token_mask``/
                                                       ``sequence_mask``; verl ``rollout_is`` with
                                                       ``rollout_rs`` (same level, IS threshold
                                                       >= upper)
decoupled   rho if rho <= cap, else 0; cap=None: rho   AReaL decoupled PPO (eq. 5 of the paper;
                                                       ``rejection_sampling`` action="mask",
                                                       metric="ratio", default upper 5)
==========  =========================================  ==========================================

``level`` says what rho is: ``token`` rho_t = exp(prox_t - mu_t); ``sequence`` the product over
the row's trained tokens, exp(sum_t m (prox - mu)), on every token of the row (verl and TRL
``sequence``); ``geometric`` its geometric mean, exp(sum_t m (prox - mu) / sum_t m) (verl RS
``geometric``; AReaL ``level="sequence"`` with the ratio metric). The log of rho is clamped to
[-20, 20] before exp (verl's SAFETY_BOUND; TRL and AReaL do not clamp: no difference for any
finite cap below e^20).

``decoupled`` is ``mis`` with no lower bound under AReaL's name and default; it is kept as its own
name because that is the algorithm AReaL users know, and with ``cap=None`` it is the paper's
uncapped objective. Deliberate difference from verl (shared with AReaL): a rejected token stays in
the aggregation's denominator (its loss is 0), so rejecting tokens never scales up the others;
verl removes rejected tokens from ``response_mask`` and so from the token count.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from materl.errors import ConfigError
from materl.ops._masked import check_same_shape
from materl.registry import Registry

CORRECTIONS = Registry("off_policy_correction")

LEVELS = ("token", "sequence", "geometric")
_LOG_RATIO_BOUND = 20.0  # verl rollout_corr_helper.SAFETY_BOUND


def log_importance_ratio(prox_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, *, level: str = "token") -> Tensor:
    """log rho (B,T) at ``level`` (token, sequence or geometric; see the module docstring), before
    the [-20, 20] clamp. Sequence levels put the row's value on every token of the row."""
    check_same_shape(prox_logp=prox_logp, behaviour_logp=behaviour_logp, mask=mask)
    if level not in LEVELS:
        raise ConfigError(f"level must be one of {', '.join(LEVELS)}; got {level!r}")
    m = mask.to(prox_logp.dtype)
    log_rho = torch.where(m != 0, prox_logp - behaviour_logp, torch.zeros_like(prox_logp)).detach()
    if level == "token":
        return log_rho
    per_row = (log_rho * m).sum(-1, keepdim=True)
    if level == "geometric":
        per_row = per_row / m.sum(-1, keepdim=True).clamp(min=1)
    return per_row.expand_as(log_rho)


def _rho(prox_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, level: str) -> tuple[Tensor, Tensor]:
    log_rho = log_importance_ratio(prox_logp, behaviour_logp, mask, level=level)
    return torch.exp(log_rho.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)), mask.to(prox_logp.dtype)


def _positive(name: str, value: float | None, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if value is None or not value > 0:
        raise ConfigError(f"{name} must be > 0{' or None' if optional else ''}; got {value!r}")


@CORRECTIONS.register("tis")
def tis(prox_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, *, cap: float = 2.0, level: str = "token"):
    """Truncated importance sampling: w = min(rho, cap), rho = prox / mu at ``level``.

    Every token keeps a bounded weight (the bias of truncation for a bounded variance). Default cap
    2.0 is verl's ``rollout_is_threshold``. verl: ``compute_rollout_correction_weights`` (token,
    sequence; no batch normalisation here); TRL 1.16: ``*_truncate`` with
    ``vllm_importance_sampling_clip_min=None``. Stats: ``is_weight``, ``is_truncated`` (rho > cap).
    """
    _positive("cap", cap)
    rho, m = _rho(prox_logp, behaviour_logp, mask, level)
    w = rho.clamp(max=cap) * m
    return w, {"is_weight": w, "is_truncated": (rho > cap).to(rho.dtype) * m}


@CORRECTIONS.register("mis")
def mis(prox_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, *, upper: float = 2.0,
        lower: float | None = None, level: str = "token"):
    """Masked importance sampling: w = rho where lower <= rho <= upper, else 0 (the token, or the
    whole row at a sequence level, leaves the loss).

    ``lower=None`` means 1/upper (verl's ``rollout_rs_threshold_lower`` default); ``lower=0`` bounds
    one side only. verl: ``compute_rollout_rejection_mask`` (token, sequence, geometric; the
    bounds inclusive) times ``compute_rollout_correction_weights`` of the same level with a
    threshold >= upper; TRL 1.16: ``token_mask``/``sequence_mask``. Stats: ``is_weight``,
    ``is_rejected``.
    """
    _positive("upper", upper)
    lower = 1.0 / upper if lower is None else lower
    if not 0 <= lower <= upper:
        raise ConfigError(f"lower must be in [0, upper={upper!r}]; got {lower!r}")
    rho, m = _rho(prox_logp, behaviour_logp, mask, level)
    keep = (rho >= lower) & (rho <= upper)
    w = torch.where(keep, rho, torch.zeros_like(rho)) * m
    return w, {"is_weight": w, "is_rejected": (~keep).to(rho.dtype) * m}


@CORRECTIONS.register("decoupled")
def decoupled(prox_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, *, cap: float | None = 5.0,
              level: str = "token"):
    """Decoupled PPO's behaviour weight (AReaL, arXiv:2505.24298 eq. 5): w = rho where rho <= cap,
    else 0; ``cap=None``: w = rho (the paper's objective, uncapped).

    With the ratio anchored on prox this is the whole of decoupled PPO: the clip bounds
    pi_theta / pi_prox (the policy's own step) and w corrects for mu having sampled the tokens.
    AReaL: ``ppo_actor_loss_fn`` with ``rejection_sampling`` (action="mask", metric="ratio",
    upper=cap, lower=None; the older ``behav_imp_weight_cap``). AReaL ``level="sequence"`` is
    materl's ``level="geometric"``. Stats: ``is_weight``, ``is_rejected``.
    """
    _positive("cap", cap, optional=True)
    rho, m = _rho(prox_logp, behaviour_logp, mask, level)
    keep = rho <= cap if cap is not None else torch.ones_like(rho, dtype=torch.bool)
    w = torch.where(keep, rho, torch.zeros_like(rho)) * m
    return w, {"is_weight": w, "is_rejected": (~keep).to(rho.dtype) * m}


def correction_params(method: str, hparams: dict) -> dict:
    """``hparams`` checked against ``CORRECTIONS[method]``'s keywords and completed with its
    defaults (``mis``'s lower resolved to 1/upper), so what is recorded is what runs."""
    fn = CORRECTIONS.get(method)
    keywords = {p.name: p.default for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY}
    unknown = sorted(set(hparams) - set(keywords))
    if unknown:
        raise ConfigError(f"off-policy correction {method!r} takes {', '.join(keywords)}; got {', '.join(unknown)}")
    out = {**keywords, **hparams}
    if method == "mis" and out["lower"] is None and out["upper"] is not None and out["upper"] > 0:
        out["lower"] = 1.0 / out["upper"]
    out = {k: float(v) if isinstance(v, int) and not isinstance(v, bool) else v for k, v in out.items()}
    probe = torch.zeros(1, 1, dtype=torch.float64)
    fn(probe, probe, torch.ones_like(probe), **out)  # the op's own checks, at recipe time
    return out


def logprob_mismatch(learner_logp: Tensor, sampling_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the learner's log-probs of the sampled tokens are from the engine's, over the
    tokens where ``mask`` is set, in float64::

        mean_abs, max_abs   mean and max of |learner - sampling|
        kl                  k3 estimate of KL(mu || pi_learner) from mu's samples:
                            mean of r - 1 - log r, r = pi_learner / mu  (>= 0, low variance)
        kl_k1               k1 estimate of the same KL: mean of log mu - log pi_learner

    verl ``compute_offpolicy_metrics`` reports the same two KL estimates as ``k3_kl`` and ``kl``
    (no clamp on the log-ratio, as here). An empty mask gives zeros.
    """
    check_same_shape(learner_logp=learner_logp, sampling_logp=sampling_logp, mask=mask)
    keep = mask.detach() != 0
    x = (learner_logp.detach().double() - sampling_logp.detach().double())[keep]
    if x.numel() == 0:
        return {"mean_abs": 0.0, "max_abs": 0.0, "kl": 0.0, "kl_k1": 0.0}
    a = x.abs()
    return {"mean_abs": float(a.mean()), "max_abs": float(a.max()),
            "kl": float((torch.exp(x) - 1.0 - x).mean()), "kl_k1": -float(x.mean())}
