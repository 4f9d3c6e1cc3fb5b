"""Policy losses, the clipped value loss and chunked entropy. Pure tensor functions.

Every policy loss has one contract::

    loss_B_T, stats = POLICY_LOSSES.get(name)(logp, old_logp, advantages, mask, **hparams)

``loss_B_T`` is the PER-TOKEN loss to minimise (0 where ``mask`` is 0); reducing it to a scalar is
a separate op (``materl.ops.aggregate.LOSS_AGG``), so any loss combines with any aggregation.
``stats`` maps names to detached per-token float tensors (B,T) that the caller averages with the
mask: ``masked_mean(stats["clipfrac"], mask)`` is verl's ``pg_clipfrac``. Every loss reports
``ratio`` (pi/pi_old) and ``ppo_kl`` (log pi_old - log pi, verl's ``ppo_kl``).

verl (``verl.trainer.ppo.core_algos.compute_policy_loss_*``) computes the same per-token matrix and
then calls ``agg_loss``; materl's loss followed by the LOSS_AGG of the same name gives verl's numbers
and gradients. verl's gspo and sapo default to ``seq-mean-token-mean`` (a default argument; its
callers pass the configured ``loss_agg_mode``): use that aggregation to match the default. Shapes: B rows, T tokens, V vocabulary; all (B,T) inputs must have the same shape.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from materl.errors import ConfigError, ShapeError
from materl.ops._masked import check_same_shape
from materl.registry import Registry

POLICY_LOSSES = Registry("policy_loss")

_LOG_RATIO_BOUND = 20.0  # verl clamps log(pi/pi_old) to [-20, 20] before exp


# ----------------------------------------------------------------------------- helpers
def _check(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    check_same_shape(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    if logp.dim() != 2:
        raise ShapeError(f"policy losses take (B,T) tensors; got logp{list(logp.shape)}")
    return mask.to(logp.dtype)


def _check_eps(name: str, value: float | None, *, upper: float | None = None) -> None:
    if value is None:
        return
    if not value >= 0 or (upper is not None and value >= upper):
        limit = f" and < {upper}" if upper is not None else ""
        raise ConfigError(f"{name} must be >= 0{limit}; got {value!r}")


def _ratio(logp: Tensor, old_logp: Tensor) -> Tensor:
    return torch.exp((logp - old_logp).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))


def _finish(loss: Tensor, mask: Tensor, logp: Tensor, old_logp: Tensor, ratio: Tensor, **extra: Tensor):
    """Zero the loss off the mask and build the detached per-token stats dict."""
    stats = {"ratio": ratio.detach(), "ppo_kl": (old_logp - logp).detach()}
    stats.update({k: v.detach().to(logp.dtype) for k, v in extra.items()})
    return torch.where(mask != 0, loss, torch.zeros_like(loss)), stats


def _masked_mean_nograd(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=torch.finfo(x.dtype).tiny)


def _top_k_mask(score: Tensor, candidates: Tensor, k: int) -> Tensor:
    """Boolean mask of the ``k`` highest ``score`` entries among ``candidates``; ties go to the
    lower flat index (a stable sort), so the choice is a function of the inputs alone."""
    flat = torch.where(candidates, score, torch.full_like(score, -torch.inf)).reshape(-1)
    order = torch.sort(flat, descending=True, stable=True).indices[: min(k, int(candidates.sum()))]
    chosen = torch.zeros_like(flat, dtype=torch.bool)
    chosen[order] = True
    return chosen.reshape(score.shape)


# ----------------------------------------------------------------------------- losses
@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
             eps_low: float = 0.2, eps_high: float | None = None, dual_clip: float | None = None):
    """PPO clipped surrogate (Schulman et al. 2017), with DAPO clip-higher and dual-clip.

        r = exp(clamp(logp - old_logp, -20, 20))
        l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
        dual_clip c (Ye et al. 2019, arXiv:1912.09729), only where A < 0:  l = min(l, -A c)

    ``eps_high=None`` means ``eps_low``; a larger ``eps_high`` is DAPO's clip-higher
    (arXiv:2503.14476). Stats: ``clipfrac`` (the clip branch was taken, -A clip(r) > -A r) and
    ``clipfrac_lower`` (the dual clip bound was taken). verl: ``compute_policy_loss_vanilla``
    (clip_ratio_low/high, clip_ratio_c). Deliberate difference: verl always applies the dual clip
    (clip_ratio_c=3.0); here it is off unless ``dual_clip`` is given. TRL GRPOTrainer ``epsilon``.
    """
    m = _check(logp, old_logp, advantages, mask)
    eps_high = eps_low if eps_high is None else eps_high
    _check_eps("eps_low", eps_low, upper=1.0)
    _check_eps("eps_high", eps_high)
    if dual_clip is not None and not dual_clip > 1.0:
        raise ConfigError(f"dual_clip must be > 1 (a lower bound on the ratio for A < 0); got {dual_clip!r}")
    ratio = _ratio(logp, old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    lower = torch.zeros_like(loss, dtype=torch.bool)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        lower = (loss > bound) & (advantages < 0)
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    return _finish(loss, m, logp, old_logp, ratio, clipfrac=clipped > unclipped, clipfrac_lower=lower)


@POLICY_LOSSES.register("gspo")
def gspo(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
         eps_low: float = 3e-4, eps_high: float = 4e-4):
    """GSPO: sequence-level geometric-mean ratio (Zheng et al. 2025, arXiv:2507.18071).

        log s_i   = sum_t mask (logp - old_logp) / max(|y_i|, 1)          (no gradient)
        log s_i,t = min(sg[log s_i] + logp - sg[logp], 10)                  (GSPO-token)
        l         = max(-A s_i,t, -A clip(s_i,t, 1 - eps_low, 1 + eps_high))

    The stop-gradient trick gives every token the value of the sequence ratio and the gradient
    s_i * grad logp. Defaults are the paper's ranges (3e-4, 4e-4). verl: ``compute_policy_loss_gspo``
    (which forces ``seq-mean-token-mean``: aggregate with ``seq_mean_token_mean`` to match).
    """
    m = _check(logp, old_logp, advantages, mask)
    _check_eps("eps_low", eps_low, upper=1.0)
    _check_eps("eps_high", eps_high)
    log_ratio = torch.where(m != 0, logp - old_logp, torch.zeros_like(logp))
    seq_log_ratio = (log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1)
    log_s = (logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp(max=10.0)
    s = torch.exp(log_s)
    unclipped = -advantages * s
    clipped = -advantages * s.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    return _finish(loss, m, logp, old_logp, s, clipfrac=clipped > unclipped)


@POLICY_LOSSES.register("cispo")
def cispo(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
          eps_high: float = 0.28, eps_low: float | None = None):
    """CISPO: clipped, stop-gradient IS weight times log-prob (MiniMax-M1, arXiv:2506.13585).

        r = exp(clamp(logp - old_logp, -20, 20))
        w = sg(min(r, 1 + eps_high))                       one-sided (default, MiniMax-M1)
        w = sg(clip(r, 1 - eps_low, 1 + eps_high))         two-sided (``eps_low`` given; verl)
        l = -w A logp

    Unlike PPO no token's gradient is dropped; only its weight is capped. MiniMax-M1 sets no lower
    bound ("setting eps_low^IS to a large value") and tunes only eps_high; the paper gives no
    value, so the default 0.28 is DAPO's clip-higher (Trinity-RFT uses the same). verl
    ``compute_policy_loss_cispo`` is two-sided with clip_ratio_low/high (0.2 each by default): pass
    ``eps_low=0.2, eps_high=0.2`` to match it. Stats: ``clipfrac`` (w != r, verl's pg_clipfrac).
    """
    m = _check(logp, old_logp, advantages, mask)
    _check_eps("eps_high", eps_high)
    _check_eps("eps_low", eps_low, upper=1.0)
    ratio = _ratio(logp, old_logp)
    weight = ratio.clamp(max=1.0 + eps_high) if eps_low is None else ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = -weight.detach() * advantages * logp
    return _finish(loss, m, logp, old_logp, ratio, clipfrac=weight != ratio)


@POLICY_LOSSES.register("reinforce")
def reinforce(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
              is_level: str = "token", is_threshold: float | None = 2.0):
    """REINFORCE with a truncated, stop-gradient importance weight (Williams 1992).

        w = sg(min(pi/pi_old, is_threshold))    is_level="token":    per token
                                                is_level="sequence": prod over the row's tokens
                                                is_level="none":     w = 1 (plain -A logp;
                                                                     is_threshold ignored)
        l = -A w logp

    ``old_logp`` is the behaviour (rollout) policy. verl: ``compute_policy_loss_reinforce`` with
    rollout-correction weights as in its bypass mode (``rollout_is`` token/sequence,
    ``rollout_is_threshold=2.0``; log-ratios clamped to [-20, 20]). verl's default aggregation for
    it is ``seq-mean-token-sum``. Stats: ``clipfrac`` (the weight was truncated).
    """
    m = _check(logp, old_logp, advantages, mask)
    if is_level not in ("token", "sequence", "none"):
        raise ConfigError(f"is_level must be one of token, sequence, none; got {is_level!r}")
    if is_threshold is not None and not is_threshold > 0:
        raise ConfigError(f"is_threshold must be > 0 or None; got {is_threshold!r}")
    log_ratio = torch.where(m != 0, logp - old_logp, torch.zeros_like(logp)).detach()
    if is_level == "sequence":
        log_ratio = (log_ratio * m).sum(-1, keepdim=True).expand_as(logp)
    raw = torch.exp(log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))
    if is_level == "none":
        raw = weight = torch.ones_like(raw)
    else:
        weight = raw if is_threshold is None else raw.clamp(max=is_threshold)
    loss = -advantages * weight * logp
    return _finish(loss, m, logp, old_logp, _ratio(logp, old_logp), clipfrac=weight != raw)


@POLICY_LOSSES.register("gpg")
def gpg(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor):
    """GPG: plain policy gradient, l = -A logp (Chu et al. 2025, arXiv:2504.02546).

    No ratio, no clipping; the GPG paper's batch rescaling lives in its advantage estimator.
    verl: ``compute_policy_loss_gpg``.
    """
    m = _check(logp, old_logp, advantages, mask)
    return _finish(-logp * advantages, m, logp, old_logp, _ratio(logp, old_logp))


@POLICY_LOSSES.register("sapo")
def sapo(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
         tau_pos: float = 1.0, tau_neg: float = 1.05):
    """SAPO: soft adaptive policy optimisation, a sigmoid gate instead of a hard clip
    (Qwen, arXiv:2511.20347).

        r   = exp(clamp(logp - old_logp, -20, 20))
        tau = tau_pos where A > 0 else tau_neg
        l   = -A sigmoid(tau (r - 1)) 4 / tau

    At r = 1 the gate is 2/tau with slope 1, so on-policy the gradient equals -A grad logp; far
    off-policy it decays smoothly instead of vanishing at a clip edge. verl:
    ``compute_policy_loss_sapo`` (ActorConfig tau_pos=1.0, tau_neg=1.05; forces
    ``seq-mean-token-mean``). Stats: ``gate``.
    """
    m = _check(logp, old_logp, advantages, mask)
    for name, tau in (("tau_pos", tau_pos), ("tau_neg", tau_neg)):
        if not tau > 0:
            raise ConfigError(f"{name} must be > 0; got {tau!r}")
    ratio = _ratio(logp, old_logp)
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return _finish(-gate * advantages, m, logp, old_logp, ratio, gate=gate)


@POLICY_LOSSES.register("clip_cov")
def clip_cov(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
             eps_low: float = 0.2, eps_high: float | None = None, cov_ratio: float = 2e-4,
             cov_lb: float = 1.0, cov_ub: float = 5.0):
    """Clip-Cov: PPO-clip that also detaches a few high-covariance tokens (Cui et al. 2025,
    "The Entropy Mechanism of RL for Reasoning LMs", arXiv:2505.22617).

        cov_t = (A_t - mean A)(logp_t - mean logp)        means over masked tokens
        candidates: masked, not clipped by PPO, cov_lb < cov_t < cov_ub
        n = max(floor(cov_ratio * n_tokens), 1) candidates get l = 0 (no value, no gradient)
        others: l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)),   r = exp(logp - old_logp)

    verl: ``compute_policy_loss_clip_cov`` (clip_cov_ratio, clip_cov_lb, clip_cov_ub). Deliberate
    difference: verl picks the n candidates at random (``torch.randperm``); materl picks the n with
    the largest covariance (ties to the lower index), so the loss is a function of its inputs. When
    there are at most n candidates both select all of them. The count uses this call's tokens, so
    micro-batches select per micro-batch, as in verl. Stats: ``covfrac`` and ``clipfrac`` (both the
    detached tokens; verl reports them as pg_clipfrac).
    """
    m = _check(logp, old_logp, advantages, mask)
    eps_high = eps_low if eps_high is None else eps_high
    _check_eps("eps_low", eps_low, upper=1.0)
    _check_eps("eps_high", eps_high)
    if not cov_ratio > 0:
        raise ConfigError(f"cov_ratio must be > 0; got {cov_ratio!r}")
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    with torch.no_grad():
        valid = m > 0
        cov = (advantages - _masked_mean_nograd(advantages, m)) * (logp - _masked_mean_nograd(logp, m))
        candidates = valid & ~(clipped > unclipped) & (cov > cov_lb) & (cov < cov_ub)
        n_detach = max(int(cov_ratio * m.sum().item()), 1)
        detached = _top_k_mask(cov, candidates, n_detach)
    loss = torch.maximum(unclipped, clipped) * (~detached).to(logp.dtype)
    return _finish(loss, m, logp, old_logp, ratio, covfrac=detached, clipfrac=detached)


@POLICY_LOSSES.register("kl_cov")
def kl_cov(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
           cov_ratio: float = 2e-4, kl_coef: float = 1.0):
    """KL-Cov: unclipped surrogate plus a |log r| penalty on the top-covariance tokens
    (Cui et al. 2025, arXiv:2505.22617).

        r = exp(logp - old_logp);   cov_t = (A_t - mean A)(logp_t - mean logp) over masked tokens
        the k = max(floor(cov_ratio * n_tokens), 1) largest cov_t:  l = -A r + kl_coef |logp - old_logp|
        every other token:                                          l = -A r

    verl: ``compute_policy_loss_kl_cov`` (kl_cov_ratio, ppo_kl_coef); the means are unweighted over
    tokens with mask > 0. ``torch.topk`` ties are replaced by a stable sort (ties to the lower
    index) so the choice is reproducible. Stats: ``covfrac`` (penalised tokens).
    """
    m = _check(logp, old_logp, advantages, mask)
    if not cov_ratio > 0:
        raise ConfigError(f"cov_ratio must be > 0; got {cov_ratio!r}")
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    surrogate = -advantages * ratio
    with torch.no_grad():
        valid = m > 0
        n_valid = int(valid.sum())
        cov = torch.zeros_like(logp)
        if n_valid:
            adv_mean = advantages[valid].mean()
            logp_mean = logp[valid].mean()
            cov = (advantages - adv_mean) * (logp - logp_mean)
        penalised = _top_k_mask(cov, valid, max(1, int(n_valid * cov_ratio)) if n_valid else 0)
    loss = torch.where(penalised, surrogate + kl_coef * log_ratio.abs(), surrogate)
    return _finish(loss, m, logp, old_logp, ratio, covfrac=penalised)


# ----------------------------------------------------------------------------- value, entropy
def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *,
               clip_range: float | None = 0.2) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss, per token (PPO; verl ``compute_value_loss``, TRL PPOTrainer).

        v_clip = clamp(v, v_old - c, v_old + c)
        l      = 0.5 max((v - R)^2, (v_clip - R)^2)          ``clip_range=None``: 0.5 (v - R)^2

    All inputs (B,T). Returns ``(loss_B_T, {"vf_clipfrac": ...})``; ``vf_clipfrac`` is 1 where the
    clipped branch is strictly larger. Aggregate with LOSS_AGG (verl: 0.5 * agg_loss(max(...))).
    """
    check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    if clip_range is not None and not clip_range >= 0:
        raise ConfigError(f"clip_range must be >= 0 or None; got {clip_range!r}")
    unclipped = (values - returns) ** 2
    if clip_range is None:
        loss, frac = 0.5 * unclipped, torch.zeros_like(values)
    else:
        v_clip = torch.max(torch.min(values, old_values + clip_range), old_values - clip_range)
        clipped = (v_clip - returns) ** 2
        loss, frac = 0.5 * torch.max(unclipped, clipped), (clipped > unclipped).to(values.dtype)
    loss = torch.where(mask != 0, loss, torch.zeros_like(loss))
    return loss, {"vf_clipfrac": frac.detach()}


def _entropy_rows(z: Tensor) -> Tensor:
    lse = torch.logsumexp(z, dim=-1)
    p = torch.exp(z - lse.unsqueeze(-1))
    return lse - (p * z).sum(-1)


def _as_rows(x: Tensor) -> Tensor:
    """(B,T,...) -> (1,B*T,...) when contiguous (chunks may cross row boundaries), else as is
    (e.g. ``logits[:, :-1]``: chunks stay within each row, and nothing is copied)."""
    return x.view(1, x.shape[0] * x.shape[1], *x.shape[2:]) if x.is_contiguous() else x


def _row_blocks(logits_B_T_V: Tensor, chunk: int):
    """Yield ``(b, slice)`` index pairs into ``_as_rows(logits)`` of at most ``chunk`` rows."""
    rows = _as_rows(logits_B_T_V)
    for b in range(rows.shape[0]):
        for s in range(0, rows.shape[1], chunk):
            yield b, slice(s, s + chunk)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _ChunkedEntropy(torch.autograd.Function):
    """Saves only the logits (already alive); backward recomputes each chunk's softmax.

    dH/dz = -p (z - sum_v p_v z_v), p = softmax(z).
    """

    @staticmethod
    def forward(ctx, logits: Tensor, chunk: int) -> Tensor:
        ctx.save_for_backward(logits)
        ctx.chunk = chunk
        rows = _as_rows(logits)
        out = logits.new_empty(rows.shape[:2])
        for b, sl in _row_blocks(logits, chunk):
            z = rows[b, sl]
            out[b, sl] = _entropy_rows(z.to(_compute_dtype(z.dtype))).to(out.dtype)
        return out.view(logits.shape[:2])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_B_T: Tensor):
        (logits,) = ctx.saved_tensors
        rows = _as_rows(logits)
        grad = torch.empty_like(rows)
        g = grad_B_T.reshape(rows.shape[:2])
        for b, sl in _row_blocks(logits, ctx.chunk):
            z = rows[b, sl].to(_compute_dtype(rows.dtype))
            p = torch.softmax(z, dim=-1)
            centred = z - (p * z).sum(-1, keepdim=True)
            grad[b, sl] = (-p * centred * g[b, sl].unsqueeze(-1).to(z.dtype)).to(grad.dtype)
        return grad.view(logits.shape), None


def entropy_from_logits(logits_B_T_V: Tensor, *, chunk_size: int = 1024) -> Tensor:
    """Per-token entropy of softmax(logits), H = logsumexp(z) - sum_v softmax(z)_v z_v, as (B,T).

    Rows are processed ``chunk_size`` at a time, in the forward and (recomputing the softmax) in
    the backward, so no full second (B,T,V) tensor is ever held besides the gradient itself; the
    value and gradient equal the naive formula (verl ``verl_F.entropy_from_logits``, which
    materialises the whole softmax). Half-precision logits are computed in float32 and returned
    in their own dtype. Accepts (B,T,V) or (N,V) (returns (N,)). Logits must be finite. First
    derivatives only (no double backward).
    """
    if chunk_size < 1:
        raise ConfigError(f"chunk_size must be >= 1; got {chunk_size!r}")
    if logits_B_T_V.dim() not in (2, 3):
        raise ShapeError(f"entropy_from_logits takes (B,T,V) or (N,V) logits; got {list(logits_B_T_V.shape)}")
    squeeze = logits_B_T_V.dim() == 2
    logits = logits_B_T_V.unsqueeze(0) if squeeze else logits_B_T_V
    out = _ChunkedEntropy.apply(logits, chunk_size)
    return out.squeeze(0) if squeeze else out
