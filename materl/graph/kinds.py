"""What the graph layer knows about node kinds: a table from a kind to the facts that building and
transforming recipes read, so no code compares a node's kind with a string.

    facts(node).policy_gradient     # with_kl, off-policy correction and distillation rewrite it

The compiler's op table (``materl.compiler.spec.OPS``) says everything else about a kind (role,
outputs, implementations, checks) and reads these facts through ``OpSpec.facts``;
tests/compiler/test_spec.py checks that the two tables agree (the rollout kinds are the
``Role.ROLLOUT`` specs, the data kind the ``Role.DATA`` one, every kind here is an op kind).
"""

from __future__ import annotations

from dataclasses import dataclass

from materl.graph.node import Node


@dataclass(frozen=True)
class KindFacts:
    data: bool = False  # a recipe input (a dataset column), never an agent
    rollout: bool = False  # its value is an episode's rollout: what rewards and advantages score by default
    reward_sum: bool = False  # the weighted sum of reward terms (``params["terms"]``)
    logprobs: bool = False  # per-token log-probs of an agent's sampled tokens (a policy loss's ratio reads them)
    policy_gradient: bool = False  # a policy-gradient loss: the KL term, off-policy correction and distillation


KINDS: dict[str, KindFacts] = {
    "input": KindFacts(data=True),
    "generate": KindFacts(rollout=True),
    "generate_step": KindFacts(rollout=True),
    "structure_rollout": KindFacts(rollout=True),
    "env_rollout": KindFacts(rollout=True),
    "agent_episodes": KindFacts(rollout=True),
    "self_play": KindFacts(rollout=True),
    "rewards": KindFacts(reward_sum=True),
    "logprobs": KindFacts(logprobs=True),
    "policy_loss": KindFacts(policy_gradient=True),
}

_NONE = KindFacts()


def facts_of(kind: str) -> KindFacts:
    """The facts of ``kind`` (none for a kind the graph layer needs nothing about)."""
    return KINDS.get(kind, _NONE)


def facts(node: Node) -> KindFacts:
    return facts_of(node.op)
