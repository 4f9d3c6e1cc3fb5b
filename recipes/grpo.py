"""GRPO — Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

The canonical recipe: G samples per prompt, advantages normalised by the group's mean and
std, the clipped surrogate averaged per sequence then over sequences, and a k3 KL penalty to a
frozen reference at beta=0.04, as in the paper.

Differences from the paper: the reward is a placeholder mix of two built-ins (length and
diversity); swap it with a transform, e.g.
``ml.replace(grpo, "rewards", lambda g: ml.reward("math_answer"))``. Old log-probs are the
engine's sampling log-probs (no extra forward pass). TRL's GRPOTrainer default (beta=0, loss_type
"dapo") differs; verl's default agg is token-mean.
"""

import materl as ml


@ml.recipe
def grpo(policy, ref_policy, prompts):
    completions = ml.generate(policy, prompts, name="completions")
    policy_logprobs = ml.logprobs(policy, prompts, completions, name="policy_logprobs")
    ref_logprobs = ml.logprobs(ref_policy, prompts, completions, name="ref_logprobs")
    rewards = ml.reward("length", weight=0.1) + ml.reward("diversity", weight=0.9)
    advantages = ml.advantages(rewards, name="advantages")
    ml.set_loss(ml.grpo_loss(advantages, policy_logprobs, ref_logprobs))
