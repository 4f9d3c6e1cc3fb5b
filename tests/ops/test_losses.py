"""Policy losses, value loss and chunked entropy: hand-computed values, float64 gradient equality
with a naive transcription of verl core_algos, stats counts and error paths."""

import math
import re

import pytest
import torch

from materl.errors import ConfigError, ShapeError, UnknownNameError
from materl.ops.aggregate import LOSS_AGG
from materl.ops.losses import POLICY_LOSSES, entropy_from_logits, value_loss

F64 = torch.float64
E = math.e


def t(*rows):
    return torch.tensor(rows, dtype=F64)


def batch(seed=0, lengths=(6, 3, 1, 5), T=6):
    """float64 (B,T) inputs; masks of uneven length, including a length-1 row; garbage in padding."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    logp = -(torch.rand(B, T, generator=g, dtype=F64) * 3 + 0.05)
    old = logp + 0.5 * torch.randn(B, T, generator=g, dtype=F64)
    adv = 1.5 * torch.randn(B, T, generator=g, dtype=F64)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).to(F64)
    return logp.requires_grad_(True), old, adv, mask


# ----------------------------------------------------------------------------- naive verl
def verl_agg(loss, mask, mode):
    """verl agg_loss (dp_size=1): fully masked rows are excluded from the seq-mean."""
    if mode == "token-mean":
        return (loss * mask).sum() / mask.sum()
    seq_mask = (mask.sum(-1) > 0).to(loss.dtype)
    if mode == "seq-mean-token-mean":
        per_seq = (loss * mask).sum(-1) / (mask.sum(-1) + 1e-8)
        return (per_seq * seq_mask).sum() / seq_mask.sum()
    return ((loss * mask).sum(-1) * seq_mask).sum() / seq_mask.sum()  # seq-mean-token-sum


def verl_vanilla(old, logp, adv, clip_low, clip_high, clip_ratio_c=None):
    nkl = torch.clamp(logp - old, min=-20.0, max=20.0)
    ratio = torch.exp(nkl)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    c1 = torch.maximum(l1, l2)
    if clip_ratio_c is None:
        return c1
    l3 = -adv * clip_ratio_c
    return torch.where(adv < 0, torch.min(l3, c1), c1)


def verl_gspo(old, logp, adv, mask, clip_low, clip_high):
    nkl = logp - old
    seq_len = mask.sum(-1).clamp(min=1)
    nkl_seq = (nkl * mask).sum(-1) / seq_len
    log_s = torch.clamp(logp - logp.detach() + nkl_seq.detach().unsqueeze(-1), max=10.0)
    s = torch.exp(log_s)
    return torch.maximum(-adv * s, -adv * torch.clamp(s, 1 - clip_low, 1 + clip_high))


def verl_cispo(old, logp, adv, clip_low, clip_high):
    ratio = torch.exp(torch.clamp(logp - old, min=-20.0, max=20.0))
    return -torch.clamp(ratio, 1 - clip_low, 1 + clip_high).detach() * adv * logp


def verl_reinforce_bypass(old, logp, adv, threshold):
    w = torch.exp(torch.clamp(logp.detach() - old, -20, 20)).clamp(max=threshold).detach()
    return -adv * logp * w


def verl_sapo(old, logp, adv, tau_pos, tau_neg):
    ratio = torch.exp(torch.clamp(logp - old, min=-20.0, max=20.0))
    taus = torch.where(adv > 0, torch.tensor(tau_pos, dtype=F64), torch.tensor(tau_neg, dtype=F64))
    return -torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus) * adv


def verl_clip_cov(old, logp, adv, mask, clip, ratio_, lb, ub):
    ratio = torch.exp(logp - old)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - clip, 1 + clip)
    corr = torch.ones_like(adv)
    clip_by_origin = (l2 > l1) & (mask > 0)
    mm = lambda x: (x * mask).sum() / mask.sum()  # noqa: E731
    cov_all = (adv - mm(adv)) * (logp - mm(logp.detach()))
    cov_all = cov_all.detach().clone()
    cov_all[mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(ratio_ * mask.sum().item()), 1)
    idx = torch.nonzero((cov_all < ub) & (cov_all > lb) & (mask > 0))
    idx = idx[torch.randperm(len(idx))[: min(clip_num, len(idx))]]
    corr[idx[:, 0], idx[:, 1]] = 0
    return torch.maximum(l1, l2) * corr, len(idx)


def verl_kl_cov(old, logp, adv, mask, ratio_, coef):
    nkl = logp - old
    ratio = torch.exp(nkl)
    pg = (-adv * ratio).clone()
    pg_kl = -adv * ratio + coef * nkl.abs()
    valid = mask > 0
    valid_idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    a, lp = adv[valid].detach().reshape(-1), logp[valid].detach().reshape(-1)
    cov = (a - a.mean()) * (lp - lp.mean())
    top = valid_idx[torch.topk(cov, max(1, int(len(cov) * ratio_)), largest=True).indices]
    T = adv.shape[1]
    pg[top // T, top % T] = pg_kl[top // T, top % T]
    return pg


def verl_value_loss(vpreds, returns, values, mask, clip):
    vclip = torch.max(torch.min(vpreds, values + clip), values - clip)
    return 0.5 * verl_agg(torch.max((vpreds - returns) ** 2, (vclip - returns) ** 2), mask, "token-mean")


# ----------------------------------------------------------------------------- gradient equality
def _grad(x, logp):
    return torch.autograd.grad(x, logp)[0]


CASES = [
    # (materl name, hparams, verl per-token fn, aggregation)
    ("ppo_clip", {}, lambda o, lp, a, m: verl_vanilla(o, lp, a, 0.2, 0.2), "token_mean"),
    ("ppo_clip", {"eps_low": 0.2, "eps_high": 0.28, "dual_clip": 3.0},
     lambda o, lp, a, m: verl_vanilla(o, lp, a, 0.2, 0.28, 3.0), "seq_mean_token_sum"),
    ("gspo", {}, lambda o, lp, a, m: verl_gspo(o, lp, a, m, 3e-4, 4e-4), "seq_mean_token_mean"),
    ("gspo", {"eps_low": 0.2, "eps_high": 0.2}, lambda o, lp, a, m: verl_gspo(o, lp, a, m, 0.2, 0.2),
     "seq_mean_token_mean"),
    ("cispo", {"eps_low": 0.2, "eps_high": 0.2}, lambda o, lp, a, m: verl_cispo(o, lp, a, 0.2, 0.2), "token_mean"),
    ("reinforce", {}, lambda o, lp, a, m: verl_reinforce_bypass(o, lp, a, 2.0), "seq_mean_token_sum"),
    ("gpg", {}, lambda o, lp, a, m: -lp * a, "token_mean"),
    ("sapo", {}, lambda o, lp, a, m: verl_sapo(o, lp, a, 1.0, 1.05), "seq_mean_token_mean"),
    ("kl_cov", {"cov_ratio": 0.25}, lambda o, lp, a, m: verl_kl_cov(o, lp, a, m, 0.25, 1.0), "token_mean"),
]
VERL_AGG = {"token_mean": "token-mean", "seq_mean_token_sum": "seq-mean-token-sum",
            "seq_mean_token_mean": "seq-mean-token-mean"}


@pytest.mark.parametrize("name,hp,verl_fn,agg", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
@pytest.mark.parametrize("seed", [0, 1])
def test_value_and_gradient_equal_naive_verl(name, hp, verl_fn, agg, seed):
    logp, old, adv, mask = batch(seed)
    loss, _ = POLICY_LOSSES.get(name)(logp, old, adv, mask, **hp)
    ours = LOSS_AGG.get(agg)(loss, mask)
    ref = verl_agg(verl_fn(old, logp, adv, mask), mask, VERL_AGG[agg])
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(_grad(ours, logp), _grad(ref, logp), rtol=1e-6, atol=1e-9)


def test_clip_cov_equals_verl_when_every_candidate_is_detached():
    # cov_ratio=1 lets verl's random pick take every candidate, so both select the same tokens
    logp, old, adv, mask = batch(3)
    loss, stats = POLICY_LOSSES.get("clip_cov")(logp, old, adv, mask, cov_ratio=1.0, cov_lb=0.05, cov_ub=5.0)
    ref_mat, n_detached = verl_clip_cov(old, logp, adv, mask, 0.2, 1.0, 0.05, 5.0)
    assert n_detached >= 2  # the case exercises the selection
    assert (stats["covfrac"] * mask).sum() == n_detached
    ours, ref = LOSS_AGG.get("token_mean")(loss, mask), verl_agg(ref_mat, mask, "token-mean")
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(_grad(ours, logp), _grad(ref, logp), rtol=1e-6, atol=1e-9)


# ----------------------------------------------------------------------------- hand values
def test_ppo_clip_hand_values_and_clipfrac():
    # log r = [1, -1, 0, 1] -> r = [e, 1/e, 1, e];  A = [1, -1, 1, -1];  eps = 0.2
    # t0: -A r = -e,     -A clip = -1.2  -> max = -1.2 (clipped)
    # t1: -A r = 0.368,  -A clip = 0.8   -> 0.8 (clipped)
    # t2: r = 1                          -> -1 (not clipped)
    # t3: -A r = e,      -A clip = 1.2   -> e (not clipped: pessimistic branch is unclipped)
    logp = t([-1.0, -3.0, -2.0, -1.0]).requires_grad_(True)
    old = t([-2.0, -2.0, -2.0, -2.0])
    adv = t([1.0, -1.0, 1.0, -1.0])
    mask = torch.ones(1, 4, dtype=F64)
    loss, stats = POLICY_LOSSES.get("ppo_clip")(logp, old, adv, mask)
    torch.testing.assert_close(loss, t([-1.2, 0.8, -1.0, E]))
    assert stats["clipfrac"].tolist() == [[1.0, 1.0, 0.0, 0.0]]
    assert stats["clipfrac_lower"].sum() == 0
    # clipped tokens get no gradient; unclipped: d(-A r)/dlogp = -A r -> t2: -1, t3: e
    torch.testing.assert_close(_grad(loss.sum(), logp), t([0.0, 0.0, -1.0, E]))


def test_ppo_clip_higher_and_dual_clip():
    # clip-higher: r = e, A = 1, eps_high = 0.28 -> -1.28
    # dual clip:   r = e^2 = 7.39, A = -1 -> max(7.39, 1.2) = 7.39 > 3 * 1 -> min(7.39, 3) = 3
    logp = t([-1.0, 0.0])
    old = t([-2.0, -2.0])
    adv = t([1.0, -1.0])
    loss, stats = POLICY_LOSSES.get("ppo_clip")(logp, old, adv, torch.ones(1, 2), eps_high=0.28, dual_clip=3.0)
    torch.testing.assert_close(loss, t([-1.28, 3.0]))
    assert stats["clipfrac_lower"].tolist() == [[0.0, 1.0]]


def test_gspo_sequence_ratio_and_stop_gradient():
    # row 0: log r = [0.1, 0.1] -> s = e^0.1 = 1.105 > 1 + 4e-4, A = 1 -> both tokens -1.0004, no grad
    # row 1: log r = [0.2, -0.2] -> mean 0 -> s = 1, A = 2 -> -2 each; grad = -A s = -2 each
    # padding (mask 0) holds log r = 5 and must not enter the sequence mean
    logp = t([-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]).requires_grad_(True)
    old = t([-1.1, -1.1, -6.0], [-1.2, -0.8, -6.0])
    adv = t([1.0, 1.0, 1.0], [2.0, 2.0, 2.0])
    mask = t([1, 1, 0], [1, 1, 0])
    loss, stats = POLICY_LOSSES.get("gspo")(logp, old, adv, mask)
    torch.testing.assert_close(loss, t([-1.0004, -1.0004, 0.0], [-2.0, -2.0, 0.0]))
    torch.testing.assert_close(stats["ratio"][0, :2], torch.full((2,), math.exp(0.1), dtype=F64))
    assert stats["clipfrac"][0, :2].tolist() == [1.0, 1.0] and stats["clipfrac"][1].sum() == 0
    torch.testing.assert_close(_grad(loss.sum(), logp), t([0.0, 0.0, 0.0], [-2.0, -2.0, 0.0]))


def test_cispo_one_sided_by_default_two_sided_on_request():
    # log r = [-1, 1] -> r = [0.368, 2.718];  A = 1, logp = -2
    # one-sided: w = [0.368, 1.28] -> l = -w A logp = [0.736, 2.56]; grad = -w A
    # two-sided eps_low = 0.2: w = [0.8, 1.28] -> [1.6, 2.56]
    logp = t([-2.0, -2.0]).requires_grad_(True)
    old = t([-1.0, -3.0])
    adv = t([1.0, 1.0])
    one, s1 = POLICY_LOSSES.get("cispo")(logp, old, adv, torch.ones(1, 2))
    torch.testing.assert_close(one, t([2 * math.exp(-1), 2.56]))
    torch.testing.assert_close(_grad(one.sum(), logp), t([-math.exp(-1), -1.28]))
    assert s1["clipfrac"].tolist() == [[0.0, 1.0]]
    two, s2 = POLICY_LOSSES.get("cispo")(logp, old, adv, torch.ones(1, 2), eps_low=0.2)
    torch.testing.assert_close(two, t([1.6, 2.56]))
    assert s2["clipfrac"].tolist() == [[1.0, 1.0]]


def test_reinforce_truncated_weights_token_and_sequence():
    # token: log r = [1, 0.1] -> w = [min(e, 2), e^0.1] = [2, 1.105];  l = -A w logp with A = 1, logp = -1
    # sequence: w = min(e^(1 + 0.1), 2) = 2 for both tokens;  none: w = 1
    logp = t([-1.0, -1.0]).requires_grad_(True)
    old = t([-2.0, -1.1])
    adv = t([1.0, 1.0])
    mask = torch.ones(1, 2)
    tok, st = POLICY_LOSSES.get("reinforce")(logp, old, adv, mask)
    torch.testing.assert_close(tok, t([2.0, math.exp(0.1)]))
    assert st["clipfrac"].tolist() == [[1.0, 0.0]]
    torch.testing.assert_close(_grad(tok.sum(), logp), t([-2.0, -math.exp(0.1)]))  # w is stop-grad
    seq, _ = POLICY_LOSSES.get("reinforce")(logp, old, adv, mask, is_level="sequence")
    torch.testing.assert_close(seq, t([2.0, 2.0]))
    plain, _ = POLICY_LOSSES.get("reinforce")(logp, old, adv, mask, is_level="none", is_threshold=0.5)
    torch.testing.assert_close(plain, t([1.0, 1.0]))


def test_gpg_is_minus_advantage_times_logp():
    # l = -A logp: A = [2, -1], logp = [-0.5, -3] -> [1, -3]
    loss, _ = POLICY_LOSSES.get("gpg")(t([-0.5, -3.0]), t([-9.0, -9.0]), t([2.0, -1.0]), torch.ones(1, 2))
    torch.testing.assert_close(loss, t([1.0, -3.0]))


def test_sapo_gate_values_and_on_policy_gradient():
    # r = 1: gate = sigmoid(0) 4 / tau = 2 / tau.  A = 1 (tau_pos 1) -> -2;  A = -1 (tau_neg 1.05) -> 2/1.05
    # d/dlogp at r = 1: -A sigmoid'(0) tau r 4 / tau = -A -> grads [-1, 1]
    logp = t([-1.0, -1.0]).requires_grad_(True)
    loss, stats = POLICY_LOSSES.get("sapo")(logp, t([-1.0, -1.0]), t([1.0, -1.0]), torch.ones(1, 2))
    torch.testing.assert_close(loss, t([-2.0, 2.0 / 1.05]))
    torch.testing.assert_close(stats["gate"], t([2.0, 2.0 / 1.05]))
    torch.testing.assert_close(_grad(loss.sum(), logp), t([-1.0, 1.0]))


def _cov_case():
    # A = [2, -2, 2, -2] (mean 0), logp = [-0.5, -3.5, -1.4, -2.6] (mean -2)
    # cov = A (logp + 2) = [3, 3, 1.2, 1.2]: all four inside (1, 5)
    logp = t([-0.5, -3.5, -1.4, -2.6]).requires_grad_(True)
    return logp, t([2.0, -2.0, 2.0, -2.0]), torch.ones(1, 4, dtype=F64)


def test_clip_cov_detaches_the_highest_covariance_candidates_deterministically():
    # r = 1 (old = logp): nothing PPO-clipped; loss = -A r = [-2, 2, -2, 2] except detached tokens
    # cov_ratio 0.5 -> n = max(int(0.5 * 4), 1) = 2 -> tokens 0, 1 (cov 3) detached
    # cov_ratio 0.25 -> n = 1 -> token 0 (tie with token 1 goes to the lower index)
    logp, adv, mask = _cov_case()
    old = logp.detach().clone()
    loss, stats = POLICY_LOSSES.get("clip_cov")(logp, old, adv, mask, cov_ratio=0.5)
    torch.testing.assert_close(loss, t([0.0, 0.0, -2.0, 2.0]))
    assert stats["covfrac"].tolist() == [[1.0, 1.0, 0.0, 0.0]]
    torch.testing.assert_close(_grad(loss.sum(), logp), t([0.0, 0.0, -2.0, 2.0]))
    again, _ = POLICY_LOSSES.get("clip_cov")(logp, old, adv, mask, cov_ratio=0.5)
    assert torch.equal(loss, again)
    one, stats1 = POLICY_LOSSES.get("clip_cov")(logp, old, adv, mask, cov_ratio=0.25)
    torch.testing.assert_close(one, t([0.0, 2.0, -2.0, 2.0]))
    assert stats1["covfrac"].tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_kl_cov_penalises_the_top_covariance_token():
    # old = logp - 0.1 -> r = e^0.1; cov as above -> k = max(int(0.25 * 4), 1) = 1 -> token 0
    # token 0: -A r + 1.0 * |0.1| = -2 e^0.1 + 0.1;  others: -A e^0.1
    logp, adv, mask = _cov_case()
    r = math.exp(0.1)
    loss, stats = POLICY_LOSSES.get("kl_cov")(logp, logp.detach() - 0.1, adv, mask, cov_ratio=0.25)
    torch.testing.assert_close(loss, t([-2 * r + 0.1, 2 * r, -2 * r, 2 * r]))
    assert stats["covfrac"].tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_masked_tokens_are_zero_and_stats_are_detached_per_token():
    logp, old, adv, mask = batch(0)
    for name in POLICY_LOSSES.names():
        loss, stats = POLICY_LOSSES.get(name)(logp, old, adv, mask)
        assert loss.shape == mask.shape and torch.all(loss[mask == 0] == 0), name
        for key, value in stats.items():
            assert value.shape == mask.shape and not value.requires_grad, (name, key)
        torch.testing.assert_close(stats["ppo_kl"], (old - logp).detach())


# ----------------------------------------------------------------------------- value loss
def test_value_loss_hand_values():
    # c = 0.2, old = 1
    # v = 1.5, R = 2:  (v-R)^2 = 0.25; v_clip = 1.2 -> 0.64; 0.5 max = 0.32 (clipped)
    # v = 1.1, R = 2:  v_clip = v -> 0.5 * 0.81 = 0.405 (not clipped)
    # v = 0.5, R = 0:  0.25 vs v_clip = 0.8 -> 0.64 -> 0.32 (clipped)
    v = t([1.5, 1.1, 0.5])
    loss, stats = value_loss(v, t([1.0, 1.0, 1.0]), t([2.0, 2.0, 0.0]), torch.ones(1, 3))
    torch.testing.assert_close(loss, t([0.32, 0.405, 0.32]))
    assert stats["vf_clipfrac"].tolist() == [[1.0, 0.0, 1.0]]
    plain, _ = value_loss(v, t([1.0, 1.0, 1.0]), t([2.0, 2.0, 0.0]), torch.ones(1, 3), clip_range=None)
    torch.testing.assert_close(plain, t([0.125, 0.405, 0.125]))


def test_value_loss_gradient_equals_verl():
    _, old, returns, mask = batch(4)
    v = (old + 0.3 * torch.randn(old.shape, dtype=F64)).requires_grad_(True)
    loss, _ = value_loss(v, old, returns, mask, clip_range=0.2)
    ours = LOSS_AGG.get("token_mean")(loss, mask)
    ref = verl_value_loss(v, returns, old, mask, 0.2)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(_grad(ours, v), _grad(ref, v), rtol=1e-6, atol=1e-9)


# ----------------------------------------------------------------------------- entropy
def naive_entropy(z):
    p = torch.softmax(z, -1)
    return torch.logsumexp(z, -1) - (p * z).sum(-1)


@pytest.mark.parametrize("chunk", [1, 3, 1024])
@pytest.mark.parametrize("sliced", [False, True])
def test_entropy_value_and_gradient_equal_naive(chunk, sliced):
    full = (3 * torch.randn(2, 8, 11, dtype=F64)).requires_grad_(True)
    z = full[:, :-1] if sliced else full  # a non-contiguous slice is chunked without a copy
    g = torch.randn(z.shape[:2], dtype=F64)
    ours, ref = entropy_from_logits(z, chunk_size=chunk), naive_entropy(z)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(_grad((ours * g).sum(), full), _grad((ref * g).sum(), full), rtol=1e-10, atol=1e-12)


def test_entropy_hand_values():
    # uniform over 4: log 4;  one-hot-ish (0, -inf-like): ~0;  two equal of three with third far: log 2
    z = t([0.0, 0.0, 0.0, 0.0], [0.0, -200.0, -200.0, -200.0], [5.0, 5.0, -200.0, -200.0])
    torch.testing.assert_close(entropy_from_logits(z.unsqueeze(0)), t([math.log(4), 0.0, math.log(2)]).reshape(1, 3))


def test_entropy_saves_no_softmax_copy():
    z = torch.randn(4, 16, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel()) or x, lambda x: x):
        entropy_from_logits(z, chunk_size=8)
        naive_entropy(z)
        naive_total = sum(saved)
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel()) or x, lambda x: x):
        entropy_from_logits(z, chunk_size=8)
    assert sum(saved) == z.numel()  # only the logits themselves
    assert naive_total > 2 * z.numel()  # the naive formula keeps a (B,T,V) softmax and more


def test_entropy_bfloat16_computed_in_float32():
    z = torch.randn(2, 5, 32)
    out = entropy_from_logits(z.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), naive_entropy(z.to(torch.bfloat16).float()), rtol=1e-2, atol=1e-2)


# ----------------------------------------------------------------------------- errors
def test_registry_holds_the_documented_losses():
    assert POLICY_LOSSES.names() == sorted(
        ["ppo_clip", "gspo", "cispo", "reinforce", "gpg", "sapo", "clip_cov", "kl_cov"])


def test_unknown_loss_name_lists_choices_and_suggests():
    with pytest.raises(UnknownNameError, match=r"unknown policy_loss 'ppo_clp'.*valid: cispo.*Did you mean 'ppo_clip'"):
        POLICY_LOSSES.get("ppo_clp")


def test_shape_mismatch_is_shape_error():
    logp, old, adv, mask = batch(0)
    with pytest.raises(ShapeError, match=r"advantages\[4\]"):
        POLICY_LOSSES.get("ppo_clip")(logp, old, adv[:, 0], mask)
    with pytest.raises(ShapeError, match="mask"):
        value_loss(old, old, old, mask[:, :3])
    with pytest.raises(ShapeError):
        entropy_from_logits(torch.randn(5))


@pytest.mark.parametrize("name,hp,needle", [
    ("ppo_clip", {"eps_low": 1.5}, "eps_low must be >= 0 and < 1.0; got 1.5"),
    ("ppo_clip", {"dual_clip": 0.9}, "dual_clip must be > 1"),
    ("sapo", {"tau_neg": 0.0}, "tau_neg must be > 0; got 0.0"),
    ("reinforce", {"is_level": "seq"}, "is_level must be one of token, sequence, none; got 'seq'"),
    ("clip_cov", {"cov_ratio": 0.0}, "cov_ratio must be > 0"),
])
def test_bad_hyperparameters_are_config_errors(name, hp, needle):
    logp, old, adv, mask = batch(0)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        POLICY_LOSSES.get(name)(logp, old, adv, mask, **hp)


def test_empty_mask_gives_zero_loss_and_gradient_not_nan():
    logp, old, adv, mask = batch(0)
    empty = torch.zeros_like(mask)
    for name in POLICY_LOSSES.names():
        loss, _ = POLICY_LOSSES.get(name)(logp, old, adv, empty)
        total = LOSS_AGG.get("token_mean")(loss, empty)
        assert total.item() == 0.0, name
        assert torch.all(_grad(total, logp) == 0), name
