"""ReMax (Li et al. 2023, arXiv:2310.10505).

REINFORCE with the reward of a greedy rollout of the same prompt as the baseline: one sampled
and one greedy generation per prompt, no critic. Compile with ``group_size=1`` as in the paper
(larger groups work too; each sample uses its own prompt's greedy baseline).
"""

import materl as ml


@ml.recipe
def remax(policy, prompts):
    completions = ml.generate(policy, prompts, name="completions")
    greedy = ml.generate(policy, prompts, greedy=True, name="greedy")
    logprobs = ml.logprobs(policy, prompts, completions, name="policy_logprobs")
    baseline = ml.reward("length", weight=0.1, rollout=greedy, name="greedy_length") \
        + ml.reward("diversity", weight=0.9, rollout=greedy, name="greedy_diversity")
    rewards = ml.reward("length", weight=0.1, rollout=completions) \
        + ml.reward("diversity", weight=0.9, rollout=completions)
    advantages = ml.advantages(rewards, estimator="remax", baseline=baseline, completions=completions,
                               name="advantages")
    ml.set_loss(ml.reinforce_loss(advantages, logprobs, agg="token_mean"))
