"""VAPO — Value-based Augmented PPO (Yue et al. 2025, arXiv:2504.05118), written as a transform of GRPO:
GRPO with the group advantages replaced by GAE over a value model, plus a value loss.

The critic's targets are lambda=1 returns (rewards-to-go), VAPO's "decoupled GAE" for the
critic. Differences from the paper: the policy's GAE uses lambda=1 here (the paper adapts
lambda to the length, ``lam`` is a keyword of ml.gae_advantages), and there is no value
pre-training, positive-example LM loss or clip-higher.
"""

import materl as ml
from materl.recipes.grpo import grpo


@ml.algorithm(using=grpo)
def vapo(graph, value_model):
    values = ml.values(value_model, graph.prompts, graph.completions)
    graph.advantages.replace_with(ml.gae_advantages(graph.rewards, values))
    ml.add_loss(ml.value_loss(values, graph.rewards))
