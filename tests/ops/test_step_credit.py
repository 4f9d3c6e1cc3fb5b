"""Step rewards under group baselines: ``process`` (DeepSeekMath §4.1.3) by hand, and a property
test over every registered advantage estimator: finite, no division by eps, and 0 where a group
carries no signal (issue 27, items 1 and 2)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from materl.errors import ConfigError
from materl.ops.advantages import ADVANTAGES, grpo
from materl.ops.step_credit import process, step_ends
from tests.ops.test_turn_credit import rollout_inputs

F64 = torch.float64


def close(a, b, tol=1e-12):
    torch.testing.assert_close(a, b.to(a.dtype), atol=tol, rtol=tol)


def test_process_by_hand_from_deepseekmath_equations():
    # two episodes of two turns: tokens [t1, t1, tool, t2, t2], mask [1, 1, 0, 1, 1]
    # A: step rewards 1 (turn 1), 0 (turn 2);  B: 0 (turn 1), 2 (turn 2, on token 4)
    # R = {1, 0, 0, 2}: mean 0.75, unbiased var (0.0625 + 0.5625 + 0.5625 + 1.5625) / 3 = 11/12
    # r~ = (r - 0.75) / s, s = sqrt(11/12): A (0.25, -0.75) / s, B (-0.75, 1.25) / s
    # A_t sums r~ of its own step and later: A turn 1 (0.25 - 0.75) / s, turn 2 -0.75 / s;
    # B turn 1 (-0.75 + 1.25) / s, turn 2 1.25 / s; the tool token is untrained (0)
    rewards = torch.tensor([[0, 1.0, 0, 0, 0], [0, 0, 0, 0, 2.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0, 1, 1]] * 2, dtype=F64)
    adv, ret = process(rewards, mask, group_size=2, eps=0.0)
    s = math.sqrt(11 / 12)
    expected = torch.tensor([[-0.5, -0.5, 0, -0.75, -0.75], [0.5, 0.5, 0, 1.25, 1.25]], dtype=F64) / s
    close(adv, expected)
    close(ret, expected)
    # scale="none": no division by the std
    close(process(rewards, mask, group_size=2, scale="none")[0], expected * s)


def test_a_reward_on_tool_output_counts_for_the_turn_before_and_the_outcome_is_the_last_step():
    # the 1 sits on the tool token (index 2): it is turn 1's reward. The (B,) outcome 0.5 lands
    # on the last trained token, turn 2's. Row A: turn rewards (1, 0); row B (0, 0.5) from (B,)
    tok = torch.tensor([[0, 0, 1.0, 0, 0], [0, 0, 0, 0, 0.5]], dtype=F64)
    mask = torch.tensor([[1, 1, 0, 1, 1]] * 2, dtype=F64)
    # R = {1, 0, 0, 0.5}: mean 0.375, squared deviations 0.390625 + 0.140625 * 2 + 0.015625
    # = 0.6875, var 0.6875 / 3; A turn 1 (0.625 - 0.375) / s, turn 2 -0.375 / s
    s = math.sqrt(0.6875 / 3)
    adv, _ = process(tok, mask, group_size=2, eps=0.0)
    close(adv[0], torch.tensor([0.25, 0.25, 0, -0.375, -0.375], dtype=F64) / s)
    close(adv[1], torch.tensor([-0.25, -0.25, 0, 0.125, 0.125], dtype=F64) / s)


def test_process_with_one_step_per_row_is_grpo():
    # single-turn rows: R is the group's outcome scores, so process is verl's GRPO (singleton too)
    scores = torch.tensor([1.0, 0.0, 0.5, 3.0], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=F64)
    close(process(scores, mask, group_ids="aaab")[0], grpo(scores, mask, group_ids="aaab")[0])


def test_process_gives_zero_when_all_step_rewards_of_a_group_are_equal():
    # the grpo_tools case of issue 27: format 0.2 on turn 1, success 0.2 on turn 2, identical
    # episodes: R = {0.2, 0.2, 0.2, 0.2} has std 0, so every advantage is exactly 0
    rewards = torch.tensor([[0, 0.2, 0, 0, 0.2]] * 2, dtype=F64)
    mask = torch.tensor([[1, 1, 0, 1, 1]] * 2, dtype=F64)
    assert (process(rewards, mask, group_size=2)[0] == 0).all()


def test_step_ends_are_the_last_trained_token_of_each_run():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [0, 1, 1, 1, 1, 1]], dtype=F64)
    assert step_ends(mask).nonzero().tolist() == [[0, 1], [0, 4], [1, 5]]


def test_process_rejects_bad_hyperparameters():
    with pytest.raises(ConfigError, match="unknown scale 'batch'; valid: group, none"):
        process(torch.zeros(2), torch.ones(2, 2), group_size=2, scale="batch")
    with pytest.raises(ConfigError, match="eps must be >= 0"):
        process(torch.zeros(2), torch.ones(2, 2), group_size=2, eps=-1.0)


# ---------------------------------------------------------------- property test over the registry

REWARD_VALUES = (-0.5, 0.0, 0.2, 1.0)

episode_shapes = st.lists(  # one episode: a list of turns, each (trained tokens, tool tokens after, reward)
    st.tuples(st.integers(1, 3), st.integers(0, 2), st.sampled_from(REWARD_VALUES)), min_size=1, max_size=3)
group_specs = st.lists(  # a group: its episode shape, its size (1 = singleton, or what failures left)
    st.tuples(episode_shapes, st.integers(1, 4)), min_size=1, max_size=3)


def identical_groups(groups, *, outcome: bool, equal_steps: bool):
    """Rewards (B,) or (B,T), mask (B,T), group ids, and whether every group's step rewards are
    all equal: every episode of a group a copy of the group's shape. ``equal_steps``: every step
    reward of a group is its first's; ``outcome``: that reward is the (B,) outcome instead."""
    rows, ids, flat = [], [], []
    for g, (turns, size) in enumerate(groups):
        mask, tok = [], []
        for trained, tool, r in turns:
            r = turns[0][2] if equal_steps else r
            mask += [1] * trained + [0] * tool
            tok += [0.0] * (trained - 1) + [r] + [0.0] * tool
        rows += [(mask, tok, turns[0][2])] * size
        ids += [f"g{g}"] * size
        runs = []  # a step is a run of trained tokens: turns with no tool tokens between them are one
        for k, (m, t) in enumerate(zip(mask, tok)):
            if m and (k == 0 or not mask[k - 1]):
                runs.append(0.0)
            runs[-1] += t if m else 0.0
        steps = [0.0] * (len(runs) - 1) + [turns[0][2]] if outcome else runs
        flat.append(len(set(steps)) == 1)
    T = max(len(m) for m, _, _ in rows) + 1  # one padding column
    mask = torch.zeros(len(rows), T, dtype=F64)
    tok = torch.zeros(len(rows), T, dtype=F64)
    for i, (m, t, _) in enumerate(rows):
        mask[i, : len(m)] = torch.tensor(m, dtype=F64)
        tok[i, : len(t)] = torch.tensor(t, dtype=F64)
    if outcome:
        return torch.tensor([r for _, _, r in rows], dtype=F64), mask, ids, all(flat)
    return tok, mask, ids, all(flat)


def call(name, rewards, mask, ids):
    extra = []
    if name == "remax":
        extra = [torch.zeros(mask.shape[0], dtype=F64)]
    if name == "gae":
        extra = [torch.zeros_like(mask)]
    return ADVANTAGES.get(name)(rewards, mask, *extra, *rollout_inputs(name, mask), group_ids=ids)


def group_baseline(name: str) -> bool:
    """Estimators whose baseline is a statistic of the group's scores (no value, no greedy baseline,
    not a batch whitening of returns)."""
    return getattr(ADVANTAGES.get(name), "baseline", None) == "group"


def test_the_group_baseline_estimators_are_marked():
    marked = {n for n in ADVANTAGES.names() if group_baseline(n)}
    assert marked == {"dr_grpo", "gigpo", "gpg", "grpo", "opo", "process", "reinforce_pp_baseline", "rloo", "turn_grpo"}


@pytest.mark.parametrize("name", ADVANTAGES.names())
@settings(max_examples=40, deadline=None)
@given(groups=group_specs, outcome=st.booleans(), equal_steps=st.booleans())
def test_no_estimator_explodes_and_no_signal_gives_zero(name, groups, outcome, equal_steps):
    """Groups of identical episodes (one or several turns, singletons, groups shrunk by failed
    episodes), outcome or step rewards. Every estimator stays finite and far below an eps
    blow-up (rewards are at most 1 in size: |A| ~ 1e5 would be r / 1e-6); a group baseline gives
    exactly 0. ``process`` normalises over steps, so it is 0 when the group's step rewards are
    all equal (its module docstring: identical episodes whose turns score differently do carry
    a step-level signal there)."""
    rewards, mask, ids, flat_steps = identical_groups(groups, outcome=outcome, equal_steps=equal_steps)
    adv, ret = call(name, rewards, mask, ids)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert adv.abs().max() <= 100, f"{name}: |A| = {adv.abs().max():.3g}"
    assert (adv[mask == 0] == 0).all()
    singleton = {i for i, g in enumerate(ids) if ids.count(g) == 1}
    if group_baseline(name) and not singleton and (name != "process" or flat_steps):
        assert (adv == 0).all(), f"{name}: {adv}"
