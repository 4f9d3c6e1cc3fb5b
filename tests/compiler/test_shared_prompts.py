"""The learner's shared-prompt forward equals one forward over every full row, in value and gradient.

The identity is exact in real arithmetic; the two paths only sum in different orders, so they
agree to float32 rounding of each tensor's *scale*: one embedding-gradient element of 32k can
differ by 1e-5 where the tensor's largest value is 132 (7.5e-8 of the scale). Comparing in
float64 does not remove that: HF's rotary embedding computes cos/sin in float32 whatever the
model's dtype. A wrong gradient (a prefix's keys not receiving every continuing row's gradient)
is off by a sizeable fraction of the scale.
"""

import pytest
import torch

import materl as ml
from materl.compiler.sequences import build_seq_batch, completion_hidden
from materl.rollout.types import Rollout, Step
from tests.tolerance import assert_close_to_scale


def _batch(agent, prompts, completions):
    rollouts = [Rollout(prompt_ids=p, steps=[Step("generate", c, [0.0] * len(c))]) for p, c in zip(prompts, completions)]
    return build_seq_batch(agent.tokenizer, [None] * len(rollouts), rollouts)


def _grads(agent, fn):
    for p in agent.parameters():
        p.grad = None
    out = fn()
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape)  # a loss that reads every element
    (out * weights).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in agent.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lora", [False, True])
def test_shared_prompts_equal_full_rows(lora):
    torch.manual_seed(0)
    agent = ml.Agent("tiny-random", trainable=True, **({"lora": dict(r=4)} if lora else {}))
    # two groups with prompts of different lengths, uneven completions, and one lone prompt
    p1, p2, p3 = [5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23]
    prompts = [p1, p1, p1, p2, p2, p3]
    completions = [[30, 31, 32, 33], [34], [35, 36], [37, 38, 39, 40], [41, 42, 43], [44, 45]]
    sb = _batch(agent, prompts, completions)
    assert sb.prompt_group.tolist() == [0, 0, 0, 1, 1, 2]

    full, g_full = _grads(agent, lambda: completion_hidden(agent, sb, share_prompts=False) * sb.mask[..., None])
    shared, g_shared = _grads(agent, lambda: completion_hidden(agent, sb, share_prompts=True) * sb.mask[..., None])
    assert shared.shape == full.shape == (6, 4, agent.model.config.hidden_size)
    assert_close_to_scale(shared, full)
    assert g_full.keys() == g_shared.keys() and g_full
    for name in g_full:
        assert_close_to_scale(g_shared[name], g_full[name], msg=name)


def test_single_token_completions_and_distinct_prompts():
    torch.manual_seed(0)
    agent = ml.Agent("tiny-random", trainable=True)
    sb = _batch(agent, [[5, 6, 7], [5, 6, 7]], [[8], [9]])  # no suffix pass at all
    assert_close_to_scale(completion_hidden(agent, sb), completion_hidden(agent, sb, share_prompts=False))
    sb = _batch(agent, [[5, 6], [7, 8, 9]], [[10, 11], [12]])  # nothing shared: one plain forward
    torch.testing.assert_close(completion_hidden(agent, sb), completion_hidden(agent, sb, share_prompts=False))


def test_value_head_through_shared_prompts():
    torch.manual_seed(0)
    agent = ml.Agent("tiny-random", head="value", trainable=True)
    sb = _batch(agent, [[5, 6, 7, 8]] * 3, [[9, 10], [11, 12, 13], [14]])
    shared = agent.values_of_hidden(completion_hidden(agent, sb))
    direct = agent.values(sb.input_ids, sb.attention_mask).gather(1, sb.gather_idx)
    assert_close_to_scale(shared * sb.mask, direct * sb.mask)
