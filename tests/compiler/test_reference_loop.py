"""The compiled grpo recipe and the hand-written reference loop (examples/reference_grpo_loop.py)
give the same loss and the same parameter update on the same rollouts."""

import importlib.util
from pathlib import Path

import pytest
import torch

import materl as ml
from tests.tolerance import assert_same_update
from materl.ops.rewards import Reward
from materl.recipes import grpo

ROOT = Path(__file__).resolve().parents[2]


def load_reference():
    spec = importlib.util.spec_from_file_location("reference_grpo_loop", ROOT / "examples" / "reference_grpo_loop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_compiled_grpo_equals_the_reference_loop(kernels):
    """SGD, so the parameter update is lr x gradient and compares tightly (Adam's first step is
    lr x sign(g), which magnifies 1e-9 differences of near-zero gradients). Seed 2: its groups'
    rewards differ (with seed 3 every group's rewards are equal since the engines draw from
    counter_uniforms, so there is no update to compare)."""
    ref_loop = load_reference()
    policy, ref = ml.Agent("tiny-random", trainable=True), ml.Agent("tiny-random")
    step = ml.compile(grpo, policy=policy, ref_policy=ref, group_size=4, max_new_tokens=8, lr=1.0, seed=2,
                      optimizer="sgd", kernels=kernels)
    episodes = step.call_blocking(step.rollout, ["one", "two", "three"])
    hand_policy, hand_ref = ml.Agent("tiny-random", trainable=True), ml.Agent("tiny-random")
    for p, q in zip(policy.parameters(), hand_policy.parameters()):
        assert torch.equal(p, q)  # same starting point
    metrics = step.call_blocking(step.learn, episodes)

    rollouts = [step.episode_rollout(e) for e in episodes]
    texts = [r.text for r in rollouts]
    ids = [r.completion_ids for r in rollouts]
    reward = Reward.from_spec("length", 0.1) + Reward.from_spec("diversity", 0.9)
    rewards_B = reward.score(completions=texts, completion_ids=ids)
    optimizer = torch.optim.SGD(hand_policy.parameters(), lr=1.0)
    loss = ref_loop.grpo_update(hand_policy, hand_ref, optimizer, [r.prompt_ids for r in rollouts], ids,
                                [r.sampling_logprobs for r in rollouts], rewards_B,
                                [e.group_id for e in episodes], clip=0.2, kl_coef=0.04, max_grad_norm=1.0)

    assert metrics["reward"] == float(rewards_B.mean())
    assert abs(metrics["loss"] - loss) < 1e-6
    before = [p.detach() for p in ml.Agent("tiny-random").model.parameters()]
    assert_same_update([p.detach() for p in policy.parameters()], [q.detach() for q in hand_policy.parameters()],
                       before)
    step.close()
