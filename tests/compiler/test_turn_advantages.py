"""Turn-level GRPO (``ml.turn_advantages``: the advantages node with estimator ``turn_grpo``,
materl/ops/turn_credit.py) through the compiled advantages node: hand-computed values, and a
recipe that trains with it."""

import math

import pytest
import torch

import materl as ml
from materl.compiler.episode import Episode
from materl.compiler.kinds.advantages import advantages_torch
from materl.graph.constructors import turn_advantages
from materl.graph.node import Node
from materl.rollout.env import EnvStep
from materl.rollout.types import Rollout, Step


TURN = {"estimator": "turn_grpo"}


def gen(n):
    return Step("generate", list(range(n)), [0.0] * n)


def test_group_statistics_per_turn_position_by_hand():
    # A: turn 1 (2 tokens) + tool (1) + turn 2 (2); B the same shape; C one turn of 2 tokens
    a = Rollout([9], [gen(2), Step("tool", [7]), gen(2)])
    b = Rollout([9], [gen(2), Step("tool", [7]), gen(2)])
    c = Rollout([9], [gen(2)])
    rewards = [torch.tensor([0, 1.0, 0, 0, 0]), torch.tensor([0, 0, 0, 0, 1.0]), 2.0]  # C: an outcome reward
    eps = [Episode(i, 0, "g", "p", {}, 0) for i in range(3)]
    node = Node("adv", "advantages", ("rewards", "rollout"), TURN | {"gamma": 1.0, "eps": 0.0}, "group")
    out = advantages_torch(None, node, eps, [rewards, [a, b, c]])
    # turn 1 returns: A 1 + 0 = 1, B 0 + 1 = 1, C 2 -> mean 4/3, unbiased std sqrt(1/3)
    # turn 2 returns: A 0, B 1 -> mean 1/2, std sqrt(1/2); C has no turn 2
    s1, s2 = math.sqrt(1 / 3), math.sqrt(1 / 2)
    t1, t2 = (1 - 4 / 3) / s1, (0 - 0.5) / s2
    assert out["advantages"][0].tolist() == pytest.approx([t1, t1, 0.0, t2, t2])  # the tool token is untrained
    assert out["advantages"][1].tolist() == pytest.approx([t1, t1, 0.0, -t2, -t2])
    assert out["advantages"][2].tolist() == pytest.approx([(2 - 4 / 3) / s1] * 2)
    assert out["returns"][0].tolist() == pytest.approx([1, 1, 0, 0, 0])
    # gamma discounts across turns: A's turn-1 return is 1 + 0.5 * 0, B's 0 + 0.5 * 1
    node = node.replace(params=TURN | {"gamma": 0.5, "eps": 0.0})
    assert advantages_torch(None, node, eps, [rewards, [a, b, c]])["returns"][1][0].item() == 0.5


class TwoTurns:
    """Turn 1 is rewarded for mentioning 'a', turn 2 for its length (step rewards)."""

    def __init__(self):
        self.turn = 0

    async def reset(self, prompt, **columns):
        self.turn = 0
        return prompt

    async def step(self, text):
        self.turn += 1
        if self.turn == 1:
            return EnvStep("and again?", float("a" in text), False)
        return EnvStep(None, len(text) / 10, True)

    def is_done(self):
        return self.turn >= 2


def test_a_recipe_trains_with_turn_advantages():
    @ml.recipe
    def turn_grpo(policy, prompts):
        rollout = ml.env_rollout(policy, TwoTurns, prompts, max_turns=2, name="rollout")
        adv = turn_advantages(ml.reward("step_rewards", rollout=rollout), rollout, name="adv")
        ml.set_loss(ml.policy_loss(adv, ml.logprobs(policy, prompts, rollout), agg="token_mean"))

    step = ml.compile(turn_grpo, policy=ml.Agent("tiny-random", trainable=True), group_size=3, max_new_tokens=6)
    assert "%adv = advantages(%rewards, %rollout) {estimator='turn_grpo', gamma=1, eps=1e-06} [group]  <- torch" \
        in step.explain()
    assert step.plan.stage_of("adv") == "group"
    episodes = step.call_blocking(step.rollout, ["say a", "say b"])
    metrics = step.call_blocking(step.learn, episodes)
    assert metrics["episodes"] == 6.0 and math.isfinite(metrics["loss"])
    node = step.plan.nodes["adv"]
    for group in (episodes[:3], episodes[3:]):
        again = advantages_torch(None, node, group, [[e.values["rewards"] for e in group],
                                                     [e.values["rollout"] for e in group]])
        for e, adv in zip(group, again["advantages"]):
            assert torch.equal(e.resolve("adv"), adv) and len(adv) == len(e.values["rollout"].completion_ids)
    step.close()


def test_identical_episodes_give_zero_even_without_eps():
    # two identical two-turn episodes, step reward 0.2 on turn 1 and outcome 1 on turn 2: every
    # turn's returns are equal (1.2, then 1), so std 0 and the advantage is 0, not 0 / 0
    rollouts = [Rollout([9], [gen(2), Step("tool", [7]), gen(2)]) for _ in range(2)]
    rewards = [torch.tensor([0, 0.2, 0, 0, 1.0])] * 2
    eps = [Episode(i, 0, "g", "p", {}, 0) for i in range(2)]
    node = Node("adv", "advantages", ("rewards", "rollout"), TURN | {"gamma": 1.0, "eps": 0.0}, "group")
    out = advantages_torch(None, node, eps, [rewards, rollouts])
    assert all((a == 0).all() for a in out["advantages"])


def test_turn_advantages_is_exported():
    assert ml.turn_advantages is turn_advantages
