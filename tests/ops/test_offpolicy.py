"""Off-policy corrections (materl/ops/offpolicy.py): hand-computed weights and gradients, equality
with transcriptions of verl's rollout correction, AReaL's decoupled PPO loss and TRL's vLLM
importance sampling in float64, and the engine-vs-learner mismatch metrics."""

import math

import pytest
import torch

from materl.errors import ConfigError, ShapeError, UnknownNameError
from materl.ops.aggregate import LOSS_AGG
from materl.ops.losses import POLICY_LOSSES
from materl.ops.offpolicy import CORRECTIONS, correction_params, log_importance_ratio, logprob_mismatch

F64 = torch.float64
L = math.log


def t(*rows):
    return torch.tensor(rows, dtype=F64)


# -- hand-computed weights ----------------------------------------------------------------------
# one row, four tokens, the last untrained; rho = prox / mu per token: 3, 0.4, 1.5, (6)
PROX = t([L(0.6), L(0.24), L(0.6), L(0.6)])
MU = t([L(0.2), L(0.6), L(0.4), L(0.1)])
MASK = t([1.0, 1.0, 1.0, 0.0])


def weights(name, **kw):
    w, stats = CORRECTIONS.get(name)(PROX, MU, MASK, **kw)
    return w[0].tolist(), {k: v[0].tolist() for k, v in stats.items()}


def test_tis_truncates_at_the_cap():
    w, stats = weights("tis", cap=2.0)
    assert w == pytest.approx([2.0, 0.4, 1.5, 0.0])  # min(3, 2); the untrained token has no weight
    assert stats["is_truncated"] == [1.0, 0.0, 0.0, 0.0]
    assert stats["is_weight"] == pytest.approx(w)


def test_mis_keeps_the_ratio_inside_the_bounds_and_rejects_outside():
    w, stats = weights("mis", upper=2.0)  # lower defaults to 1/upper = 0.5: 3 and 0.4 are out
    assert w == pytest.approx([0.0, 0.0, 1.5, 0.0])
    assert stats["is_rejected"] == [1.0, 1.0, 0.0, 0.0]
    w, _ = weights("mis", upper=2.0, lower=0.3)
    assert w == pytest.approx([0.0, 0.4, 1.5, 0.0])
    w, _ = weights("mis", upper=3.0 + 1e-9, lower=0.4 - 1e-9)  # the bounds are inclusive
    assert w == pytest.approx([3.0, 0.4, 1.5, 0.0])


def test_decoupled_masks_above_the_cap_only():
    w, stats = weights("decoupled", cap=2.0)  # AReaL: no lower bound
    assert w == pytest.approx([0.0, 0.4, 1.5, 0.0])
    assert stats["is_rejected"] == [1.0, 0.0, 0.0, 0.0]
    w, _ = weights("decoupled", cap=None)  # the paper's uncapped weight
    assert w == pytest.approx([3.0, 0.4, 1.5, 0.0])


def test_sequence_and_geometric_levels():
    # trained tokens' log rho: ln 3 + ln 0.4 + ln 1.5 = ln 1.8 (the untrained token does not count)
    seq = log_importance_ratio(PROX, MU, MASK, level="sequence")
    assert torch.exp(seq)[0].tolist() == pytest.approx([1.8] * 4)
    geo = log_importance_ratio(PROX, MU, MASK, level="geometric")
    assert torch.exp(geo)[0].tolist() == pytest.approx([1.8 ** (1 / 3)] * 4)
    w, _ = weights("tis", cap=1.5, level="sequence")
    assert w == pytest.approx([1.5, 1.5, 1.5, 0.0])  # min(1.8, 1.5) on every trained token
    w, _ = weights("mis", upper=1.5, level="sequence")
    assert w == [0.0] * 4  # the whole row leaves the loss
    w, _ = weights("mis", upper=1.5, level="geometric")  # 1.8^(1/3) = 1.216 is inside [1/1.5, 1.5]
    assert w == pytest.approx([1.8 ** (1 / 3)] * 3 + [0.0])


def test_a_row_without_trained_tokens_and_the_log_ratio_bound():
    prox, mu, mask = t([0.0, 0.0], [-1.0, -1.0]), t([0.0, 0.0], [-40.0, -1.0]), t([0, 0], [1, 1])
    w, _ = CORRECTIONS.get("decoupled")(prox, mu, mask, cap=None, level="sequence")
    assert w[0].tolist() == [0.0, 0.0]
    assert w[1].tolist() == pytest.approx([math.exp(20.0)] * 2)  # log rho = 39, clamped to 20 (verl)


def test_weights_carry_no_gradient_and_scale_the_loss_gradient():
    # ppo_clip at r = 1 (logp = prox), A = 1: l = -r, dl/dlogp = -1 per token
    logp = PROX.clone().requires_grad_()
    prox, mu = PROX.clone().requires_grad_(), MU.clone().requires_grad_()
    w, _ = CORRECTIONS.get("tis")(prox, mu, MASK, cap=2.0)
    assert not w.requires_grad
    per_token, _ = POLICY_LOSSES.get("ppo_clip")(logp, PROX, torch.ones_like(logp), MASK)
    loss = LOSS_AGG.get("token_sum")(per_token * w, MASK)
    loss.backward()
    assert loss.item() == pytest.approx(-(2.0 + 0.4 + 1.5))
    assert logp.grad[0].tolist() == pytest.approx([-2.0, -0.4, -1.5, 0.0])


def test_correction_params_fill_defaults_and_check():
    assert correction_params("tis", {}) == {"cap": 2.0, "level": "token"}
    assert correction_params("mis", {"upper": 4}) == {"upper": 4.0, "lower": 0.25, "level": "token"}
    assert correction_params("decoupled", {"cap": None}) == {"cap": None, "level": "token"}
    with pytest.raises(ConfigError, match="'tis' takes cap, level; got lower"):
        correction_params("tis", {"lower": 0.5})
    with pytest.raises(ConfigError, match="cap must be > 0; got -1"):
        correction_params("tis", {"cap": -1})
    with pytest.raises(ConfigError, match=r"lower must be in \[0, upper=2.0\]; got 3"):
        correction_params("mis", {"upper": 2.0, "lower": 3})
    with pytest.raises(ConfigError, match="level must be one of token, sequence, geometric; got 'row'"):
        correction_params("mis", {"level": "row"})
    with pytest.raises(UnknownNameError, match="tis"):
        correction_params("is", {})
    with pytest.raises(ShapeError):
        CORRECTIONS.get("tis")(PROX, MU[:, :2], MASK)


# -- verl (volcengine/verl @ 0b4e2a8, 2025-12-14) ------------------------------------------------


def verl_masked_sum(x, mask, axis):
    return (x * mask).sum(axis)


def verl_masked_mean(x, mask, axis=None):
    return (x * mask).sum() / mask.sum() if axis is None else (x * mask).sum(axis) / mask.sum(axis)


def verl_is_weights(log_ratio, response_mask, rollout_is, rollout_is_threshold):
    """verl/trainer/ppo/rollout_corr_helper.py compute_rollout_correction_weights (no batch
    normalisation), transcribed: clamp the (summed) log-ratio to +-20, exp, mask, truncate, detach."""
    if rollout_is == "token":
        weights = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    else:  # "sequence"
        log_ratio_sum = verl_masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        weights = torch.exp(torch.clamp(log_ratio_sum, min=-20.0, max=20.0)).expand_as(log_ratio)
    weights = weights * response_mask
    return weights.clamp(max=rollout_is_threshold).detach()


def verl_rs_mask(log_ratio, response_mask, rollout_rs, threshold, threshold_lower=None):
    """rollout_corr_helper.py compute_rollout_rejection_mask at 0b4e2a8 (token, sequence,
    geometric), transcribed: returns the modified response mask."""
    lower = threshold_lower if threshold_lower is not None else 1.0 / threshold
    if rollout_rs == "token":
        w = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    elif rollout_rs == "sequence":
        s = verl_masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        w = torch.exp(torch.clamp(s, min=-20.0, max=20.0)).expand_as(log_ratio)
    else:  # geometric
        s = verl_masked_mean(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        w = torch.exp(torch.clamp(s, min=-20.0, max=20.0)).expand_as(log_ratio)
    mask = ((w >= lower) & (w <= threshold)).float().to(log_ratio.dtype)
    return response_mask * mask


def verl_vanilla_pg_losses(old_log_prob, log_prob, advantages, clip_ratio, clip_ratio_c):
    """core_algos.py compute_policy_loss_vanilla's per-token matrix (before rollout_is_weights)."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio, 1 + clip_ratio)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    return torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)


def inputs(seed=0, B=5, T=7, spread=0.6):
    g = torch.Generator().manual_seed(seed)
    mu = -torch.rand(B, T, generator=g, dtype=F64) * 3
    prox = mu + torch.randn(B, T, generator=g, dtype=F64) * spread
    logp = prox + torch.randn(B, T, generator=g, dtype=F64) * 0.2
    adv = torch.randn(B, T, generator=g, dtype=F64)
    lengths = torch.tensor([T, 4, 1, T - 2, 3])[:B]
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(F64)
    return logp.requires_grad_(), prox, mu, adv, mask


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("cap", [1.2, 2.0])
def test_tis_equals_verl_rollout_is_value_and_gradient(level, cap):
    logp, prox, mu, adv, mask = inputs(seed=int(cap * 10), spread=0.4)
    expected = verl_is_weights(prox - mu, mask, level, cap)
    w, _ = CORRECTIONS.get("tis")(prox, mu, mask, cap=cap, level=level)
    torch.testing.assert_close(w, expected, rtol=0, atol=1e-15)
    assert ((expected == cap) & (mask > 0)).any() and ((expected < cap) & (mask > 0)).any()  # both branches hit
    # the corrected loss: verl's pg_losses * rollout_is_weights, token-mean, vs materl's ppo_clip * w
    logp2 = logp.detach().clone().requires_grad_()
    verl = (verl_vanilla_pg_losses(prox, logp2, adv, 0.2, 1e9) * expected * mask).sum() / mask.sum()
    per_token, _ = POLICY_LOSSES.get("ppo_clip")(logp, prox, adv, mask)
    ours = LOSS_AGG.get("token_mean")(per_token * w, mask)
    (g_verl,), (g_ours,) = torch.autograd.grad(verl, logp2), torch.autograd.grad(ours, logp)
    assert abs(ours.item() - verl.item()) < 1e-14
    torch.testing.assert_close(g_ours, g_verl, rtol=0, atol=1e-15)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("upper,lower", [(2.0, None), (1.5, 0.8)])
def test_mis_equals_verl_rollout_is_times_rejection_mask(level, upper, lower):
    logp, prox, mu, adv, mask = inputs(seed=4, spread={"token": 0.5, "sequence": 0.25, "geometric": 0.7}[level])
    kept = verl_rs_mask(prox - mu, mask, level, upper, lower)
    # MIS is verl's IS weights (a threshold >= upper truncates nothing inside the bounds) on the kept tokens
    is_level = "token" if level == "token" else "sequence"
    if level == "geometric":  # verl's IS has no geometric level: rho is the geometric mean, untruncated
        rho = torch.exp(verl_masked_mean(prox - mu, mask, axis=-1)).unsqueeze(-1).expand_as(mask) * mask
    else:
        rho = verl_is_weights(prox - mu, mask, is_level, upper)
    expected = rho * kept
    w, stats = CORRECTIONS.get("mis")(prox, mu, mask, upper=upper, lower=lower, level=level)
    torch.testing.assert_close(w, expected, rtol=0, atol=1e-15)
    torch.testing.assert_close(stats["is_rejected"], mask - kept, rtol=0, atol=0)
    assert (kept < mask).any() and kept.any()  # some rejected, some kept
    # deliberate difference: verl divides by the kept tokens (its response_mask is modified);
    # materl keeps the trained-token count. With verl's denominator the losses agree.
    verl = (verl_vanilla_pg_losses(prox, logp, adv, 0.2, 1e9) * expected * kept).sum() / kept.sum()
    per_token, _ = POLICY_LOSSES.get("ppo_clip")(logp, prox, adv, mask)
    ours = LOSS_AGG.get("token_mean")(per_token * w, mask, denom=kept.sum())
    g_verl, g_ours = torch.autograd.grad(verl, logp)[0], torch.autograd.grad(ours, logp)[0]
    assert abs(ours.item() - verl.item()) < 1e-14
    torch.testing.assert_close(g_ours, g_verl, rtol=0, atol=1e-15)


# -- AReaL (inclusionAI/AReaL @ 4aef98d, 2026-05-21) ---------------------------------------------


def areal_ppo_actor_loss(logprobs, proximal_logprobs, old_logprobs, advantages, eps_clip, loss_mask, upper):
    """areal/utils/functional/functional.py ppo_actor_loss_fn with rejection_sampling(level="token",
    action="mask", metric="ratio", upper=upper, lower=None), 2-D padded inputs, transcribed."""
    loss_mask_count = loss_mask.count_nonzero() or 1
    log_ratio = proximal_logprobs.detach() - old_logprobs.detach()
    log_ratio = torch.where(torch.isfinite(log_ratio), log_ratio, 0.0)
    metric = torch.exp(log_ratio)
    behave_imp_weight = torch.exp(log_ratio)
    in_bounds = metric <= upper
    updated_mask = (loss_mask.bool() & in_bounds).to(loss_mask.dtype)
    behave_imp_weight = torch.where(updated_mask.bool(), behave_imp_weight, 0.0)
    loss_mask = updated_mask
    ratio = torch.where(loss_mask.bool(), torch.exp(logprobs - proximal_logprobs), 0)
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip)
    pg_loss = torch.max(-advantages * ratio, -advantages * clipped_ratio)
    pg_loss = pg_loss * behave_imp_weight
    return torch.where(loss_mask.bool(), pg_loss, 0).sum() / loss_mask_count


@pytest.mark.parametrize("cap", [1.3, 5.0])
def test_decoupled_equals_areal_decoupled_ppo_value_and_gradient(cap):
    logp, prox, mu, adv, mask = inputs(seed=7, spread=0.5)
    logp2 = logp.detach().clone().requires_grad_()
    areal = areal_ppo_actor_loss(logp2, prox, mu, adv, 0.2, mask, cap)
    w, _ = CORRECTIONS.get("decoupled")(prox, mu, mask, cap=cap)
    per_token, _ = POLICY_LOSSES.get("ppo_clip")(logp, prox, adv, mask)
    ours = LOSS_AGG.get("token_mean")(per_token * w, mask)  # AReaL keeps the original token count too
    assert abs(ours.item() - areal.item()) < 1e-14
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(areal, logp2)[0],
                               rtol=0, atol=1e-15)


# -- TRL 1.16 GRPOTrainer._generate_and_score_completions (vLLM importance sampling) -------------


def trl_is_ratio(old_per_token_logps, sampling_per_token_logps, mask, mode, clip_min, clip_max):
    """trl/trainer/grpo_trainer.py (1.16.0) lines 2660-2705, transcribed: the ratio that multiplies
    per_token_loss in _compute_loss (B,T) or (B,1)."""
    per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    if mode in ["sequence_mask", "sequence_truncate"]:
        logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    else:
        logps_diff = per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        min_val = clip_min if clip_min is not None else -math.inf
        max_val = clip_max if clip_max is not None else math.inf
        ratio = ratio.masked_fill((ratio < min_val) | (ratio > max_val), value=0.0)
    return ratio


@pytest.mark.parametrize("mode,name,kw", [
    ("token_truncate", "tis", {"cap": 3.0}),
    ("sequence_truncate", "tis", {"cap": 3.0, "level": "sequence"}),
    ("token_mask", "mis", {"upper": 3.0, "lower": 0.0}),
    ("sequence_mask", "mis", {"upper": 3.0, "lower": 0.0, "level": "sequence"}),  # TRL's default mode
])
def test_equals_trl_vllm_importance_sampling(mode, name, kw):
    _, prox, mu, _, mask = inputs(seed=11, spread=0.9)
    trl = trl_is_ratio(prox, mu, mask, mode, None, 3.0).expand_as(mask) * mask  # off-mask tokens: no loss in TRL
    w, _ = CORRECTIONS.get(name)(prox, mu, mask, **kw)
    torch.testing.assert_close(w, trl, rtol=1e-15, atol=1e-15)
    assert (trl == 0).logical_and(mask > 0).any() or (trl == 3.0).any()  # a bound was hit


# -- mismatch ------------------------------------------------------------------------------------


def test_logprob_mismatch_by_hand():
    # trained deltas learner - sampling: +0.1, -0.3, 0; the untrained token's 5.0 is ignored
    learner = t([-1.0, -2.3, -0.5, 4.0])
    sampling = t([-1.1, -2.0, -0.5, -1.0])
    m = logprob_mismatch(learner, sampling, MASK)
    assert m["mean_abs"] == pytest.approx(0.4 / 3)
    assert m["max_abs"] == pytest.approx(0.3)
    assert m["kl_k1"] == pytest.approx((-0.1 + 0.3 + 0.0) / 3)  # mean of log mu - log pi
    k3 = (math.exp(0.1) - 1 - 0.1) + (math.exp(-0.3) - 1 + 0.3)  # r - 1 - log r
    assert m["kl"] == pytest.approx(k3 / 3)
    assert logprob_mismatch(learner, sampling, torch.zeros_like(MASK)) == {"mean_abs": 0.0, "max_abs": 0.0,
                                                                          "kl": 0.0, "kl_k1": 0.0}
