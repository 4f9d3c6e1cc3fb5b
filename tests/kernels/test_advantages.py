"""Group advantage kernel (grpo, rloo) against materl.ops.advantages."""

import math

import pytest
import torch

from materl.errors import ConfigError, RewardError
from materl.kernels.advantages import group_advantages
from materl.ops.advantages import ADVANTAGES
from tests.kernels.conftest import uneven_mask

IMPLS = ["torch", pytest.param("mojo", marks=pytest.mark.mojo)]
GROUP_IDS = ["a", "a", "b", "c", "c", "c", "a", "d", "d", "e"]  # e and b are singletons


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("estimator,scale", [("grpo", "group"), ("grpo", "batch"), ("grpo", "none"), ("rloo", "group")])
def test_equals_the_op_with_outcome_rewards(impl, estimator, scale):
    scores = torch.randn(len(GROUP_IDS), dtype=torch.float64)
    mask = uneven_mask(len(GROUP_IDS), 7)
    hp = {"scale": scale} if estimator == "grpo" else {}
    expected, _ = ADVANTAGES.get(estimator)(scores, mask, group_ids=GROUP_IDS, **hp)
    got = group_advantages(scores, mask, estimator=estimator, group_ids=GROUP_IDS, scale=scale, impl=impl)
    assert torch.equal(got, expected)
    per_row = group_advantages(scores, estimator=estimator, group_ids=GROUP_IDS, scale=scale, impl=impl)
    rows = mask.sum(-1) > 0
    assert torch.equal(per_row[rows], expected[rows, 0])


@pytest.mark.parametrize("impl", IMPLS)
def test_hand_computed(impl):
    scores = torch.tensor([1.0, 3.0, 5.0, 4.0], dtype=torch.float64)  # groups of 2: (1, 3), (5, 4)
    # grpo: mean 2, unbiased std sqrt(2) -> -+1/(sqrt 2 + eps); (5,4): mean 4.5, std sqrt(0.5)
    eps = 1e-6
    adv = group_advantages(scores, estimator="grpo", group_size=2, eps=eps, impl=impl)
    s1, s2 = math.sqrt(2) + eps, math.sqrt(0.5) + eps
    assert adv.tolist() == pytest.approx([-1 / s1, 1 / s1, 0.5 / s2, -0.5 / s2], rel=1e-12)
    # rloo: baseline is the other member: 1-3, 3-1, 5-4, 4-5
    assert group_advantages(scores, estimator="rloo", group_size=2, impl=impl).tolist() == [-2.0, 2.0, 1.0, -1.0]
    # a singleton keeps its score (grpo: mean 0, std 1 -> s / (1 + eps); rloo: baseline 0)
    single = torch.tensor([2.0], dtype=torch.float64)
    assert group_advantages(single, estimator="grpo", group_size=1, impl=impl).tolist() == [2.0 / (1 + eps)]
    assert group_advantages(single, estimator="rloo", group_size=1, impl=impl).tolist() == [2.0]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_a_group_of_equal_scores_gets_exactly_zero(impl, estimator):
    # mean(0.1, 0.1, 0.1) summed in two passes is 0.10000000000000002; divided by std + eps that
    # residue used to be ~1e-11 (grpo) and the leave-one-out (3 * mean - 0.1) / 2 was not 0.1
    scores = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7], dtype=torch.float64)
    adv = group_advantages(scores, estimator=estimator, group_ids="aaabb", impl=impl)
    assert adv.tolist() == [0.0] * 5


@pytest.mark.mojo
def test_float32_scores_keep_their_dtype():
    scores = torch.randn(12)
    mask = uneven_mask(12, 5, torch.float32)
    got = group_advantages(scores, mask, group_size=4, impl="mojo")
    expected, _ = ADVANTAGES.get("grpo")(scores, mask, group_size=4)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_bad_inputs():
    with pytest.raises(ConfigError, match="valid: grpo, rloo"):
        group_advantages(torch.zeros(2), estimator="opo", group_size=2)
    with pytest.raises(ConfigError, match="grpo only"):
        group_advantages(torch.zeros(2), estimator="rloo", scale="none", group_size=2)
    with pytest.raises(RewardError, match=r"rows \[1\]"):
        group_advantages(torch.tensor([0.0, float("nan")]), group_size=2)
