"""Dr. GRPO — "Understanding R1-Zero-Like Training" (Liu et al. 2025, arXiv:2503.20783).

GRPO without its two biases: advantages are only mean-centred (no division by the group std),
and the loss sums tokens and divides by a constant (the generation budget T) instead of each
sequence's length (``seq_mean_token_sum_norm``). Like the paper, no KL term.

Equal, node for node, to ``ml.replace``-ing grpo's advantages and loss (tests check it).
"""

import materl as ml


@ml.recipe
def dr_grpo(policy, ref_policy, prompts):
    completions = ml.generate(policy, prompts, name="completions")
    policy_logprobs = ml.logprobs(policy, prompts, completions, name="policy_logprobs")
    ref_logprobs = ml.logprobs(ref_policy, prompts, completions, name="ref_logprobs")
    rewards = ml.reward("length", weight=0.1) + ml.reward("diversity", weight=0.9)
    advantages = ml.advantages(rewards, estimator="dr_grpo", name="advantages")
    ml.set_loss(ml.policy_loss(advantages, policy_logprobs, ref_logprobs, loss="ppo_clip",
                               agg="seq_mean_token_sum_norm", kl="k3", kl_coef=0.0))
