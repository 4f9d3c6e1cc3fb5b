import math

import pytest
import torch
import torch.nn.functional as F

from materl.errors import ConfigError, ShapeError, UnknownNameError
from materl.ops.preference import (
    LENGTH_NORMALISED,
    PREFERENCE_LOSSES,
    REFERENCE_FREE,
    PreferenceOut,
    sequence_logps,
)


def _trl_dpo(loss_type, token_c, token_r, tref_c, tref_r, mask_c, mask_r, *, beta, label_smoothing=0.0):
    """TRL 1.16 DPOTrainer._compute_loss, transcribed (reverse_kl, ld_alpha=None): the per-token
    log-probs are summed; ipo divides each log-ratio by its completion's token count."""
    chosen_logps, rejected_logps = (token_c * mask_c).sum(1), (token_r * mask_r).sum(1)
    ref_chosen_logps, ref_rejected_logps = (tref_c * mask_c).sum(1), (tref_r * mask_r).sum(1)
    chosen_scores = chosen_logps - ref_chosen_logps
    rejected_scores = rejected_logps - ref_rejected_logps
    delta_score = chosen_scores - rejected_scores
    if loss_type == "sigmoid":
        loss = -F.logsigmoid(beta * delta_score)
    elif loss_type == "hinge":
        loss = torch.relu(1 - beta * delta_score)
    elif loss_type == "ipo":
        ipo_delta = chosen_scores / mask_c.sum(1).clamp(min=1.0) - rejected_scores / mask_r.sum(1).clamp(min=1.0)
        loss = (ipo_delta - 1 / (2 * beta)) ** 2
    elif loss_type == "robust":
        clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta_score)
        flipped = -label_smoothing * F.logsigmoid(-beta * delta_score)
        loss = (clean - flipped) / (1 - 2 * label_smoothing)
    return loss.mean(), beta * chosen_scores.detach(), beta * rejected_scores.detach()


def _trl_simpo(token_c, token_r, mask_c, mask_r, *, beta, gamma, label_smoothing):
    """TRL 1.16 CPOTrainer.cpo_loss (loss_type="simpo", alpha=0) on get_batch_logps(average_log_prob=True)."""
    c, r = (token_c * mask_c).sum(-1) / mask_c.sum(-1), (token_r * mask_r).sum(-1) / mask_r.sum(-1)
    logits = (c - r) - gamma / beta
    losses = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    return losses.mean(), beta * c.detach(), beta * r.detach()


def _batch():
    g = torch.Generator().manual_seed(3)
    B, T = 4, 6
    tok = [-torch.rand(B, T, generator=g, dtype=torch.float64) * 3 for _ in range(4)]
    # completion lengths differ per row (chosen 6, 3, 5, 1; rejected 2, 6, 3, 4) so ipo's / simpo's
    # length normalisation matters
    lengths_c, lengths_r = torch.tensor([6, 3, 5, 1]), torch.tensor([2, 6, 3, 4])
    mask_c = (torch.arange(T) < lengths_c[:, None]).double()
    mask_r = (torch.arange(T) < lengths_r[:, None]).double()
    return tok, mask_c, mask_r


@pytest.mark.parametrize(
    "loss_type,kw", [("sigmoid", {}), ("hinge", {}), ("ipo", {}), ("robust", {"label_smoothing": 0.2})]
)
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_family_matches_trl_loss_and_gradient(loss_type, kw, beta):
    tok, mask_c, mask_r = _batch()
    ours_in = [t.clone().requires_grad_() for t in tok]
    trl_in = [t.clone().requires_grad_() for t in tok]
    average = loss_type in LENGTH_NORMALISED
    c, r = sequence_logps(ours_in[0], mask_c, average=average), sequence_logps(ours_in[1], mask_r, average=average)
    rc, rr = sequence_logps(ours_in[2], mask_c, average=average), sequence_logps(ours_in[3], mask_r, average=average)
    out = PREFERENCE_LOSSES.get(loss_type)(c, r, rc, rr, beta=beta, **kw)
    assert isinstance(out, PreferenceOut) and out.losses_B.shape == (4,)
    loss, trl_cr, trl_rr = _trl_dpo(loss_type, *trl_in, mask_c, mask_r, beta=beta, **kw)
    torch.testing.assert_close(out.losses_B.mean(), loss, rtol=0, atol=1e-6)
    ours_g = torch.autograd.grad(out.losses_B.mean(), ours_in)
    trl_g = torch.autograd.grad(loss, trl_in)
    for a, b in zip(ours_g, trl_g):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    if loss_type != "ipo":  # ipo rewards are beta * mean log-ratio here (documented difference)
        torch.testing.assert_close(out.chosen_rewards_B, trl_cr, rtol=0, atol=1e-12)
        torch.testing.assert_close(out.rejected_rewards_B, trl_rr, rtol=0, atol=1e-12)
    assert not out.chosen_rewards_B.requires_grad


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_simpo_matches_trl_cpo_simpo(label_smoothing):
    tok, mask_c, mask_r = _batch()
    ours_in = [t.clone().requires_grad_() for t in tok[:2]]
    trl_in = [t.clone().requires_grad_() for t in tok[:2]]
    c, r = sequence_logps(ours_in[0], mask_c, average=True), sequence_logps(ours_in[1], mask_r, average=True)
    out = PREFERENCE_LOSSES.get("simpo")(c, r, None, None, beta=2.0, gamma=1.0, label_smoothing=label_smoothing)
    loss, trl_c, trl_r = _trl_simpo(*trl_in, mask_c, mask_r, beta=2.0, gamma=1.0, label_smoothing=label_smoothing)
    torch.testing.assert_close(out.losses_B.mean(), loss, rtol=0, atol=1e-6)
    for a, b in zip(torch.autograd.grad(out.losses_B.mean(), ours_in), torch.autograd.grad(loss, trl_in)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.chosen_rewards_B, trl_c)
    torch.testing.assert_close(out.rejected_rewards_B, trl_r)
    assert "simpo" in REFERENCE_FREE and "simpo" in LENGTH_NORMALISED


def _pair(c, r, rc, rr):
    return [torch.tensor([v], dtype=torch.float64) for v in (c, r, rc, rr)]


def test_hand_computed_values():
    # log-ratios: chosen -1 - (-2) = 1, rejected -3 - (-2) = -1, delta = 2.
    args = _pair(-1.0, -3.0, -2.0, -2.0)
    # sigmoid, beta=0.5: -log sigmoid(1) = log(1 + e^-1) = 0.31326...
    out = PREFERENCE_LOSSES.get("sigmoid")(*args, beta=0.5)
    assert out.losses_B.item() == pytest.approx(math.log1p(math.exp(-1)), abs=1e-12)
    assert (out.chosen_rewards_B.item(), out.rejected_rewards_B.item()) == (0.5, -0.5)
    # hinge, beta=0.25: relu(1 - 0.5) = 0.5; beta=0.5: relu(1 - 1) = 0
    assert PREFERENCE_LOSSES.get("hinge")(*args, beta=0.25).losses_B.item() == pytest.approx(0.5)
    assert PREFERENCE_LOSSES.get("hinge")(*args, beta=0.5).losses_B.item() == 0.0
    # ipo, beta=0.1: (2 - 1/0.2)^2 = (2 - 5)^2 = 9
    assert PREFERENCE_LOSSES.get("ipo")(*args, beta=0.1).losses_B.item() == pytest.approx(9.0)
    # robust, beta=0.5, eps=0.25: (-(0.75) log s(1) + 0.25 log s(-1)) / 0.5
    #   log s(1) = -0.313262, log s(-1) = -1.313262 -> (0.234946 - 0.328315) / 0.5 = -0.186738
    rob = PREFERENCE_LOSSES.get("robust")(*args, beta=0.5, label_smoothing=0.25).losses_B.item()
    assert rob == pytest.approx((0.75 * math.log1p(math.exp(-1)) - 0.25 * math.log1p(math.exp(1))) / 0.5)
    assert rob == pytest.approx(-0.186738, abs=1e-6)
    # robust with eps=0 is sigmoid
    assert PREFERENCE_LOSSES.get("robust")(*args, beta=0.5).losses_B.item() == pytest.approx(out.losses_B.item())
    # simpo, beta=2, gamma=1: z = 2 * (-1 - (-3)) - 1 = 3; loss = log(1 + e^-3) = 0.048587; refs ignored
    sim = PREFERENCE_LOSSES.get("simpo")(args[0], args[1], beta=2.0, gamma=1.0)
    assert sim.losses_B.item() == pytest.approx(math.log1p(math.exp(-3)), abs=1e-12)
    assert (sim.chosen_rewards_B.item(), sim.rejected_rewards_B.item()) == (-2.0, -6.0)


def test_sequence_logps_sum_and_mean():
    logp = torch.tensor([[-1.0, -2.0, -9.0], [-4.0, -4.0, -4.0], [-5.0, -5.0, -5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    # row 0: -1 - 2 = -3 (the -9 is masked); mean -1.5. Row 2 all masked: 0 in both modes.
    assert sequence_logps(logp, mask).tolist() == [-3.0, -12.0, 0.0]
    assert sequence_logps(logp, mask, average=True).tolist() == [-1.5, -4.0, 0.0]


def test_errors_name_the_value_and_choices():
    args = _pair(-1.0, -3.0, -2.0, -2.0)
    with pytest.raises(UnknownNameError, match="'dpo'.*valid: hinge, ipo, robust, sigmoid, simpo"):
        PREFERENCE_LOSSES.get("dpo")
    with pytest.raises(ConfigError, match="label_smoothing < 0.5, got 0.5"):
        PREFERENCE_LOSSES.get("robust")(*args, label_smoothing=0.5)
    with pytest.raises(ConfigError, match="beta > 0, got beta=0"):
        PREFERENCE_LOSSES.get("ipo")(*args, beta=0)
    with pytest.raises(ShapeError, match="shapes must match"):
        PREFERENCE_LOSSES.get("sigmoid")(torch.zeros(2), torch.zeros(3), torch.zeros(2), torch.zeros(2))
    with pytest.raises(ShapeError, match=r"\(B,\)"):
        PREFERENCE_LOSSES.get("hinge")(*(torch.zeros(2, 3) for _ in range(4)))
