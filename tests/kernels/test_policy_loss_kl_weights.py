"""The fused policy-loss kernel's KL settings (clamp off or changed, TRL's bias-corrected KL) and
per-token weights (off-policy corrections) against the op path, TRL's loss, and the compiler's
node contract."""

from types import SimpleNamespace

import pytest
import torch

from materl.compiler.kinds import losses as kinds
from materl.errors import ConfigError, ShapeError
from materl.kernels import policy_loss as PL
from materl.kernels.policy_loss import fused_policy_loss, policy_loss_torch
from materl.ops.kl import ESTIMATOR_DEFAULT
from materl.ops.offpolicy import CORRECTIONS
from tests.kernels.conftest import uneven_mask
from tests.ops.test_kl_trl import trl_grpo_loss
from tests.tolerance import assert_close_to_scale

B, T = 6, 9


def _inputs(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = (torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5 - 1.0).to(dtype).requires_grad_()
    old = logp.detach() + (torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3).to(dtype)
    ref = logp.detach() + (torch.randn(B, T, generator=g, dtype=torch.float64) * 0.9).to(dtype)
    ref[0, 0] = logp[0, 0].detach() + 3.5  # k3 = e^3.5 - 4.5 = 28.6: the clamp matters
    ref[3, 2] = logp[3, 2].detach() + 25.0  # beyond the [-20, 20] log-ratio bound of k3
    old[1, 1] = logp[1, 1].detach() - 21.0  # beyond the ratio's [-20, 20] bound
    adv = torch.randn(B, T, generator=g, dtype=torch.float64).to(dtype)
    prox = old + (torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    return logp, old, ref, adv, uneven_mask(B, T, dtype), prox


def _run(fn, logp, *args, **kw):
    logp.grad = None
    value, metrics = fn(logp, *args, **kw)
    value.backward()
    return value.detach(), logp.grad.clone(), metrics


def _close(a, b, tol):
    assert abs(float(a) - float(b)) <= tol * (1 + abs(float(b))), (float(a), float(b))


LOSSES = [("ppo_clip", {}), ("ppo_clip", {"dual_clip": 2.0}), ("gspo", {"eps_low": 0.05, "eps_high": 0.08}),
          ("cispo", {})]
KL_SETTINGS = [(ESTIMATOR_DEFAULT, False), (None, False), (None, True), (5.0, True), (ESTIMATOR_DEFAULT, True)]


@pytest.mark.mojo
@pytest.mark.parametrize("loss,hp", LOSSES)
@pytest.mark.parametrize("clamp,bias", KL_SETTINGS)
@pytest.mark.parametrize("kl", ["k3", "k1", "k3_plus"])
def test_kl_settings_equal_the_op_path(loss, hp, clamp, bias, kl):
    for agg, coef in (("token_mean", 0.1), ("seq_mean_token_mean", 0.5)):
        logp, old, ref, adv, mask, _ = _inputs(seed=len(agg))
        kw = dict(ref_logp=ref, loss=loss, agg=agg, kl=kl, kl_coef=coef, kl_clamp=clamp, kl_bias_correction=bias, **hp)
        v1, g1, m1 = _run(fused_policy_loss, logp, old, adv, mask, impl="mojo", **kw)
        v2, g2, m2 = _run(policy_loss_torch, logp, old, adv, mask, **kw)
        _close(v1, v2, 1e-10)
        torch.testing.assert_close(g1, g2, rtol=1e-9, atol=1e-12)
        assert m1.keys() == m2.keys()
        for k in m2:
            _close(m1[k], m2[k], 1e-10)


@pytest.mark.mojo
@pytest.mark.parametrize("loss,hp", LOSSES)
@pytest.mark.parametrize("method,chp", [("tis", {"cap": 1.5}), ("mis", {"upper": 1.6, "level": "sequence"}),
                                        ("decoupled", {"cap": 1.3})])
def test_correction_weights_equal_the_op_path(loss, hp, method, chp):
    logp, old, ref, adv, mask, prox = _inputs(seed=4)
    w, _ = CORRECTIONS.get(method)(prox, old, mask, **chp)
    assert (w[mask > 0] == 0).any() or (w[mask > 0] != w[mask > 0].round()).any()
    for agg in ("token_mean", "seq_mean_token_sum"):
        kw = dict(ref_logp=ref, weights=w, loss=loss, agg=agg, kl="k3", kl_coef=0.05, **hp)
        v1, g1, m1 = _run(fused_policy_loss, logp, prox, adv, mask, impl="mojo", **kw)
        v2, g2, m2 = _run(policy_loss_torch, logp, prox, adv, mask, **kw)
        _close(v1, v2, 1e-10)
        torch.testing.assert_close(g1, g2, rtol=1e-9, atol=1e-12)
        for k in m2:
            _close(m1[k], m2[k], 1e-10)


@pytest.mark.mojo
def test_weights_scale_each_tokens_loss_and_gradient_by_hand():
    # ppo_clip at r = 1 (logp = old), A = 1, token_sum: l_t = -w_t, dl/dlogp_t = -w_t
    logp = torch.full((1, 3), -1.0, dtype=torch.float64, requires_grad=True)
    w = torch.tensor([[2.0, 0.0, 0.5]], dtype=torch.float64)
    value, grad, _ = _run(fused_policy_loss, logp, logp.detach().clone(), torch.ones(1, 3, dtype=torch.float64),
                          torch.ones(1, 3, dtype=torch.float64), weights=w, agg="token_sum", impl="mojo")
    assert value.item() == pytest.approx(-2.5)
    assert grad.tolist() == [[-2.0, -0.0, -0.5]]


@pytest.mark.mojo
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("agg,loss_type", [("token_mean", "bnpo"), ("seq_mean_token_mean", "grpo")])
def test_kernel_equals_trls_loss_with_its_kl(dtype, tol, agg, loss_type):
    """TRL 1.16's default KL (k3 unclamped, bias-corrected) in the Mojo kernel, value and gradient."""
    logp, old, ref, adv, mask, _ = _inputs(dtype=dtype, seed=7)
    ref[3, 2] = logp[3, 2].detach() + 4.0  # stay inside the +-20 bound TRL does not have
    old[1, 1] = logp[1, 1].detach() - 0.4
    mask[mask.sum(-1) == 0, 0] = 1.0  # TRL's "grpo" mean counts empty rows, materl's does not: none here
    adv_b = adv[:, 0]
    v1, g1, m1 = _run(fused_policy_loss, logp, old, adv_b, mask, ref_logp=ref, agg=agg, kl="k3", kl_coef=0.04,
                      kl_clamp=None, kl_bias_correction=True, impl="mojo")
    logp.grad = None
    v2, per_token_kl = trl_grpo_loss(logp, old, ref, adv_b, mask, beta=0.04, loss_type=loss_type)
    v2.backward()
    _close(v1, v2.detach(), tol)
    assert_close_to_scale(g1, logp.grad, rel=tol)
    _close(m1["kl"], (per_token_kl.detach().double() * mask).sum() / mask.sum(), tol)


def test_supports_accepts_the_kl_settings_and_a_correction():
    params = {"loss": "ppo_clip", "agg": "seq_mean_token_mean", "kl": "k3", "kl_coef": 0.04, "kl_clamp": None,
              "kl_bias_correction": True, "correction": {"method": "tis", "cap": 2.0, "level": "token"}}
    ok, why = PL.supports("policy_loss", params)
    assert ok or why.startswith("Mojo kernel unavailable"), why


@pytest.mark.mojo
def test_learner_contract_with_kl_settings_and_weights():
    params = {"loss": "ppo_clip", "agg": "token_mean", "kl": "k3", "kl_coef": 0.05, "kl_clamp": None,
              "kl_bias_correction": True, "correction": {"method": "mis", "upper": 1.5, "lower": 0.7,
                                                         "level": "token"}}
    node = SimpleNamespace(params=params, op="policy_loss")
    assert PL.supports("policy_loss", params) == (True, "")
    logp, old, ref, adv, mask, prox = _inputs(seed=9)
    w, _ = kinds.correction_weights(node, prox, old, mask)
    v1, g1, m1 = _run(lambda lp, *a, **k: PL.learner_policy_loss(node, lp, *a, **k), logp, prox, adv, mask, ref,
                      denom=40.0, weights=w)
    v2, g2, m2 = _run(lambda lp, *a, **k: kinds.torch_policy_loss(node, lp, *a, **k), logp, prox, adv, mask, ref,
                      denom=40.0, weights=w)
    _close(v1, v2, 1e-10)
    torch.testing.assert_close(g1, g2, rtol=1e-9, atol=1e-12)
    for k in m2:
        _close(m1[k], m2[k], 1e-6)


def test_bad_settings_raise():
    logp, old, ref, adv, mask, _ = _inputs()
    with pytest.raises(ConfigError, match="kl_clamp must be > 0 or None; got 0"):
        fused_policy_loss(logp, old, adv, mask, ref_logp=ref, kl_clamp=0)
    with pytest.raises(ShapeError, match="weights"):
        fused_policy_loss(logp, old, adv, mask, weights=mask[:, :3])
