"""DAPO — Decoupled Clip and Dynamic sAmpling Policy Optimization (Yu et al. 2025, arXiv:2503.14476).

Four changes to GRPO, all here: clip-higher (eps_low=0.2, eps_high=0.28), token-level loss
(``token_mean`` over the batch), dynamic sampling (groups whose rewards are all equal carry no
signal and are filtered), and overlong reward shaping (a soft penalty as a completion nears the
length budget). No KL term, as in the paper.

Differences: dynamic sampling drops the filtered groups from this step, so a step trains on
fewer groups than it sampled; the paper (and verl's ``filter_groups``) keeps sampling new prompts
until the batch is full. A step in which every group is filtered makes no update and stops the
run with that reason (``StepFailedError``).
Note: some code calls a pairwise preference loss "DAPO"; this is the published algorithm.
"""

import materl as ml


def overlong_penalty(*, completion_ids, max_length: int = 64, cache: int = 16, **_):
    """DAPO eq. 13: 0 while |y| <= L_max - L_cache, then linearly down to -1 at L_max."""
    out = []
    for ids in completion_ids:
        n = len(ids)
        if n <= max_length - cache:
            out.append(0.0)
        elif n <= max_length:
            out.append((max_length - cache - n) / cache)
        else:
            out.append(-1.0)
    return out


@ml.recipe
def dapo(policy, prompts):
    completions = ml.generate(policy, prompts, name="completions")
    logprobs = ml.logprobs(policy, prompts, completions, name="policy_logprobs")
    rewards = ml.reward("length", weight=0.1) + ml.reward("diversity", weight=0.9) \
        + ml.reward(overlong_penalty, name="overlong")
    ml.filter_groups(rewards, name="dynamic_sampling")
    advantages = ml.advantages(rewards, estimator="grpo", name="advantages")
    ml.set_loss(ml.ppo_loss(advantages, logprobs, agg="token_mean", eps_low=0.2, eps_high=0.28))
