"""logprob_delta: |sampling log-prob - recomputed log-prob| over the trained tokens."""

import pytest
import torch

from materl.engines.numerics import logprob_delta
from materl.errors import ShapeError


def test_mean_and_max_over_masked_tokens_only():
    sampled = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, 9.0]])
    recomputed = torch.tensor([[-1.5, -2.0, -2.0], [-0.5, -0.5, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # the 9.0 vs 0.0 token is padding
    # |deltas| of the 5 masked tokens: 0.5, 0, 1, 0, 0.25 -> mean 1.75 / 5 = 0.35, max 1
    d = logprob_delta(sampled, recomputed, mask)
    assert d.tokens == 5 and d.max == 1.0 and abs(d.mean - 0.35) < 1e-12
    assert d.metrics() == {"logprob_delta/mean": d.mean, "logprob_delta/max": 1.0}


def test_differences_are_taken_in_float64():
    # float32 log-probs 1e-7 apart near -20: float32 subtraction keeps the gap, reported exactly
    a = torch.tensor([[-20.0]], dtype=torch.float32)
    b = a.nextafter(torch.tensor(0.0))
    d = logprob_delta(a, b, torch.ones(1, 1))
    assert d.max == (b.double() - a.double()).abs().item() > 0


def test_empty_mask_and_bad_shapes():
    assert logprob_delta(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3)).tokens == 0
    with pytest.raises(ShapeError, match=r"sampled \(2, 3\), recomputed \(2, 4\)"):
        logprob_delta(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
