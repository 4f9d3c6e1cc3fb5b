"""Loss aggregation: hand values, equality with verl agg_loss, micro-batch accumulation with a
global denominator, padding invariance (hypothesis) and error paths."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from materl.errors import ConfigError, ShapeError, UnknownNameError
from materl.ops.aggregate import LOSS_AGG, agg_denominator, aggregate

F64 = torch.float64
MODES = ["token_mean", "token_sum", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


def t(*rows):
    return torch.tensor(rows, dtype=F64)


def verl_agg_loss(loss_mat, loss_mask, mode, loss_scale_factor=None):
    """Naive transcription of verl core_algos.agg_loss (dp_size=1, no global batch info)."""
    if mode == "token-mean":
        return (loss_mat * loss_mask).sum() / loss_mask.sum()
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        loss = (seq_losses * seq_mask).sum() / seq_mask.sum()
        if mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    seq_mask = torch.sum(loss_mask, dim=-1)
    seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
    seq_mask = (seq_mask > 0).float()
    return (seq_losses * seq_mask).sum() / seq_mask.sum()


def batch(seed=0, lengths=(6, 3, 1, 0, 5), T=6):
    """Uneven rows: a length-1 row and a fully masked row; the padding holds large garbage."""
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(len(lengths), T, generator=g, dtype=F64)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).to(F64)
    loss = torch.where(mask > 0, loss, torch.full_like(loss, 1e6))
    return loss.requires_grad_(True), mask


def test_hand_values():
    # loss [[1,2,3],[4,5,6],[7,8,9]], mask [[1,1,0],[1,0,0],[0,0,0]] (third row empty)
    # token_mean = (1+2+4)/3 = 7/3          token_sum = 7
    # seq sums [3, 4]; 2 non-empty rows:    seq_mean_token_sum = 7/2 = 3.5
    # seq means [1.5, 4]:                   seq_mean_token_mean = 5.5/2 = 2.75
    # seq_mean_token_sum_norm = 3.5 / T = 3.5/3;  with norm = 10: 0.35
    loss = t([1, 2, 3], [4, 5, 6], [7, 8, 9])
    mask = t([1, 1, 0], [1, 0, 0], [0, 0, 0])
    expect = {"token_mean": 7 / 3, "token_sum": 7.0, "seq_mean_token_sum": 3.5,
              "seq_mean_token_mean": 2.75, "seq_mean_token_sum_norm": 3.5 / 3}
    for mode, value in expect.items():
        assert LOSS_AGG.get(mode)(loss, mask).item() == pytest.approx(value), mode
    assert LOSS_AGG.get("seq_mean_token_sum_norm")(loss, mask, norm=10).item() == pytest.approx(0.35)
    # denom overrides: token_mean with denom 14 -> 7/14;  seq_mean_token_mean with denom 4 -> 5.5/4
    assert LOSS_AGG.get("token_mean")(loss, mask, denom=14).item() == pytest.approx(0.5)
    assert LOSS_AGG.get("seq_mean_token_mean")(loss, mask, denom=4).item() == pytest.approx(1.375)


@pytest.mark.parametrize("mode,verl_mode", [
    ("token_mean", "token-mean"), ("seq_mean_token_sum", "seq-mean-token-sum"),
    ("seq_mean_token_mean", "seq-mean-token-mean"), ("seq_mean_token_sum_norm", "seq-mean-token-sum-norm"),
])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_value_and_gradient_equal_verl(mode, verl_mode, seed):
    loss, mask = batch(seed)
    ours, ref = LOSS_AGG.get(mode)(loss, mask), verl_agg_loss(loss, mask, verl_mode)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-9)
    g_ours, g_ref = (torch.autograd.grad(x, loss)[0] for x in (ours, ref))
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_with_global_denom_sum_to_the_full_batch(mode):
    loss, mask = batch(3)
    full = LOSS_AGG.get(mode)(loss, mask)
    denom = agg_denominator(mode, mask)
    micro = sum(LOSS_AGG.get(mode)(loss[rows], mask[rows], denom=denom)
                for rows in (slice(0, 2), slice(2, 4), slice(4, 5)))  # rows 2 (len 1) and 3 (empty) together
    torch.testing.assert_close(micro, full, rtol=1e-12, atol=1e-12)
    g_full, g_micro = (torch.autograd.grad(x, loss)[0] for x in (full, micro))
    torch.testing.assert_close(g_micro, g_full, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_padded_to_their_own_length(mode):
    # each micro-batch trimmed to its longest row (as a packer would); Dr.GRPO's norm stays constant
    loss, mask = batch(5)
    norm = {"norm": 6.0} if mode == "seq_mean_token_sum_norm" else {}
    full = LOSS_AGG.get(mode)(loss, mask, **norm)
    denom = agg_denominator(mode, mask)
    parts = [(slice(0, 1), 6), (slice(1, 3), 3), (slice(3, 5), 5)]
    micro = sum(LOSS_AGG.get(mode)(loss[r, :w], mask[r, :w], denom=denom, **norm) for r, w in parts)
    torch.testing.assert_close(micro, full, rtol=1e-12, atol=1e-12)


def test_agg_denominator_values():
    # lengths (6, 3, 1, 0, 5): 15 tokens, 4 non-empty rows
    _, mask = batch(0)
    assert agg_denominator("token_mean", mask).item() == 15
    assert agg_denominator("seq_mean_token_mean", mask).item() == 4
    assert agg_denominator("token_sum", mask).item() == 1
    assert agg_denominator("seq_mean_token_sum", mask.bool()).item() == 4


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    B=st.integers(1, 4),
    T=st.integers(1, 6),
    pad_cols=st.integers(0, 3),
    pad_rows=st.integers(0, 2),
    mode=st.sampled_from(MODES),
    garbage=st.sampled_from([0.0, 1e9, math.inf, math.nan]),
)
def test_padding_never_changes_an_aggregate(seed, B, T, pad_cols, pad_rows, mode, garbage):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(B, T, generator=g, dtype=F64)
    mask = (torch.rand(B, T, generator=g) < 0.7).to(F64)
    padded_loss = torch.full((B + pad_rows, T + pad_cols), garbage, dtype=F64)
    padded_loss[:B, :T] = loss
    padded_mask = torch.zeros(B + pad_rows, T + pad_cols, dtype=F64)
    padded_mask[:B, :T] = mask
    norm = {"norm": 8.0} if mode == "seq_mean_token_sum_norm" else {}  # default norm is T: padding-dependent
    a = LOSS_AGG.get(mode)(loss, mask, **norm)
    b = LOSS_AGG.get(mode)(padded_loss, padded_mask, **norm)
    assert torch.isfinite(b)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_empty_mask_gives_zero_not_nan(mode):
    loss = torch.tensor([[1.0, math.nan], [math.inf, 2.0]], dtype=F64, requires_grad=True)
    mask = torch.zeros(2, 2, dtype=F64)
    out = LOSS_AGG.get(mode)(loss, mask)
    assert out.item() == 0.0
    (grad,) = torch.autograd.grad(out, loss)
    assert torch.all(grad == 0)
    assert LOSS_AGG.get(mode)(loss, mask, denom=agg_denominator(mode, mask)).item() == 0.0


def test_aggregate_front_door_and_registry():
    loss, mask = batch(0)
    assert LOSS_AGG.names() == sorted(MODES)
    assert aggregate(loss, mask, mode="seq_mean_token_mean") == LOSS_AGG.get("seq_mean_token_mean")(loss, mask)


def test_unknown_mode_suggests_the_underscore_name():
    with pytest.raises(UnknownNameError, match=r"unknown loss_agg 'token-mean'.*Did you mean 'token_mean'"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), mode="token-mean")
    with pytest.raises(UnknownNameError, match="valid: seq_mean_token_mean"):
        agg_denominator("nope", torch.ones(1, 1))


def test_shape_and_config_errors():
    with pytest.raises(ShapeError, match=r"loss\[2, 3\], mask\[2, 2\]"):
        LOSS_AGG.get("token_mean")(torch.zeros(2, 3), torch.ones(2, 2))
    with pytest.raises(ShapeError, match="takes \\(B,T\\)"):
        LOSS_AGG.get("token_mean")(torch.zeros(3), torch.ones(3))
    with pytest.raises(ConfigError, match="norm=5 applies only to seq_mean_token_sum_norm, not token_mean"):
        LOSS_AGG.get("token_mean")(torch.zeros(1, 1), torch.ones(1, 1), norm=5)
    with pytest.raises(ConfigError, match="norm must be > 0; got 0"):
        LOSS_AGG.get("seq_mean_token_sum_norm")(torch.zeros(1, 1), torch.ones(1, 1), norm=0)
    with pytest.raises(ConfigError, match="denom must be >= 0"):
        LOSS_AGG.get("token_mean")(torch.zeros(1, 1), torch.ones(1, 1), denom=-1)
