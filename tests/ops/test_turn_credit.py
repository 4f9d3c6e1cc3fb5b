"""Turn-level GRPO and GiGPO as tensor functions (materl/ops/turn_credit.py): hand-computed values
from the equations (MT-GRPO's per-turn statistics, arXiv:2505.11821; GiGPO arXiv:2505.10978), and
groups that carry no signal: equal scores, singletons, groups shrunk by failed episodes."""

from __future__ import annotations

import math

import pytest
import torch

from materl.errors import ConfigError, ShapeError
from materl.ops.advantages import ADVANTAGES
from materl.ops.turn_credit import gigpo, turn_grpo

F64 = torch.float64
TWO_TURNS_MASK = [1, 1, 0, 1, 1]  # turn 1 (2 tokens), one tool token, turn 2 (2 tokens)
TWO_TURNS = [0, 0, 0, 1, 1]  # each token's turn: the tool token belongs to turn 1


def close(a, b, tol=1e-12):
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=tol, rtol=tol)


def mask_turns(mask: torch.Tensor) -> torch.Tensor:
    """Each token's turn when every maximal run of trained tokens is one turn (what the compiler
    derives from rollouts whose model turns are separated by tool output), -1 before the first."""
    trained = mask > 0
    starts = trained & ~torch.cat([torch.zeros_like(trained[:, :1]), trained[:, :-1]], dim=1)
    return starts.long().cumsum(-1) - 1


def position_states(turns: torch.Tensor) -> torch.Tensor:
    """Anchor states by turn position: turn j's state is j (the same state for the whole group)."""
    K = int(turns.max()) + 1 if turns.numel() else 0
    n = turns.amax(-1, keepdim=True) + 1 if turns.numel() else turns.new_zeros(turns.shape[0], 1)
    return torch.where(torch.arange(K) < n, torch.arange(K), -1)


def rollout_inputs(name: str, mask: torch.Tensor) -> list[torch.Tensor]:
    """The tensors an estimator declares with @rollout_inputs, derived from the mask (for tests that
    call every registered estimator)."""
    turns = mask_turns(mask)
    table = {"turns": turns, "states": position_states(turns)}
    return [table[n] for n in getattr(ADVANTAGES.get(name), "rollout_inputs", ())]


def rows(*values):
    return torch.tensor(values, dtype=F64)


def test_turn_grpo_by_hand_with_a_singleton_group():
    # group "a": A and B have two turns, C one. Token rewards: A 1 on turn 1; B 1 on turn 2; C the
    # outcome 2 on its last trained token (token 1). Group "b": D alone, outcome 3.
    # turn 1 returns (gamma 1): A 1, B 1, C 2 -> mean 4/3, unbiased std sqrt(1/3)
    # turn 2 returns: A 0, B 1 -> mean 1/2, std sqrt(1/2); C has no turn 2
    # D: one row with a turn 1 -> mean 0, std 1: 3 / (1 + eps)
    rewards = rows([0, 1, 0, 0, 0], [0, 0, 0, 0, 1], [0, 2, 0, 0, 0], [0, 0, 3, 0, 0])
    mask = rows(TWO_TURNS_MASK, TWO_TURNS_MASK, [1, 1, 0, 0, 0], [1, 1, 1, 0, 0])
    turns = torch.tensor([TWO_TURNS, TWO_TURNS, [0, 0, -1, -1, -1], [0, 0, 0, -1, -1]])
    adv, ret = turn_grpo(rewards, mask, turns, group_ids=["a", "a", "a", "b"], eps=1e-6)
    s1, s2 = math.sqrt(1 / 3) + 1e-6, math.sqrt(1 / 2) + 1e-6
    t1, t2 = (1 - 4 / 3) / s1, (0 - 0.5) / s2
    close(adv, [[t1, t1, 0, t2, t2], [t1, t1, 0, -t2, -t2], [(2 - 4 / 3) / s1] * 2 + [0] * 3,
                [3 / (1 + 1e-6)] * 3 + [0, 0]])
    close(ret, [[1, 1, 0, 0, 0], [1, 1, 0, 1, 1], [2, 2, 0, 0, 0], [3, 3, 3, 0, 0]])
    # gamma discounts across turns: B's turn-1 return is 0 + 0.5 * 1
    _, ret = turn_grpo(rewards, mask, turns, group_ids=["a", "a", "a", "b"], gamma=0.5)
    assert ret[1, 0].item() == 0.5


def test_turn_grpo_equal_scores_and_shrunk_groups_give_zero_without_eps():
    # three identical two-turn rows (0.2 on turn 1, outcome 1 on turn 2); with eps = 0 a division
    # by the std would be 0 / 0. A fourth row failed and was dropped (the group has 3 of 4).
    rewards = rows(*[[0, 0.2, 0, 0, 1.0]] * 3)
    mask = rows(*[TWO_TURNS_MASK] * 3)
    adv, ret = turn_grpo(rewards, mask, torch.tensor([TWO_TURNS] * 3), group_size=3, eps=0.0)
    assert (adv == 0).all()
    close(ret, [[1.2, 1.2, 0, 1, 1]] * 3)
    # a failed episode kept as an empty row (no trained token, no turn) changes nothing
    rewards, mask = torch.cat([rewards, rows([0] * 5)]), torch.cat([mask, rows([0] * 5)])
    turns = torch.tensor([TWO_TURNS] * 3 + [[-1] * 5])
    adv, _ = turn_grpo(rewards, mask, turns, group_size=4, eps=0.0)
    assert (adv == 0).all()


def test_gigpo_by_hand_from_the_paper():
    # A and B saw tool result "7" after turn 1, C saw "8": states A, B (prompt, s7), C (prompt, s8).
    # Turn rewards: A (1, 1), B (1, 0), C (0, 0); gamma 0.5, omega 1, norm std, eps 0.
    # A^E: R(tau) = 2, 1, 0 -> mean 1, unbiased std 1 -> 1, 0, -1
    # step returns: A 1.5 and 1; B 1 and 0; C 0 and 0
    # prompt state: {1.5, 1, 0}: mean 5/6, var ((2/3)^2 + (1/6)^2 + (5/6)^2) / 2 = 7/12
    # state s7: {1, 0}: mean 1/2, std sqrt(1/2); state s8 has one step: A^S = 0
    rewards = rows([0, 1, 0, 0, 1], [0, 1, 0, 0, 0], [0] * 5)
    mask = rows(*[TWO_TURNS_MASK] * 3)
    turns = torch.tensor([TWO_TURNS] * 3)
    states = torch.tensor([[0, 1], [0, 1], [0, 2]])
    adv, ret = gigpo(rewards, mask, turns, states, group_size=3, gamma=0.5, eps=0.0)
    s, h = math.sqrt(7 / 12), math.sqrt(0.5)
    a1, b1, c1 = 1 + (2 / 3) / s, 0 + (1 / 6) / s, -1 - (5 / 6) / s
    close(adv, [[a1, a1, 0, 1 + h, 1 + h], [b1, b1, 0, -h, -h], [c1, c1, 0, -1, -1]])
    close(ret, [[1.5, 1.5, 0, 1, 1], [1, 1, 0, 0, 0], [0] * 5])
    # norm="none": no std at either level; omega weighs the step level
    adv, _ = gigpo(rewards, mask, turns, states, group_size=3, gamma=0.5, norm="none", omega=0.5)
    close(adv[0], [1 + 0.5 * (1.5 - 5 / 6)] * 2 + [0] + [1 + 0.5 * 0.5] * 2)


def test_gigpo_singleton_and_equal_groups():
    # a group of one episode: A^E = R(tau) / (1 + eps) (mean 0, std 1); its states have one step
    # each, so A^S = 0. R(tau) = 0.5 + 1 = 1.5 on both turns.
    adv, _ = gigpo(rows([0, 0.5, 0, 0, 1]), rows(TWO_TURNS_MASK), torch.tensor([TWO_TURNS]),
                   torch.tensor([[0, 1]]), group_size=1)
    close(adv, [[1.5 / (1 + 1e-6)] * 2 + [0] + [1.5 / (1 + 1e-6)] * 2])
    # equal episodes (a group shrunk to two by failures): every statistic has std 0, even with eps 0
    adv, _ = gigpo(rows(*[[0, 0.2, 0, 0, 1.0]] * 2), rows(*[TWO_TURNS_MASK] * 2), torch.tensor([TWO_TURNS] * 2),
                   torch.tensor([[0, 1]] * 2), group_size=2, eps=0.0)
    assert (adv == 0).all()


def test_bad_inputs_are_clear_errors():
    mask = rows(TWO_TURNS_MASK)
    with pytest.raises(ShapeError, match=r"turns must match mask \(B,T\)=\[1, 5\], got shape \[1, 4\]"):
        turn_grpo(rows([0] * 5), mask, torch.zeros(1, 4, dtype=torch.long), group_size=1)
    with pytest.raises(ShapeError, match=r"trained tokens without a turn .turn index -1. in rows \[0\]"):
        turn_grpo(rows([0] * 5), mask, torch.tensor([[-1, 0, 0, 1, 1]]), group_size=1)
    with pytest.raises(ShapeError, match=r"states must be \(B, K\) with B=1 and K >= 2"):
        gigpo(rows([0] * 5), mask, torch.tensor([TWO_TURNS]), torch.tensor([[0]]), group_size=1)
    with pytest.raises(ConfigError, match="gigpo: unknown norm 'batch'; valid: std, none"):
        gigpo(rows([0] * 5), mask, torch.tensor([TWO_TURNS]), torch.tensor([[0, 1]]), group_size=1, norm="batch")
    with pytest.raises(ConfigError, match=r"turn_grpo: gamma must be in \[0, 1\] and eps >= 0; got gamma=2"):
        turn_grpo(rows([0] * 5), mask, torch.tensor([TWO_TURNS]), group_size=1, gamma=2)
