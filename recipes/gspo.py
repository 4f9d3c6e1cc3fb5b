"""GSPO — Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071).

GRPO's group advantages with a sequence-level importance ratio: the ratio is the geometric
mean of token ratios, clipped per sequence (small clip range, 3e-4 / 4e-4 in the paper), and the
loss is averaged per sequence. No KL, as in the paper.
"""

import materl as ml


@ml.recipe
def gspo(policy, prompts):
    completions = ml.generate(policy, prompts, name="completions")
    logprobs = ml.logprobs(policy, prompts, completions, name="policy_logprobs")
    rewards = ml.reward("length", weight=0.1) + ml.reward("diversity", weight=0.9)
    advantages = ml.advantages(rewards, estimator="grpo", name="advantages")
    ml.set_loss(ml.gspo_loss(advantages, logprobs, agg="seq_mean_token_mean"))
