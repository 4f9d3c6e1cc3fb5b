"""PPO for LLMs (Schulman et al. 2017; Ouyang et al. 2022, arXiv:2203.02155).

A critic (an agent with ``head="value"``) gives per-token values; advantages are GAE
(gamma=1, lambda=0.95); the policy trains on the clipped surrogate with a k1 KL penalty to the
reference, the critic on the clipped value loss against the GAE returns.

Difference from InstructGPT: the KL is a loss term, not part of the reward (use
``ml.advantages(..., kl_coef=...)``-style shaping for the latter).
"""

import materl as ml


@ml.recipe
def ppo(policy, ref_policy, value_model, prompts):
    completions = ml.generate(policy, prompts, name="completions")
    logprobs = ml.logprobs(policy, prompts, completions, name="policy_logprobs")
    ref_logprobs = ml.logprobs(ref_policy, prompts, completions, name="ref_logprobs")
    values = ml.values(value_model, prompts, completions, name="values")
    rewards = ml.reward("length", weight=0.1) + ml.reward("diversity", weight=0.9)
    advantages = ml.gae_advantages(rewards, values, gamma=1.0, lam=0.95, name="advantages")
    ml.set_loss(ml.ppo_loss(advantages, logprobs, ref_logprobs, agg="token_mean", kl="k1", kl_coef=0.01))
    ml.add_loss(ml.value_loss(values, advantages.returns, clip_range=0.2), weight=0.5)
