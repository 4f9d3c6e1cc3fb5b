"""RLOO — REINFORCE Leave-One-Out (Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740).

Each sample's baseline is the mean reward of the other samples of its prompt. Trained with
the clipped surrogate (as verl's RLOO does) and a k1 KL penalty; Ahmadian et al. put the KL in
the reward instead — ``ml.advantages(..., kl_coef=...)`` gives that.
"""

import materl as ml


@ml.recipe
def rloo(policy, ref_policy, prompts):
    completions = ml.generate(policy, prompts, name="completions")
    logprobs = ml.logprobs(policy, prompts, completions, name="policy_logprobs")
    ref_logprobs = ml.logprobs(ref_policy, prompts, completions, name="ref_logprobs")
    rewards = ml.reward("length", weight=0.1) + ml.reward("diversity", weight=0.9)
    advantages = ml.advantages(rewards, estimator="rloo", name="advantages")
    ml.set_loss(ml.ppo_loss(advantages, logprobs, ref_logprobs, agg="token_mean", kl="k1", kl_coef=0.01))
