"""KL estimators: hand values, equality with verl kl_penalty in value and gradient, exact
expectations over a small categorical, forward direction, the truncated and adaptive variants, error paths."""

import math

import pytest
import torch

from materl.errors import ConfigError, ShapeError, UnknownNameError
from materl.ops.aggregate import LOSS_AGG
from materl.ops.kl import KL_ESTIMATORS, confidence_mask, kl_penalty

F64 = torch.float64
LN2 = math.log(2.0)


def t(*rows):
    return torch.tensor(rows, dtype=F64)


def verl_kl_penalty(logprob, ref_logprob, kl_penalty):
    """Naive transcription of verl core_algos.kl_penalty / kl_penalty_forward."""
    base = kl_penalty[:-1] if kl_penalty.endswith("+") else kl_penalty
    if base in ("kl", "k1"):
        fwd = logprob - ref_logprob
    elif base == "abs":
        fwd = (logprob - ref_logprob).abs()
    elif base in ("mse", "k2"):
        fwd = 0.5 * (logprob - ref_logprob).square()
    else:  # low_var_kl, k3
        kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        fwd = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    if not kl_penalty.endswith("+"):
        return fwd
    backward_score = 0.5 * (logprob - ref_logprob).square()
    return backward_score - backward_score.detach() + fwd.detach()


def pair(seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(4, 6, generator=g, dtype=F64) * 3
    ref = logp + torch.randn(4, 6, generator=g, dtype=F64)
    ref[0, 0], ref[1, 1] = logp[0, 0] + 30.0, logp[1, 1] - 30.0  # hit the [-20, 20] and [-10, 10] clamps
    return logp.requires_grad_(True), ref.requires_grad_(True)


def test_hand_values():
    # pi = 0.5, ref = 0.25: d = logp - ref = ln 2
    # k1 = ln2 = 0.693;  k2 = ln2^2/2 = 0.240;  k3 = e^-ln2 + ln2 - 1 = 0.5 + 0.693 - 1 = 0.193;  abs = 0.693
    # truncated(threshold 0.5) = min(0.693, 0.5) = 0.5;  adaptive: pi 0.5 > 0.1 -> 0.693
    logp, ref = t([math.log(0.5)]), t([math.log(0.25)])
    expect = {"k1": LN2, "k2": LN2**2 / 2, "k3": LN2 - 0.5, "abs": LN2, "k3_plus": LN2 - 0.5, "adaptive": LN2}
    for name, value in expect.items():
        assert KL_ESTIMATORS.get(name)(logp, ref).item() == pytest.approx(value), name
    assert KL_ESTIMATORS.get("truncated")(logp, ref, threshold=0.5).item() == pytest.approx(0.5)
    # adaptive drops a token the policy is not confident about: pi = 0.05 < 0.1 -> 0
    assert KL_ESTIMATORS.get("adaptive")(t([math.log(0.05)]), ref).item() == 0.0


def test_k3_is_clamped_to_ten_by_default():
    # ref - logp = 20 -> e^20 - 21 = 4.85e8 -> clamped to 10; clamp=None leaves it
    logp, ref = t([0.0]), t([20.0])
    assert KL_ESTIMATORS.get("k3")(logp, ref).item() == 10.0
    assert KL_ESTIMATORS.get("k3")(logp, ref, clamp=None).item() == pytest.approx(math.exp(20) - 21)
    assert kl_penalty(logp, ref, estimator="k1", clamp=0.5).item() == -0.5  # k1 = -20 -> -0.5


@pytest.mark.parametrize("verl_name,ours", [
    ("kl", "k1"), ("k1", "k1"), ("mse", "k2"), ("k2", "k2"), ("low_var_kl", "k3"), ("k3", "k3"),
    ("abs", "abs"), ("k3+", "k3_plus"), ("low_var_kl+", "k3_plus"),
])
def test_value_and_gradient_equal_verl(verl_name, ours):
    logp, ref = pair()
    mask = (torch.arange(6)[None, :] < torch.tensor([6, 3, 1, 5])[:, None]).to(F64)
    for out in (kl_penalty(logp, ref, estimator=ours), kl_penalty(logp, ref, estimator=verl_name)):
        expect = verl_kl_penalty(logp, ref, verl_name)
        torch.testing.assert_close(out, expect, rtol=1e-6, atol=1e-9)
        a, b = LOSS_AGG.get("token_mean")(out, mask), LOSS_AGG.get("token_mean")(expect, mask)
        for x, y in zip(torch.autograd.grad(a, (logp, ref)), torch.autograd.grad(b, (logp, ref))):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-9)


def test_k3_plus_has_k3_value_and_k2_gradient():
    logp, ref = pair(1)
    plus = KL_ESTIMATORS.get("k3_plus")(logp, ref)
    torch.testing.assert_close(plus, KL_ESTIMATORS.get("k3")(logp, ref))
    g_plus = torch.autograd.grad(plus.sum(), logp)[0]
    torch.testing.assert_close(g_plus, (logp - ref).detach())  # d/dlogp of (logp - ref)^2 / 2


def categorical(seed=0, V=7):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(V, generator=g, dtype=F64).requires_grad_(True)
    b = torch.randn(V, generator=g, dtype=F64)
    return a, torch.log_softmax(b, -1)


def test_expectations_are_exact_kl_in_both_directions():
    # sum_x pi(x) est(x) over the whole vocabulary is the estimator's expectation under pi
    a, log_ref = categorical()
    log_pi = torch.log_softmax(a, -1).detach()
    pi, ref = log_pi.exp(), log_ref.exp()
    kl_pi_ref = (pi * (log_pi - log_ref)).sum()
    kl_ref_pi = (ref * (log_ref - log_pi)).sum()
    for name in ("k1", "k3"):
        rev = (pi * kl_penalty(log_pi, log_ref, estimator=name, clamp=None)).sum()
        fwd = (pi * kl_penalty(log_pi, log_ref, estimator=name, direction="forward", clamp=None)).sum()
        torch.testing.assert_close(rev, kl_pi_ref)
        torch.testing.assert_close(fwd, kl_ref_pi)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_k3_plus_expected_gradient_is_the_kl_gradient(direction):
    # E_pi[grad of k3_plus] w.r.t. the policy logits equals grad KL exactly (samples weighted by sg(pi))
    a, log_ref = categorical(1)
    log_pi = torch.log_softmax(a, -1)
    est = kl_penalty(log_pi, log_ref, estimator="k3_plus", direction=direction, clamp=None)
    surrogate = (log_pi.exp().detach() * est).sum()
    log_q = torch.log_softmax(a, -1)  # a separate graph for the exact KL
    q, ref = log_q.exp(), log_ref.exp()
    exact = (q * (log_q - log_ref)).sum() if direction == "reverse" else (ref * (log_ref - log_q)).sum()
    torch.testing.assert_close(torch.autograd.grad(surrogate, a)[0], torch.autograd.grad(exact, a)[0])


def test_forward_hand_values():
    # pi = 0.5, ref = 0.25 -> r = ref/pi = 0.5, log r = -ln2
    # forward k1 = r log r = -0.3466;  forward k3 = r log r - r + 1 = 0.1534;  forward k2 = r (log r)^2 / 2
    logp, ref = t([math.log(0.5)]), t([math.log(0.25)])
    f = lambda name: kl_penalty(logp, ref, estimator=name, direction="forward").item()  # noqa: E731
    assert f("k1") == pytest.approx(-0.5 * LN2)
    assert f("k3") == pytest.approx(-0.5 * LN2 + 0.5)
    assert f("k3_plus") == pytest.approx(-0.5 * LN2 + 0.5)
    assert f("k2") == pytest.approx(0.25 * LN2**2)


def test_truncated_matches_seed_and_stops_gradient_above_threshold():
    # (policy_lp - ref_lp).clamp(max=threshold), averaged per sequence over the mask
    logp = t([-0.1, -2.0, -1.0], [-0.5, -0.5, -3.0]).requires_grad_(True)
    ref = t([-2.0, -1.0, -1.5], [-0.4, -2.0, -3.0])
    mask = t([1, 1, 1], [1, 1, 0])
    ours = KL_ESTIMATORS.get("truncated")(logp, ref, threshold=1.0)
    seed = ((logp - ref).clamp(max=1.0) * mask).sum(1) / mask.sum(1).clamp(min=1.0)
    torch.testing.assert_close((ours * mask).sum(1) / mask.sum(1), seed)
    # token (0,0): d = 1.9 > 1 -> truncated, zero gradient; token (1,1): d = 1.5 > 1 -> zero gradient
    grad = torch.autograd.grad(ours.sum(), logp)[0]
    assert grad.tolist() == [[0.0, 1.0, 1.0], [1.0, 0.0, 1.0]]


def test_adaptive_matches_seed_with_confidence_mask():
    # confident = exp(policy_lp) > 0.1; per-sequence mean over mask * confident
    g = torch.Generator().manual_seed(7)
    logp = -torch.rand(3, 5, generator=g, dtype=F64) * 4
    ref = logp + torch.randn(3, 5, generator=g, dtype=F64)
    mask = t([1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0])
    combined = mask * (logp.exp() > 0.1).to(F64)
    seed = ((logp - ref) * combined).sum(1) / combined.sum(1).clamp(min=1.0)
    ours = KL_ESTIMATORS.get("adaptive")(logp, ref)
    keep = mask * confidence_mask(logp)
    torch.testing.assert_close((ours * keep).sum(1) / keep.sum(1).clamp(min=1.0), seed)
    assert 0 < combined.sum() < mask.sum()  # some tokens are dropped, some kept


def test_registry_names_and_clamp_keyword():
    assert KL_ESTIMATORS.names() == sorted(["k1", "k2", "k3", "abs", "k3_plus", "truncated", "adaptive"])


def test_errors():
    logp, ref = pair()
    with pytest.raises(UnknownNameError, match=r"unknown kl_estimator 'k3plus'.*Did you mean 'k3_plus'"):
        kl_penalty(logp, ref, estimator="k3plus")
    with pytest.raises(ConfigError, match="direction must be 'reverse' .* got 'backward'"):
        kl_penalty(logp, ref, direction="backward")
    with pytest.raises(ShapeError, match=r"logp\[4, 6\], ref_logp\[4, 5\]"):
        KL_ESTIMATORS.get("k1")(logp, ref[:, :5])
    with pytest.raises(ShapeError):
        kl_penalty(logp, ref[:, :5], direction="forward")
    with pytest.raises(ConfigError, match="clamp must be > 0 or None; got 0"):
        kl_penalty(logp, ref, estimator="k1", clamp=0)
