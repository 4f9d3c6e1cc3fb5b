"""The fused policy-loss kernel against the op path (materl.ops losses + aggregate + kl)."""

import math
from types import SimpleNamespace

import pytest
import torch

from materl.errors import ConfigError, KernelError, ShapeError, UnknownNameError
from materl.kernels import policy_loss as PL
from materl.kernels.policy_loss import fused_policy_loss, policy_loss_torch
from materl.ops.aggregate import LOSS_AGG
from materl.ops.kl import kl_penalty
from materl.ops.losses import POLICY_LOSSES
from tests.kernels.conftest import uneven_mask
from tests.tolerance import assert_close_to_scale

B, T = 6, 9


def _inputs(dtype=torch.float64, seed=0, adv_shape="BT"):
    g = torch.Generator().manual_seed(seed)
    logp = (torch.randn(B, T, generator=g, dtype=dtype) * 0.5 - 1.0).requires_grad_()
    old = logp.detach() + torch.randn(B, T, generator=g, dtype=dtype) * 0.3
    ref = logp.detach() + torch.randn(B, T, generator=g, dtype=dtype) * 0.6
    adv = torch.randn(B, T, generator=g, dtype=dtype) if adv_shape == "BT" else torch.randn(B, generator=g, dtype=dtype)
    return logp, old, ref, adv, uneven_mask(B, T, dtype)


def _run(fn, logp, *args, **kw):
    logp.grad = None
    value, metrics = fn(logp, *args, **kw)
    value.backward()
    return value.detach(), logp.grad.clone(), metrics


def _close(a, b, tol):
    a, b = (x.detach() if isinstance(x, torch.Tensor) else x for x in (a, b))
    assert abs(float(a) - float(b)) <= tol * (1 + abs(float(b))), (float(a), float(b))


LOSSES = [("ppo_clip", {}), ("ppo_clip", {"eps_low": 0.1, "eps_high": 0.28, "dual_clip": 2.0}),
          ("gspo", {"eps_low": 0.05, "eps_high": 0.08}), ("cispo", {}), ("cispo", {"eps_low": 0.2, "eps_high": 0.2})]
AGGS = list(PL.AGGS)


@pytest.mark.mojo
@pytest.mark.parametrize("loss,hp", LOSSES)
@pytest.mark.parametrize("agg", AGGS)
def test_value_gradient_metrics_equal_the_op_path(loss, hp, agg):
    for kl, coef, denom in (("k3", 0.1, None), ("k1", 0.0, 17.0), ("k2", 0.5, None)):
        logp, old, ref, adv, mask = _inputs(seed=len(agg))
        kw = dict(ref_logp=ref, loss=loss, agg=agg, kl=kl, kl_coef=coef, denom=denom, **hp)
        v1, g1, m1 = _run(fused_policy_loss, logp, old, adv, mask, impl="mojo", **kw)
        v2, g2, m2 = _run(policy_loss_torch, logp, old, adv, mask, **kw)
        _close(v1, v2, 1e-10)
        torch.testing.assert_close(g1, g2, rtol=1e-9, atol=1e-12)
        assert m1.keys() == m2.keys()
        for k in m2:
            _close(m1[k], m2[k], 1e-10)


@pytest.mark.mojo
@pytest.mark.parametrize("kl", ["k1", "k2", "k3", "abs", "k3_plus", "low_var_kl", "mse"])
def test_every_kl_estimator_with_its_default_clamp(kl):
    logp, old, ref, adv, mask = _inputs(seed=3)
    ref = ref.clone()
    ref[0, :3] = logp.detach()[0, :3] + torch.tensor([15.0, -15.0, 0.0])  # k3 past its clamp of 10; d = 0
    kw = dict(ref_logp=ref, kl=kl, kl_coef=0.3, agg="seq_mean_token_mean")
    v1, g1, m1 = _run(fused_policy_loss, logp, old, adv, mask, impl="mojo", **kw)
    v2, g2, m2 = _run(policy_loss_torch, logp, old, adv, mask, **kw)
    _close(v1, v2, 1e-10)
    _close(m1["kl"], m2["kl"], 1e-10)
    torch.testing.assert_close(g1, g2, rtol=1e-9, atol=1e-12)


@pytest.mark.mojo
def test_op_path_reference_is_the_ops_themselves():
    """policy_loss_torch is LOSS_AGG(POLICY_LOSSES(...)) + coef * LOSS_AGG(kl_penalty(...))."""
    logp, old, ref, adv, mask = _inputs(seed=5)
    per_token, _ = POLICY_LOSSES.get("ppo_clip")(logp, old, adv, mask, eps_high=0.3)
    agg = LOSS_AGG.get("seq_mean_token_sum_norm")
    expected = agg(per_token, mask, norm=4.0) + 0.2 * agg(kl_penalty(logp, ref, estimator="k3"), mask, norm=4.0)
    expected.backward()
    g_expected = logp.grad.clone()
    v, g, _ = _run(fused_policy_loss, logp, old, adv, mask, ref_logp=ref, agg="seq_mean_token_sum_norm",
                   norm=4.0, kl_coef=0.2, eps_high=0.3, impl="mojo")
    _close(v, expected.detach(), 1e-10)
    torch.testing.assert_close(g, g_expected, rtol=1e-9, atol=1e-12)


@pytest.mark.mojo
def test_hand_computed_ppo_clip_and_dual_clip():
    # one row, three tokens, logp - old = log 2 so r = 2 everywhere
    logp = torch.full((1, 3), math.log(0.5), dtype=torch.float64, requires_grad=True)
    old = torch.full((1, 3), math.log(0.25), dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, -2.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    # A=1:  max(-2, -1.2) = -1.2 (clipped, no gradient)
    # A=-1: max(2, 1.2) = 2, below the dual bound 3 -> 2, gradient -A r = 2
    # A=-2: max(4, 2.4) = 4 > dual bound 6? no -> 4, gradient 4; token_sum -> -1.2 + 2 + 4 = 4.8
    v, g, m = _run(fused_policy_loss, logp, old, adv, mask, agg="token_sum", dual_clip=3.0, impl="mojo")
    assert float(v) == pytest.approx(4.8) and g[0].tolist() == pytest.approx([0.0, 2.0, 4.0])
    assert m["clipfrac"] == pytest.approx(1 / 3) and m["clipfrac_lower"] == 0.0
    # dual bound 1.5 for A=-1 caps 2 -> 1.5 (no gradient); for A=-2 caps 4 -> 3 (no gradient)
    v, g, m = _run(fused_policy_loss, logp, old, adv, mask, agg="token_sum", dual_clip=1.5, impl="mojo")
    assert float(v) == pytest.approx(-1.2 + 1.5 + 3.0) and g.tolist() == [[0.0, 0.0, 0.0]]
    assert m["clipfrac_lower"] == pytest.approx(2 / 3)
    assert m["ppo_kl"] == pytest.approx(-math.log(2))


@pytest.mark.mojo
def test_float32_inputs_and_per_row_advantages():
    logp, old, ref, adv, mask = _inputs(torch.float32, seed=7, adv_shape="B")
    kw = dict(ref_logp=ref, loss="ppo_clip", agg="seq_mean_token_mean", kl_coef=0.1)
    v1, g1, m1 = _run(fused_policy_loss, logp, old, adv, mask, impl="mojo", **kw)
    v2, g2, m2 = _run(policy_loss_torch, logp, old, adv, mask, **kw)
    assert v1.dtype == torch.float32 and g1.dtype == torch.float32
    _close(v1, v2, 1e-5)
    assert_close_to_scale(g1, g2)


@pytest.mark.mojo
def test_empty_mask_gives_zero_loss_and_gradient():
    logp, old, ref, adv, _ = _inputs(seed=2)
    mask = torch.zeros(B, T, dtype=torch.float64)
    for agg in AGGS:
        v, g, m = _run(fused_policy_loss, logp, old, adv, mask, ref_logp=ref, kl_coef=0.1, agg=agg, impl="mojo")
        assert float(v) == 0.0 and not g.any() and m["clipfrac"] == 0.0 and m["kl"] == 0.0


@pytest.mark.mojo
def test_gradcheck_away_from_clip_edges():
    g = torch.Generator().manual_seed(11)
    logp = (torch.randn(3, 4, generator=g, dtype=torch.float64) * 0.3 - 1).requires_grad_()
    old = logp.detach() + 0.02 * torch.randn(3, 4, generator=g, dtype=torch.float64)  # ratios ~1, far from 0.8/1.2
    ref = logp.detach() + 0.5 * torch.randn(3, 4, generator=g, dtype=torch.float64)
    adv = torch.randn(3, 4, generator=g, dtype=torch.float64)
    mask = uneven_mask(3, 4)
    fn = lambda lp: fused_policy_loss(lp, old, adv, mask, ref_logp=ref, kl="k3", kl_coef=0.2,  # noqa: E731
                                      agg="seq_mean_token_mean", impl="mojo")[0]
    assert torch.autograd.gradcheck(fn, (logp,), eps=1e-6, atol=1e-7)


def test_torch_fallback_when_disabled(monkeypatch, fresh_loader):
    monkeypatch.setenv("MATERL_DISABLE_MOJO", "1")
    logp, old, ref, adv, mask = _inputs(seed=4)
    v1, g1, m1 = _run(fused_policy_loss, logp, old, adv, mask, ref_logp=ref, kl_coef=0.1, loss="gspo")
    v2, g2, m2 = _run(policy_loss_torch, logp, old, adv, mask, ref_logp=ref, kl_coef=0.1, loss="gspo")
    assert float(v1) == float(v2) and torch.equal(g1, g2) and m1 == m2
    with pytest.raises(KernelError, match="MATERL_DISABLE_MOJO"):
        fused_policy_loss(logp, old, adv, mask, impl="mojo")


def test_defaults_come_from_the_ops():
    assert PL.loss_defaults("gspo") == {"eps_low": 3e-4, "eps_high": 4e-4}
    assert PL._hyper("ppo_clip", None, None, None) == (0.2, 0.2, 0.0, 0)
    assert PL._hyper("cispo", None, None, None) == (0.0, 0.28, 0.0, 1)  # one-sided
    assert PL.kl_default_clamp("k3") == 10.0 and PL.kl_default_clamp("k1") is None


def test_bad_arguments_raise_with_the_choices():
    logp, old, ref, adv, mask = _inputs()
    with pytest.raises(UnknownNameError, match="valid: ppo_clip, gspo, cispo"):
        fused_policy_loss(logp, old, adv, mask, loss="sapo")
    with pytest.raises(UnknownNameError, match="valid: token_mean"):
        fused_policy_loss(logp, old, adv, mask, agg="mean")
    with pytest.raises(ConfigError, match="dual_clip applies to ppo_clip only"):
        fused_policy_loss(logp, old, adv, mask, loss="gspo", dual_clip=3.0)
    with pytest.raises(ConfigError, match="norm=2.0 applies only"):
        fused_policy_loss(logp, old, adv, mask, norm=2.0)
    with pytest.raises(ConfigError, match="denom must be >= 0"):
        fused_policy_loss(logp, old, adv, mask, denom=-1)
    with pytest.raises(ShapeError, match="advantages must be"):
        fused_policy_loss(logp, old, adv[:, :2], mask)


def test_supports_reports_why_not():
    expected = (False, "loss 'sapo' has no fused kernel (fused: ppo_clip, gspo, cispo)")
    assert PL.supports("policy_loss", {"loss": "sapo"}) == expected
    ok, why = PL.supports("policy_loss", {"loss": "ppo_clip", "agg": "token_mean", "kl": "low_var_kl", "tau": 1.0})
    assert not ok and "['tau']" in why
    assert PL.supports("value_loss", {})[0] is False


@pytest.mark.mojo
def test_learner_contract_matches_the_compilers_torch_path():
    from materl.compiler.kinds import losses as kernel_impls
    params = {"loss": "ppo_clip", "agg": "token_mean", "kl": "k3", "kl_coef": 0.05, "norm": None,
              "eps_low": 0.2, "eps_high": 0.28}
    node = SimpleNamespace(params=params, op="policy_loss")
    assert PL.supports("policy_loss", params) == (True, "")
    logp, old, ref, adv, mask = _inputs(seed=9)
    v1, g1, m1 = _run(lambda lp, *a, **k: PL.learner_policy_loss(node, lp, *a, **k), logp, old, adv, mask, ref,
                      denom=40.0)
    v2, g2, m2 = _run(lambda lp, *a, **k: kernel_impls.torch_policy_loss(node, lp, *a, **k), logp, old, adv, mask,
                      ref, denom=40.0)
    _close(v1, v2, 1e-10)
    torch.testing.assert_close(g1, g2, rtol=1e-9, atol=1e-12)
    assert m1.keys() == m2.keys()
    for k in m2:  # the compiler's metrics are float32 masked means
        _close(m1[k], m2[k], 1e-6)


@pytest.mark.mojo
def test_grid_of_denominators_matches_micro_batch_accumulation():
    """With the full batch's denominator, micro-batch losses sum to the full-batch loss."""
    logp, old, ref, adv, mask = _inputs(seed=12)
    for agg in AGGS:
        full, _ = fused_policy_loss(logp, old, adv, mask, agg=agg, impl="mojo")
        if agg == "token_sum":
            continue
        d = float(mask.sum()) if agg == "token_mean" else float((mask.sum(-1) > 0).sum())
        parts = [fused_policy_loss(logp[s], old[s], adv[s], mask[s], agg=agg, denom=d, impl="mojo",
                                   norm=T if agg.endswith("norm") else None)[0]
                 for s in (slice(0, 2), slice(2, B))]
        _close(sum(parts), full, 1e-10)

