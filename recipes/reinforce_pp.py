"""REINFORCE++ (Hu 2025, arXiv:2501.03262).

No critic and no group baseline: the token-level reward is the outcome reward minus a k1 KL
penalty to the reference on every token, the return-to-go is whitened over the whole batch,
and the clipped surrogate trains the policy. Because the KL enters the reward, the advantages
node reads the reference log-probs and runs in the learner's prepare stage.
"""

import materl as ml


@ml.recipe
def reinforce_pp(policy, ref_policy, prompts):
    completions = ml.generate(policy, prompts, name="completions")
    logprobs = ml.logprobs(policy, prompts, completions, name="policy_logprobs")
    ref_logprobs = ml.logprobs(ref_policy, prompts, completions, name="ref_logprobs")
    rewards = ml.reward("length", weight=0.1) + ml.reward("diversity", weight=0.9)
    advantages = ml.advantages(rewards, ref_logprobs, logprobs, estimator="reinforce_pp",
                               kl_coef=0.01, kl="k1", name="advantages")
    ml.set_loss(ml.ppo_loss(advantages, logprobs, agg="token_mean"))
