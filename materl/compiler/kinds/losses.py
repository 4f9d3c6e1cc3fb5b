"""Loss terms in the learner update: the policy loss (torch ops, or one fused Mojo kernel), the
clipped value loss, and preference losses (DPO and friends). Each gets the micro-batch's rows
and the mini-batch's global token/sequence counts, so micro-batch losses sum to the mini-batch
loss exactly."""

from __future__ import annotations

import torch
from torch import Tensor

from materl.compiler.episode import to_tensor
from materl.compiler.spec import Impl, Kind, OpSpec, Output, Role
from materl.graph.node import Node
from materl.kernels import policy_loss as fused
from materl.kernels.policy_loss import learner_policy_loss
from materl.ops._masked import place_on_last_trained
from materl.ops.advantages import discounted_returns
from materl.ops.aggregate import LOSS_AGG
from materl.ops.kl import kl_penalty
from materl.ops.losses import POLICY_LOSSES, value_loss
from materl.ops.masked_stats import masked_scalar
from materl.ops.preference import LENGTH_NORMALISED, PREFERENCE_LOSSES, sequence_logps

_LOSS = (Output("loss", Kind.OBJECT),)


def _denom(agg: str, counts: dict) -> float | None:
    if agg == "token_mean":
        return counts["tokens"]
    if agg.startswith("seq_mean"):
        return counts["seqs"]
    return None


# -- policy loss ------------------------------------------------------------------------------


def _split_params(node: Node) -> tuple[dict, dict]:
    p = dict(node.params)
    fixed = {k: p.pop(k, d) for k, d in (("loss", "ppo_clip"), ("agg", "token_mean"), ("kl", None),
                                         ("kl_coef", 0.0), ("norm", None))}
    return fixed, p


def torch_policy_loss(node: Node, logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor,
                      ref_logp: Tensor | None, *, denom: float | None) -> tuple[Tensor, dict]:
    fixed, hp = _split_params(node)
    per_token, stats = POLICY_LOSSES.get(fixed["loss"])(logp, old_logp, adv, mask, **hp)
    agg = LOSS_AGG.get(fixed["agg"])
    loss = agg(per_token, mask, denom=denom, norm=fixed["norm"])
    metrics = {k: masked_scalar(v, mask) for k, v in stats.items() if k != "ratio"}
    if ref_logp is not None:
        kl_B_T = kl_penalty(logp, ref_logp, estimator=fixed["kl"] or "k3")
        metrics["kl"] = masked_scalar(kl_B_T, mask)
        if fixed["kl_coef"]:
            loss = loss + fixed["kl_coef"] * agg(kl_B_T, mask, denom=denom, norm=fixed["norm"])
    return loss, metrics


def _policy_loss(fn):
    def learn(learner, node: Node, rows, get, denoms):
        logp_node = learner.forward_of(node.inputs[1])
        sb = learner.seq_batch(logp_node).rows(rows)
        ref = get(node.inputs[2]) if len(node.inputs) > 2 else None
        counts = learner.counts_for(logp_node, denoms)
        return fn(node, get(node.inputs[1]), sb.old_logprobs, get(node.inputs[0]), sb.mask, ref,
                  denom=_denom(node.params["agg"], counts))
    return learn


def _mojo_policy_loss(node, logp, old_logp, adv, mask, ref_logp, *, denom):
    return learner_policy_loss(node, logp, old_logp, adv, mask, ref_logp, denom=denom)


def _mojo_when(node: Node, options) -> str | None:
    ok, why = fused.supports(node.op, dict(node.params))
    return None if ok else why


def _policy_without_reference(node: Node) -> Node:
    """reference="none": no reference log-probs, so no KL term (its forward is then pruned)."""
    if len(node.inputs) < 3:
        return node
    params = {k: v for k, v in node.params.items() if k not in ("kl", "kl_coef")}
    return node.replace(inputs=node.inputs[:2], params=params)


# -- value loss --------------------------------------------------------------------------------


def value_loss_learn(learner, node: Node, rows, get, denoms):
    values_node = learner.forward_of(node.inputs[0])
    sb = learner.seq_batch(values_node).rows(rows)
    values = get(node.inputs[0])
    old_values = _old_values(learner, values_node, rows, values)
    if node.inputs[1].split(".")[1:] == ["returns"]:
        returns = get(node.inputs[1])
    else:
        rewards = get(node.inputs[1])
        if rewards.dim() == 1:
            rewards = place_on_last_trained(rewards, sb.mask)
        returns = discounted_returns(rewards, sb.mask, gamma=node.params["gamma"])
    per_token, stats = value_loss(values, old_values, returns, sb.mask, clip_range=node.params["clip_range"])
    counts = learner.counts_for(values_node, denoms)
    loss = LOSS_AGG.get("token_mean")(per_token, sb.mask, denom=counts["tokens"])
    return loss, {k: masked_scalar(v, sb.mask) for k, v in stats.items()}


def _old_values(learner, values_node: Node, rows, values: Tensor) -> Tensor:
    """The no-gradient values of prepare (the old values of the clipped loss)."""
    return to_tensor([learner.episodes[i].resolve(values_node.name) for i in rows.tolist()], width=values.shape[1])


def check_value_targets(node: Node, info) -> list[str]:
    target = node.inputs[1]
    producer = info.producer(target)
    if producer is not None and producer.op == "advantages" and "." not in target:
        return [f"value_loss {node.name!r} targets %{target}, the advantages; the value targets are the returns: "
                f"ml.value_loss(values, {target}.returns) (or the rewards, discounted to go)"]
    return []


# -- preference loss -----------------------------------------------------------------------------


def preference_learn(learner, node: Node, rows, get, denoms):
    params = dict(node.params)
    name = params.pop("loss")
    seqs, counts = [], None
    for ref in node.inputs:
        src = learner.forward_of(ref)
        sb = learner.seq_batch(src).rows(rows)
        counts = counts or learner.counts_for(src, denoms)
        seqs.append(sequence_logps(get(ref), sb.mask, average=name in LENGTH_NORMALISED))
    if len(seqs) == 2:  # reference-free (SimPO)
        seqs += [torch.zeros_like(seqs[0]), torch.zeros_like(seqs[0])]
    out = PREFERENCE_LOSSES.get(name)(*seqs, **params)
    loss = out.losses_B.sum() / counts["seqs"]
    margin = (out.chosen_rewards_B - out.rejected_rewards_B).detach()
    return loss, {"accuracy": float((margin > 0).float().mean()), "margin": float(margin.mean())}


SPECS = (
    OpSpec("policy_loss", Role.LOSS, _LOSS, (
        Impl("mojo", learn=_policy_loss(_mojo_policy_loss), when=_mojo_when, kernel=True),
        Impl("torch", learn=_policy_loss(torch_policy_loss)),
    ), locality="batch", without_reference=_policy_without_reference,
        doc="a registered policy loss, aggregated, plus a KL term with reference log-probs"),
    OpSpec("value_loss", Role.LOSS, _LOSS, (Impl("torch", learn=value_loss_learn),), locality="batch",
           check=check_value_targets, doc="clipped value loss against returns"),
    OpSpec("preference_loss", Role.LOSS, _LOSS, (Impl("torch", learn=preference_learn),), locality="batch",
           doc="a registered preference loss over sequence log-probs (DPO and friends)"),
)
