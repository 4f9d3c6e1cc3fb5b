"""How the plain ``ml.advantages`` node credits step rewards (``step_credit``): process
supervision by default under grpo / dr_grpo, verl's summed reward with ``"sum"``, outcome-only
rewards always verl's GRPO; and the errors for options that do not apply."""

import pytest
import torch

import materl as ml
from materl.compiler.episode import Episode
from materl.compiler.kinds.advantages import advantages_torch
from materl.errors import CompileError, RecipeError
from materl.graph.node import Node
from materl.ops.advantages import grpo
from materl.ops.step_credit import process
from materl.rollout.types import Rollout, Step

ROLLOUT = Rollout([0], [Step("generate", [1, 2], [0.0] * 2), Step("tool", [9]), Step("generate", [3, 4], [0.0] * 2)])
MASK = torch.tensor([[1, 1, 0, 1, 1]] * 2, dtype=torch.float64)
STEP_REWARDS = [torch.tensor([0, 0.2, 0, 0, 1.0]), torch.tensor([0, 0.0, 0, 0, 1.0])]
EPISODES = [Episode(i, 0, "g", "p", {}, 0) for i in range(2)]


def node_output(rewards, **params):
    node = Node("advantages", "advantages", ("rewards", "rollout"), {"estimator": "grpo", **params}, "group")
    return torch.stack(advantages_torch(None, node, EPISODES, [rewards, [ROLLOUT, ROLLOUT]])["advantages"])


def test_step_rewards_default_to_process_and_sum_is_verl():
    rewards = torch.stack(STEP_REWARDS).double()
    expected = process(rewards, MASK, group_size=2)[0].float()
    assert torch.allclose(node_output(STEP_REWARDS), expected)
    assert torch.allclose(node_output(STEP_REWARDS, step_credit="process"), expected)
    summed = grpo(rewards.sum(-1), MASK, group_size=2)[0].float()  # S = 1.2 and 1.0, broadcast
    assert torch.allclose(node_output(STEP_REWARDS, step_credit="sum"), summed)
    assert not torch.allclose(expected, summed)
    # dr_grpo's process has no std division
    dr = process(rewards, MASK, group_size=2, scale="none")[0].float()
    assert torch.allclose(node_output(STEP_REWARDS, estimator="dr_grpo"), dr)


def test_outcome_rewards_stay_verl_grpo():
    out = node_output([1.2, 1.0])
    assert torch.allclose(out, grpo(torch.tensor([1.2, 1.0], dtype=torch.float64), MASK, group_size=2)[0].float())


def test_options_that_do_not_apply_are_errors():
    with pytest.raises(CompileError, match="scale='batch' has no process form .valid: group, none.; or pass "
                                           "step_credit='sum'"):
        node_output(STEP_REWARDS, scale="batch")

    def build(**kw):
        @ml.recipe
        def bad(policy, prompts):
            ml.generate(policy, prompts)
            ml.advantages(ml.reward("length"), **kw)

    with pytest.raises(RecipeError, match=r"step_credit='turn'.*valid: process, sum \(turn-level and GiGPO credit: "
                                          r"ml.turn_advantages, ml.gigpo_advantages\)"):
        build(step_credit="turn")
    with pytest.raises(RecipeError, match="applies to the GRPO family .grpo, dr_grpo.; estimator 'rloo' sums"):
        build(step_credit="process", estimator="rloo")
