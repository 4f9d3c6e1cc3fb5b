"""Learner forwards over (prompt, completion) rows: per-token log-probs (chunked through the LM
head, no (B, T, V) tensor) and per-token values from a value head.

A trainable agent's log-probs are computed twice: in prepare they are the sampling log-probs the
engine returned (the old log-probs of PPO-style ratios, no forward pass), and in each micro-batch
a forward with gradient. A frozen agent's (the reference) are one no-gradient forward."""

from __future__ import annotations

import torch
from torch import Tensor

from materl.compiler.sequences import SeqBatch, completion_hidden
from materl.compiler.spec import Impl, Kind, OpSpec, Output, Role
from materl.graph.node import Node
from materl.ops.logprobs import token_logprobs


def temperature(learner, node: Node) -> float:
    return node.params.get("temperature", learner.run.options.temperature) or 1.0


def forward_logprobs(learner, agent, sb: SeqBatch, *, temp: float, entropy: bool = False):
    """Log-probs (B, T) with gradient, and with ``entropy`` the entropy as a metric (no gradient:
    with a frozen LM head the hidden-state gradient is then formed in the forward)."""
    o = learner.run.options
    hidden = completion_hidden(agent, sb, share_prompts=o.share_prompts)
    weight, bias = agent.output_embedding()
    return token_logprobs(hidden, weight, sb.completion_ids, bias=bias, temperature=temp,
                          chunk_size=o.logprob_chunk_size, return_entropy=entropy, entropy_grad=False)


def forward_values(learner, agent, sb: SeqBatch) -> Tensor:
    return agent.values_of_hidden(completion_hidden(agent, sb, share_prompts=learner.run.options.share_prompts))


def _no_grad(learner, node: Node, fn) -> Tensor:
    sb = learner.seq_batch(node)
    micro = learner.run.options.micro_batch_size or len(sb.lengths)
    with torch.no_grad():
        parts = [fn(sb.rows(torch.arange(i, min(i + micro, len(sb.lengths))))) for i in range(0, len(sb.lengths), micro)]
    return torch.cat(parts).float()


def logprobs_prepare(learner, node: Node, *, live: bool) -> Tensor:
    if live:
        return learner.seq_batch(node).old_logprobs  # the sampling log-probs are the old log-probs
    agent = learner.run.agent(node)
    return _no_grad(learner, node, lambda sb: forward_logprobs(learner, agent, sb, temp=temperature(learner, node)))


def logprobs_learn(learner, node: Node, rows, get, denoms):
    sb = learner.seq_batch(node).rows(rows)
    logp, ent = forward_logprobs(learner, learner.run.agent(node), sb, temp=temperature(learner, node), entropy=True)
    return logp, {"entropy": float((ent.detach() * sb.mask).sum() / sb.mask.sum().clamp(min=1))}


def values_prepare(learner, node: Node, *, live: bool) -> Tensor:
    agent = learner.run.agent(node)
    return _no_grad(learner, node, lambda sb: forward_values(learner, agent, sb))


def values_learn(learner, node: Node, rows, get, denoms):
    return forward_values(learner, learner.run.agent(node), learner.seq_batch(node).rows(rows)), {}


def needs_value_head(node: Node, agent) -> str | None:
    if getattr(agent, "head", None) != "value":
        return (f"node {node.name!r} reads values from agent {node.agents[0]!r}, which has no value head; "
                f"create it with ml.Agent(..., head='value')")
    return None


SPECS = (
    OpSpec("logprobs", Role.FORWARD, (Output("logprobs", Kind.TOKENS),),
           (Impl("torch-chunked", prepare=logprobs_prepare, learn=logprobs_learn),), locality="batch",
           doc="per-token log-probs of the completions under an agent (B, T)"),
    OpSpec("values", Role.FORWARD, (Output("values", Kind.TOKENS),),
           (Impl("torch", prepare=values_prepare, learn=values_learn),), locality="batch",
           agent_check=needs_value_head, doc="per-token values from an agent with a value head (B, T)"),
)
