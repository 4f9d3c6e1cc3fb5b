"""Learner forwards over (prompt, completion) rows: per-token log-probs (chunked through the LM
head, no (B, T, V) tensor) and per-token values from a value head.

A trainable agent's log-probs are computed twice: in prepare they are the old log-probs of
PPO-style ratios, and in each micro-batch a forward with gradient. The old log-probs are the
sampling log-probs the engine returned (no forward pass), or with ``recompute=True`` a
no-gradient forward under the weights at the start of the step: the proximal policy that
off-policy corrections anchor on (``ml.with_off_policy_correction`` sets it). When the step takes
one optimizer step per batch over the prepare's micro-batches (``defers_proximal``), that forward
is not run: the update's first forward is the same computation on the same rows under the same
weights, so its detached log-probs are stored as the proximal ones (same bits; the PPO ratio is
then exactly 1). A frozen agent's log-probs (the reference) are one no-gradient forward.

The engine-vs-learner mismatch (``mismatch/mean_abs``, ``mismatch/max_abs``, ``mismatch/kl``,
``mismatch/kl_k1``: ``materl.ops.offpolicy.logprob_mismatch`` over trained tokens) is a metric of
every step whose trainable agent's log-probs are of sampled completions. With ``recompute=True``
it is the proximal log-probs' over the whole batch. Without, it costs nothing: the learner's
forwards before the first optimizer step run under the weights at the start of the step, so it is
over their rows (the whole batch unless ``mini_batch_size`` splits it, then the first mini-batch)."""

from __future__ import annotations

import torch
from torch import Tensor

from materl.compiler.graphs import graphed
from materl.compiler.packing import block_causal_mask, pack, unpack
from materl.compiler.sequences import SeqBatch, completion_hidden, gather_rows
from materl.compiler.spec import Impl, Kind, OpSpec, Output, Role
from materl.errors import CompileError
from materl.graph.node import Node
from materl.ops.logprobs import token_logprobs
from materl.ops.offpolicy import logprob_mismatch


def temperature(learner, node: Node) -> float:
    return node.params.get("temperature", learner.run.options.temperature) or 1.0


def forward_logprobs(learner, agent, sb: SeqBatch, *, temp: float, entropy: bool = False):
    """Log-probs (B, T) with gradient, and with ``entropy`` the entropy as a metric (no gradient:
    with a frozen LM head the hidden-state gradient is then formed in the forward). With
    ``max_tokens_per_micro_batch`` the rows run packed (``materl.compiler.packing``)."""
    o = learner.run.options
    if o.max_tokens_per_micro_batch is not None:
        return _to_learner(learner, _packed_logprobs(learner, agent, sb, temp=temp, entropy=entropy))
    if o.cuda_graphs:
        return _to_learner(learner, _graphed_logprobs(learner, agent, sb, temp=temp, entropy=entropy))
    with agent.autocast():  # bf16 compute over fp32 weights on CUDA; nothing on a CPU
        hidden = completion_hidden(agent, sb, share_prompts=o.share_prompts)
        weight, bias = agent.output_embedding()
        out = token_logprobs(hidden, weight, sb.completion_ids.to(hidden.device), bias=bias, temperature=temp,
                             chunk_size=o.logprob_chunk_size, return_entropy=entropy, entropy_grad=False)
    return _to_learner(learner, out)


def _graphed_logprobs(learner, agent, sb: SeqBatch, *, temp: float, entropy: bool):
    """``forward_logprobs`` on static shapes through a captured graph per bucket
    (``materl.compiler.graphs``); prompts are not shared (their prefix pass is dynamic)."""
    o = learner.run.options
    sb = sb.to(agent.device)  # a no-op unless this agent sits on another device than the batch
    capture = sb.device.type == "cuda"

    def make():
        def logprobs(input_ids, attention_mask, gather_idx, completion_ids):
            with agent.autocast():
                hidden = gather_rows(agent.hidden_states(input_ids, attention_mask), gather_idx)
                weight, bias = agent.output_embedding()
                return token_logprobs(hidden, weight, completion_ids, bias=bias, temperature=temp,
                                      chunk_size=o.logprob_chunk_size, return_entropy=entropy, entropy_grad=False)
        return logprobs

    fn = graphed(agent.model, ("logprobs", temp, entropy, o.logprob_chunk_size), make, capture=capture)
    return fn(sb.input_ids, sb.attention_mask, sb.gather_idx, sb.completion_ids)


def _packed_logprobs(learner, agent, sb: SeqBatch, *, temp: float, entropy: bool):
    """``forward_logprobs`` over packed rows: the LM head runs on the M real completion tokens
    only; the results return to the (B, T) layout (0 at padding). Under ``cuda_graphs`` through a
    captured graph per (N, M) bucket, the block mask built inside it."""
    o = learner.run.options
    sb = sb.to(agent.device)  # a no-op unless this agent sits on another device than the batch
    packed = pack(sb, static=o.cuda_graphs)

    def make():
        def logprobs(input_ids, position_ids, segment_ids, hidden_idx, targets):
            mask = block_causal_mask(segment_ids) if o.cuda_graphs else None
            with agent.autocast():
                hidden_M_H = agent.hidden_states(input_ids, mask, position_ids=position_ids)[0, hidden_idx]
                weight, bias = agent.output_embedding()
                return token_logprobs(hidden_M_H[None], weight, targets[None], bias=bias, temperature=temp,
                                      chunk_size=o.logprob_chunk_size, return_entropy=entropy, entropy_grad=False)
        return logprobs

    args = (packed.input_ids, packed.position_ids, packed.segment_ids, packed.hidden_idx, packed.targets)
    if o.cuda_graphs:
        check_graphable_attention(agent)
        fn = graphed(agent.model, ("packed-logprobs", temp, entropy, o.logprob_chunk_size), make,
                     capture=packed.input_ids.device.type == "cuda")
    else:
        fn = make()
    out = fn(*args)
    return tuple(unpack(t[0], packed) for t in out) if isinstance(out, tuple) else unpack(out[0], packed)


def check_graphable_attention(agent) -> None:
    """Packed rows under ``cuda_graphs`` pass a prepared boolean block mask, which SDPA reads."""
    impl = getattr(getattr(agent.model, "config", None), "_attn_implementation", "sdpa")
    if impl != "sdpa":
        raise CompileError(f"max_tokens_per_micro_batch with cuda_graphs=True runs packed rows through a captured "
                           f"graph with a boolean block mask, which needs attn_implementation='sdpa'; agent "
                           f"{agent.name!r} uses {impl!r}. Use cuda_graphs=False (transformers then builds the "
                           f"mask for {impl!r}) or load the model with SDPA attention")


def forward_values(learner, agent, sb: SeqBatch) -> Tensor:
    if learner.run.options.max_tokens_per_micro_batch is not None:
        sb = sb.to(agent.device)
        packed = pack(sb)
        with agent.autocast():
            hidden_M_H = agent.hidden_states(packed.input_ids, None, position_ids=packed.position_ids)[
                0, packed.hidden_idx]
            return _to_learner(learner, unpack(agent.values_of_hidden(hidden_M_H), packed))
    with agent.autocast():
        values = agent.values_of_hidden(completion_hidden(agent, sb, share_prompts=learner.run.options.share_prompts))
    return _to_learner(learner, values)


def _to_learner(learner, out):
    """A forward's outputs on the learner's device (from an agent that sits elsewhere)."""
    if isinstance(out, tuple):
        return tuple(_to_learner(learner, t) for t in out)
    return out.to(learner.device) if out.device != learner.device else out


def _no_grad(learner, node: Node, fn) -> Tensor:
    """``fn`` over the whole batch's rows, in the update's micro-batch sizes (rows or tokens)."""
    sb = learner.seq_batch(node)
    rows = torch.arange(len(sb.lengths))
    out = None
    with torch.no_grad():
        for idx in learner.micro_batching().split(rows):
            part = fn(sb.rows(idx)).float()
            if out is None:
                out = part.new_zeros(len(rows), part.shape[1])
            out[idx.to(out.device)] = part
    return out


def recomputes(node: Node) -> bool:
    """Whether a logprobs node's old log-probs are recomputed by the learner (the proximal policy)."""
    return bool(node.params.get("recompute"))


def defers_proximal(learner, node: Node) -> bool:
    """Whether the proximal log-probs of a ``recompute=True`` node come from the update's own
    forward instead of a prepare forward: one epoch, one mini-batch and no shuffling (so the
    update's micro-batches are the prepare's rows, all under the weights at the start of the step)
    and no prepare node reads them; one process (learner ranks each run a share of the rows)."""
    from materl.compiler.learner import WholeBatch

    o, plan, n = learner.run.options, learner.plan, len(learner.batch)  # rows
    return (recomputes(node) and node.name in plan.live and o.epochs == 1 and not o.shuffle
            and isinstance(learner.partition, WholeBatch)
            and (o.mini_batch_size or n) >= n
            and not any(node.name in plan.nodes[p].input_nodes for p in plan.prepare))


def logprobs_prepare(learner, node: Node, *, live: bool) -> Tensor | None:
    if live and not recomputes(node):
        return learner.seq_batch(node).old_logprobs  # the sampling log-probs are the old log-probs
    if defers_proximal(learner, node):
        return None  # logprobs_learn stores them
    agent = learner.run.agent(node)
    logp = _no_grad(learner, node, lambda sb: forward_logprobs(learner, agent, sb, temp=temperature(learner, node)))
    if recomputes(node) and _sampled(learner, node):
        full = learner.seq_batch(node)
        learner.batch_metrics |= _mismatch_metrics(logp, full.old_logprobs, full.mask)
    return logp


def prepared_logprobs(learner, node: Node, rows: Tensor) -> Tensor:
    """The (len(rows), T) log-probs prepare stored for ``node``: with ``recompute=True`` the proximal
    policy's, else the sampling log-probs."""
    return learner.batch.stacked(node.name, rows, width=learner.seq_batch(node).width)


def logprobs_learn(learner, node: Node, rows, get, denoms):
    sb = learner.seq_batch(node).rows(rows)
    logp, ent = forward_logprobs(learner, learner.run.agent(node), sb, temp=temperature(learner, node), entropy=True)
    if learner.updates == 0 and not recomputes(node) and _sampled(learner, node):
        _gather_mismatch(learner, node, sb, logp)
    elif defers_proximal(learner, node):
        proximal = logp.detach().float()  # as prepare would have stored them
        learner.batch.put_rows(node.name, rows, proximal)
        if _sampled(learner, node):
            _gather_mismatch(learner, node, sb, proximal)
    return logp, {"entropy": float((ent.detach() * sb.mask).sum() / sb.mask.sum().clamp(min=1))}


def _gather_mismatch(learner, node: Node, sb: SeqBatch, logp: Tensor) -> None:
    """mismatch/* without recompute: this forward runs under the weights at the start of the step
    (no optimizer step yet), so its log-probs are the learner's; the metrics cover every row seen
    before the first optimizer step (on every learner rank)."""
    learner.gather(f"mismatch/{node.name}", (logp.detach(), sb.old_logprobs, sb.mask), _finish_mismatch)


def _finish_mismatch(seen: list[tuple[Tensor, Tensor, Tensor]]) -> dict[str, float]:
    if len(seen) == 1:  # one micro-batch: its tensors as they are
        return _mismatch_metrics(*seen[0])
    return _mismatch_metrics(*(torch.cat(parts) for parts in zip(*seen)))  # rows of one SeqBatch: one width


def _mismatch_metrics(learner_logp: Tensor, sampling_logp: Tensor, mask: Tensor) -> dict[str, float]:
    return {f"mismatch/{k}": v for k, v in logprob_mismatch(learner_logp, sampling_logp, mask).items()}


def _sampled(learner, node: Node) -> bool:
    """Whether the node's completions were sampled (rollouts carry sampling log-probs; offline
    text, e.g. DPO pairs, does not)."""
    _, comps_ref = learner.sequence_refs(node)
    return bool(learner.episodes) and not isinstance(learner.episodes[0].resolve(comps_ref), str)


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


def recompute_needs_training(node: Node, agent) -> str | None:
    if recomputes(node) and not getattr(agent, "trainable", False):
        return (f"node {node.name!r} has recompute=True but agent {node.agents[0]!r} is frozen: its log-probs are "
                f"always computed by the learner (recompute applies to a trainable agent's old log-probs)")
    return None


def _describe_logprobs(node: Node, impl: str) -> str:
    if not recomputes(node):
        return ""
    return (f"%{node.name}: old log-probs recomputed by the learner (the proximal policy: no gradient, weights at "
            f"the start of the step; a prepare forward, or the update's own forward, detached, when a step makes "
            f"one optimizer step per batch in one process); mismatch/* compare them with the engine's sampling "
            f"log-probs")


SPECS = (
    OpSpec("logprobs", Role.FORWARD, (Output("logprobs", Kind.TOKENS),),
           (Impl("torch-chunked", prepare=logprobs_prepare, learn=logprobs_learn),), locality="batch",
           agent_check=recompute_needs_training, describe=_describe_logprobs,
           doc="per-token log-probs of the completions under an agent (B, T)"),
    OpSpec("values", Role.FORWARD, (Output("values", Kind.TOKENS),),
           (Impl("torch", prepare=values_prepare, learn=values_learn),), locality="batch",
           agent_check=needs_value_head, doc="per-token values from an agent with a value head (B, T)"),
)
