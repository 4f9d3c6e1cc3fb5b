"""materl.ops.distill: on-policy distillation's per-token advantages, by hand (tinker-cookbook's
``incorporate_kl_penalty`` and ``discounted_future_sum_vectorized``), in float64."""

import pytest
import torch

from materl.errors import ConfigError, ShapeError
from materl.ops.distill import discounted_future_sum, distill_advantages

# one row: tokens 0, 1 and 3 sampled by the student; token 2 is tool output (mask 0)
STUDENT = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], dtype=torch.float64)
TEACHER = torch.tensor([[-1.5, -1.0, -0.5, -1.0]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 0.0, 1.0]], dtype=torch.float64)


def test_the_advantage_is_the_negative_reverse_kl_per_sampled_token():
    adv, rkl = distill_advantages(STUDENT, TEACHER, MASK)
    # reverse KL = student - teacher: 0.5, -1.0, (masked), -2.0
    assert rkl.tolist() == [[0.5, -1.0, 0.0, -2.0]]
    assert adv.tolist() == [[-0.5, 1.0, 0.0, 2.0]]


def test_discount_sums_future_kl_over_every_position_as_tinker_does():
    adv, _ = distill_advantages(STUDENT, TEACHER, MASK, discount=0.5)
    # a = -0.5, 1.0, 0 (tool token: contributes 0 but is a position), 2.0
    # A_3 = 2.0; A_2 = 0 + 0.5*2 = 1.0 (then masked to 0); A_1 = 1.0 + 0.5*1.0 = 1.5; A_0 = -0.5 + 0.5*1.5 = 0.25
    assert adv.tolist() == [[0.25, 1.5, 0.0, 2.0]]
    assert discounted_future_sum(torch.tensor([[1.0, 2.0, 4.0]], dtype=torch.float64), gamma=0.5).tolist() == \
        [[1.0 + 0.5 * 2.0 + 0.25 * 4.0, 2.0 + 0.5 * 4.0, 4.0]]
    full, _ = distill_advantages(STUDENT, TEACHER, MASK, discount=1.0)  # undiscounted reverse-KL-to-go
    assert full.tolist() == [[2.5, 3.0, 0.0, 2.0]]


def test_coef_scales_the_kl_term_and_base_advantages_are_added_on_trained_tokens():
    base = torch.full((1, 4), 0.1, dtype=torch.float64)
    adv, rkl = distill_advantages(STUDENT, TEACHER, MASK, base, coef=2.0)
    # 2 * (-0.5, 1.0, -, 2.0) + 0.1; the tool token stays 0
    assert adv[0].tolist() == pytest.approx([-0.9, 2.1, 0.0, 4.1], abs=1e-12)
    assert rkl.tolist() == [[0.5, -1.0, 0.0, -2.0]]  # the reverse KL does not depend on coef


def test_a_teacher_that_agrees_gives_no_signal():
    adv, rkl = distill_advantages(STUDENT, STUDENT.clone(), MASK, discount=0.9)
    assert adv.abs().max() == 0 and rkl.abs().max() == 0


def test_bad_input_is_a_clear_error():
    with pytest.raises(ShapeError, match=r"one shape .*\(1, 4\), \(1, 3\)"):
        distill_advantages(STUDENT, TEACHER[:, :3], MASK)
    with pytest.raises(ConfigError, match=r"discount must be in \[0, 1\], got 1.5"):
        distill_advantages(STUDENT, TEACHER, MASK, discount=1.5)
    with pytest.raises(ConfigError, match="coef must be a number >= 0, got -1"):
        distill_advantages(STUDENT, TEACHER, MASK, coef=-1)
