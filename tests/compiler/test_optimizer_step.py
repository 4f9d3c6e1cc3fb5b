"""The optimizer step's gradient clipping equals torch's clip_grad_norm_ bit for bit."""

import math

import pytest
import torch

from materl.compiler.compiled import clip_grad_norm


def _params(scale: float) -> list[torch.Tensor]:
    torch.manual_seed(0)
    params = [torch.zeros(5, 3, requires_grad=True), torch.zeros(7, requires_grad=True),
              torch.zeros(2, requires_grad=True)]
    for p in params:
        p.grad = torch.randn(p.shape) * scale
    params[2].grad = None  # a parameter that got no gradient this step
    return params


@pytest.mark.parametrize("scale", [1e-3, 10.0, float("nan")])
def test_clip_matches_torch_bit_for_bit(scale):
    ours, theirs = _params(scale), _params(scale)
    if math.isnan(scale):  # one NaN gradient: torch scales every gradient by a NaN coefficient
        ours[0].grad[0, 0] = theirs[0].grad[0, 0] = float("nan")
    norm = clip_grad_norm(ours, 1.0)
    expected = float(torch.nn.utils.clip_grad_norm_(theirs, 1.0))
    assert (math.isnan(norm) and math.isnan(expected)) or norm == expected
    for a, b in zip(ours, theirs):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            assert torch.equal(a.grad.nan_to_num(7.0), b.grad.nan_to_num(7.0))


def test_small_gradients_are_left_untouched_and_large_ones_scaled_to_max_norm():
    small = _params(1e-3)
    before = [p.grad.clone() for p in small[:2]]
    clip_grad_norm(small, 1.0)
    assert all(torch.equal(p.grad, b) for p, b in zip(small[:2], before))
    large = _params(10.0)
    norm = clip_grad_norm(large, 1.0)
    assert norm > 1.0
    after = torch.cat([p.grad.flatten() for p in large[:2]]).norm()
    assert after == pytest.approx(1.0, rel=1e-5)  # max_norm / (norm + 1e-6) * norm
