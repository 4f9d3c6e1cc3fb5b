"""On-policy distillation (Thinking Machines, "On-Policy Distillation", Lu et al. 2025,
https://thinkingmachines.ai/blog/on-policy-distillation; tinker-cookbook
``distillation/train_on_policy.py``).

The student (``policy``) samples; a frozen ``teacher`` (any engine, any device, the same
tokenizer: checked at compile time) scores each sampled token with its own log-prob of the exact
ids; each token's advantage is the negative reverse KL ``-(log pi_student - log pi_teacher)``
(``ml.distill_advantages``: ``coef``, and ``discount``, tinker's ``kl_discount_factor``, default 0).
No reward and no groups: ``group_size=1`` is enough. The loss is tinker's default
"importance_sampling": REINFORCE with the untruncated, stop-gradient ratio pi/pi_sampler, which has
the same gradient on-policy, and corrects for stale samples under the async pipeline
(``max_staleness``).

Differences from tinker: the loss is a token mean over the batch (tinker sums tokens), and the
advantage is 0 on untrained tokens. To distil into a recipe with task rewards, use
``ml.with_distillation(recipe, "teacher", weight)`` instead. Multi-turn tool use: distil a tool
recipe with the transform; tool output is never scored (its loss mask is 0).
"""

import materl as ml


@ml.recipe
def distill(policy, teacher, prompts):
    completions = ml.generate(policy, prompts, name="completions")
    policy_logprobs = ml.logprobs(policy, prompts, completions, name="policy_logprobs")
    teacher_logprobs = ml.logprobs(teacher, prompts, completions, name="teacher_logprobs")
    advantages = ml.distill_advantages(policy_logprobs, teacher_logprobs, coef=1.0, discount=0.0, name="advantages")
    ml.set_loss(ml.reinforce_loss(advantages, policy_logprobs, agg="token_mean", is_threshold=None))
