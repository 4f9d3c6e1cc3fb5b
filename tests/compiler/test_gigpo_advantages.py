"""GiGPO advantages (``ml.gigpo_advantages``: the advantages node with estimator ``gigpo``,
materl/ops/turn_credit.py) against hand-computed values from
the paper's equations (arXiv:2505.10978), no signal from identical episodes, anchors from the
user, and a recipe that trains with it."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import materl as ml
from materl.compiler.episode import Episode
from materl.compiler.kinds.advantages import advantages_torch
from materl.compiler.turns import observation_anchor
from materl.errors import ConfigError
from materl.graph.node import Node
from materl.rollout.types import Rollout, Step
from tests.compiler.test_turn_advantages import TwoTurns


def gen(n):
    return Step("generate", list(range(n)), [0.0] * n)


def two_turns(result: int) -> Rollout:
    """turn 1 (2 tokens), the tool's result (1 token, id ``result``), turn 2 (2 tokens)"""
    return Rollout([9], [gen(2), Step("tool", [result]), gen(2)])


def run(rollouts, rewards, **params):
    eps = [Episode(i, 0, "g", "p", {}, 0) for i in range(len(rollouts))]
    node = Node("adv", "advantages", ("rewards", "rollout"),
                {"estimator": "gigpo", "omega": 1.0, "gamma": 0.5, "norm": "std", "eps": 0.0, **params}, "group")
    return advantages_torch(None, node, eps, [rewards, rollouts])


def test_episode_and_anchor_state_groups_by_hand():
    # A and B got tool result 7, C got 8. Turn rewards (step reward on turn 1, outcome on turn 2):
    # A (1, 1), B (1, 0), C (0, 0).
    # A^E: R(tau) = 2, 1, 0: mean 1, unbiased std 1 -> 1, 0, -1
    # step returns, gamma 0.5: A 1 + 0.5 * 1 = 1.5 and 1; B 1 and 0; C 0 and 0
    # turn 1 shares the prompt state: {1.5, 1, 0}, mean 5/6, var ((2/3)^2 + (1/6)^2 + (5/6)^2) / 2 = 7/12
    # turn 2: A and B share state "7": {1, 0}, mean 1/2, std sqrt(1/2) -> +-sqrt(1/2); C alone: A^S 0
    # A = A^E + omega * A^S, omega 1
    rewards = [torch.tensor([0, 1.0, 0, 0, 1.0]), torch.tensor([0, 1.0, 0, 0, 0]), torch.zeros(5)]
    out = run([two_turns(7), two_turns(7), two_turns(8)], rewards)
    s, h = math.sqrt(7 / 12), math.sqrt(0.5)
    a1, b1, c1 = 1 + (2 / 3) / s, 0 + (1 / 6) / s, -1 - (5 / 6) / s
    assert out["advantages"][0].tolist() == pytest.approx([a1, a1, 0, 1 + h, 1 + h])
    assert out["advantages"][1].tolist() == pytest.approx([b1, b1, 0, -h, -h])
    assert out["advantages"][2].tolist() == pytest.approx([c1, c1, 0, -1, -1])
    assert out["returns"][0].tolist() == pytest.approx([1.5, 1.5, 0, 1, 1])
    # norm="none": no std at either level; omega weighs the step level
    out = run([two_turns(7), two_turns(7), two_turns(8)], rewards, norm="none", omega=0.5)
    assert out["advantages"][0].tolist() == pytest.approx([1 + 0.5 * (1.5 - 5 / 6)] * 2 + [0] + [1 + 0.5 * 0.5] * 2)


def test_identical_episodes_give_zero():
    # the same two turns everywhere (step reward 0.2 then outcome 1): every statistic has std 0
    rewards = [torch.tensor([0, 0.2, 0, 0, 1.0])] * 3
    out = run([two_turns(7)] * 3, rewards)
    assert all((a == 0).all() for a in out["advantages"])


def test_a_user_anchor_and_an_environment_anchor_pick_the_step_groups():
    # anchor by turn position only: turn 2 of all three episodes is one group {1, 0, 0}
    rewards = [torch.tensor([0, 1.0, 0, 0, 1.0]), torch.tensor([0, 1.0, 0, 0, 0]), torch.zeros(5)]
    out = run([two_turns(7), two_turns(7), two_turns(8)], rewards, anchor=lambda rollout, turn: turn)
    # turn 2: mean 1/3, std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3); C's A^S = (0 - 1/3) / sqrt(1/3)
    assert out["advantages"][2][3].item() == pytest.approx(-1 - (1 / 3) / math.sqrt(1 / 3))
    # an environment's EnvStep.info["anchor"] lands in the turn's metadata and names the next state
    r = two_turns(7)
    r.steps[0].metadata["anchor"] = "room-3"
    assert observation_anchor(r, 1) == ("env", "room-3")
    assert observation_anchor(two_turns(7), 1) == ("observation", 1, (7,)) and observation_anchor(r, 0) == ("prompt",)


def test_bad_options_and_unhashable_anchors_are_clear_errors():
    rewards = [torch.zeros(5)] * 2
    with pytest.raises(ConfigError, match=r"anchor function returned list \[1\] for turn 0; an anchor state must "
                                          r"be hashable"):
        run([two_turns(7)] * 2, rewards, anchor=lambda rollout, turn: [1])
    with pytest.raises(ConfigError, match="unknown norm 'batch'; valid: std, none"):
        ml.gigpo_advantages(None, None, norm="batch")
    with pytest.raises(ConfigError, match="omega >= 0"):
        ml.gigpo_advantages(None, None, omega=-1)


def test_a_recipe_trains_with_gigpo_advantages():
    @ml.recipe
    def gigpo(policy, prompts):
        rollout = ml.env_rollout(policy, TwoTurns, prompts, max_turns=2, name="rollout")
        adv = ml.gigpo_advantages(ml.reward("step_rewards", rollout=rollout), rollout, name="adv")
        ml.set_loss(ml.policy_loss(adv, ml.logprobs(policy, prompts, rollout), agg="token_mean"))

    step = ml.compile(gigpo, policy=ml.Agent("tiny-random", trainable=True), group_size=3, max_new_tokens=6)
    assert "%adv = advantages(%rewards, %rollout) {estimator='gigpo', omega=1, gamma=0.95, norm='std', eps=1e-06} " \
           "[group]" in step.explain()
    episodes = step.call_blocking(step.rollout, ["say a", "say b"])
    metrics = step.call_blocking(step.learn, episodes)
    assert metrics["episodes"] == 6.0 and math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
    node = step.plan.nodes["adv"]
    for group in (episodes[:3], episodes[3:]):  # the compiled node computed the kind's numbers per group
        again = advantages_torch(None, node, group, [[e.values["rewards"] for e in group],
                                                     [e.values["rollout"] for e in group]])
        for e, adv in zip(group, again["advantages"]):
            assert torch.equal(e.resolve("adv"), adv)
    step.close()


# ---------------------------------------------------------------- property: turn and GiGPO

turn_shapes = st.lists(st.tuples(st.integers(1, 3), st.integers(1, 2), st.sampled_from((-0.5, 0.0, 0.2, 1.0))),
                       min_size=1, max_size=3)  # (trained tokens, tool tokens after, the turn's reward)


def episode_of(turns):
    steps, tokens = [], []
    for j, (n, tool, r) in enumerate(turns):
        steps.append(gen(n))
        tokens += [0.0] * (n - 1) + [r]
        if j < len(turns) - 1:  # the tool output between turns
            steps.append(Step("tool", [7] * tool))
            tokens += [0.0] * tool
    return Rollout([9], steps), torch.tensor(tokens)


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(turn_shapes, min_size=1, max_size=4), identical=st.booleans(),
       op=st.sampled_from(["turn_grpo", "gigpo"]))
def test_turn_and_gigpo_are_finite_bounded_and_zero_on_identical_episodes(shapes, identical, op):
    """One group: identical copies of one episode (any number of turns, one copy = a singleton
    group left by failed episodes) or different episodes. No eps blow-up; identical copies (two
    or more) carry no signal."""
    shapes = [shapes[0]] * len(shapes) if identical else shapes
    pairs = [episode_of(s) for s in shapes]
    eps = [Episode(i, 0, "g", "p", {}, 0) for i in range(len(pairs))]
    params = {"estimator": op, "gamma": 0.95, "eps": 1e-6} | ({"omega": 1.0, "norm": "std"} if op == "gigpo" else {})
    node = Node("adv", "advantages", ("rewards", "rollout"), params, "group")
    out = advantages_torch(None, node, eps, [[t for _, t in pairs], [r for r, _ in pairs]])
    adv = torch.cat(out["advantages"])
    assert torch.isfinite(adv).all() and adv.abs().max() <= 100
    if identical and len(pairs) > 1:
        assert (adv == 0).all()
