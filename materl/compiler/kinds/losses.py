"""Loss terms in the learner update: the policy loss (torch ops, or one fused Mojo kernel), the
clipped value loss, and preference losses (DPO and friends). Each gets the micro-batch's rows
and the mini-batch's global token/sequence counts, so micro-batch losses sum to the mini-batch
loss exactly.

A policy loss's old log-probs are those its logprobs node prepared: the engine's sampling
log-probs, or with ``recompute=True`` the proximal policy's. With an off-policy correction
(``correction={method: ..., ...}`` on the node, from ``ml.with_off_policy_correction``) each
token's loss is weighted by ``materl.ops.offpolicy.CORRECTIONS[method](proximal, sampling, mask)``,
whose stats are metrics (``policy_loss/is_weight``, ``policy_loss/is_truncated`` or
``policy_loss/is_rejected``)."""

from __future__ import annotations

import torch
from torch import Tensor

from materl.compiler.kinds.forward import prepared_logprobs, recomputes
from materl.compiler.spec import Impl, Kind, OpSpec, Output, Role, spec_of
from materl.graph.node import Node
from materl.kernels import policy_loss as fused
from materl.kernels.policy_loss import learner_policy_loss
from materl.ops._masked import place_on_last_trained
from materl.ops.advantages import discounted_returns
from materl.ops.aggregate import LOSS_AGG
from materl.ops.kl import ESTIMATOR_DEFAULT, bias_corrected_kl, kl_penalty
from materl.ops.losses import POLICY_LOSSES, value_loss
from materl.ops.masked_stats import masked_scalar
from materl.ops.offpolicy import CORRECTIONS
from materl.ops.preference import LENGTH_NORMALISED, PREFERENCE_LOSSES, sequence_logps

_LOSS = (Output("loss", Kind.OBJECT),)


def _denom(agg: str, counts: dict) -> float | None:
    if agg == "token_mean":
        return counts["tokens"]
    if agg.startswith("seq_mean"):
        return counts["seqs"]
    return None


# -- policy loss ------------------------------------------------------------------------------


_FIXED = (("loss", "ppo_clip"), ("agg", "token_mean"), ("kl", None), ("kl_coef", 0.0), ("norm", None),
          ("kl_clamp", ESTIMATOR_DEFAULT), ("kl_bias_correction", False), ("correction", None))


def _split_params(node: Node) -> tuple[dict, dict]:
    p = dict(node.params)
    fixed = {k: p.pop(k, d) for k, d in _FIXED}
    return fixed, p


def torch_policy_loss(node: Node, logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor,
                      ref_logp: Tensor | None, *, denom: float | None,
                      weights: Tensor | None = None) -> tuple[Tensor, dict]:
    fixed, hp = _split_params(node)
    per_token, stats = POLICY_LOSSES.get(fixed["loss"])(logp, old_logp, adv, mask, **hp)
    if weights is not None:
        per_token = per_token * weights.detach()
    agg = LOSS_AGG.get(fixed["agg"])
    loss = agg(per_token, mask, denom=denom, norm=fixed["norm"])
    metrics = {k: masked_scalar(v, mask) for k, v in stats.items() if k != "ratio"}
    if ref_logp is not None:
        kw = dict(estimator=fixed["kl"] or "k3", clamp=fixed["kl_clamp"])
        if fixed["kl_bias_correction"]:
            kl_B_T = bias_corrected_kl(logp, ref_logp, old_logp, **kw)
        else:
            kl_B_T = kl_penalty(logp, ref_logp, **kw)
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
        old = prepared_logprobs(learner, logp_node, rows) if recomputes(logp_node) else sb.old_logprobs
        weights, stats = correction_weights(node, old, sb.old_logprobs, sb.mask)
        loss, metrics = fn(node, get(node.inputs[1]), old, get(node.inputs[0]), sb.mask, ref,
                           denom=_denom(node.params["agg"], counts), weights=weights)
        return loss, metrics | {k: masked_scalar(v, sb.mask) for k, v in stats.items()}
    return learn


def correction_weights(node: Node, proximal: Tensor, sampling: Tensor, mask: Tensor) -> tuple[Tensor | None, dict]:
    """The node's off-policy correction weights (None without one) and their per-token stats."""
    if node.params.get("correction") is None:
        return None, {}
    hp = dict(node.params["correction"])
    return CORRECTIONS.get(hp.pop("method"))(proximal, sampling, mask, **hp)


def _mojo_policy_loss(node, logp, old_logp, adv, mask, ref_logp, *, denom, weights=None):
    return learner_policy_loss(node, logp, old_logp, adv, mask, ref_logp, denom=denom, weights=weights)


def _mojo_when(node: Node, options) -> str | None:
    ok, why = fused.supports(node.op, dict(node.params))
    return None if ok else why


def _policy_without_reference(node: Node) -> Node:
    """reference="none": no reference log-probs, so no KL term (its forward is then pruned)."""
    if len(node.inputs) < 3:
        return node
    params = {k: v for k, v in node.params.items() if k not in ("kl", "kl_coef", "kl_clamp", "kl_bias_correction")}
    return node.replace(inputs=node.inputs[:2], params=params)


def check_correction(node: Node, info) -> list[str]:
    """A corrected policy loss needs recomputed (proximal) log-probs to weigh against the sampler's."""
    corr = node.params.get("correction")
    if corr is None:
        return []
    if not isinstance(corr, dict) or corr.get("method") not in CORRECTIONS.names():
        return [f"policy loss {node.name!r}: correction must be {{'method': one of {', '.join(CORRECTIONS.names())}, "
                f"...its hyperparameters}} (ml.with_off_policy_correction writes it); got {corr!r}"]
    producer = info.producer(node.inputs[1])
    if producer is not None and spec_of(producer).facts.logprobs and recomputes(producer):
        return []
    what = f"%{producer.name} ({producer.op})" if producer is not None else f"%{node.inputs[1]}"
    return [f"policy loss {node.name!r} has an off-policy correction ({node.params['correction']['method']}) but "
            f"its log-probs {what} are not recomputed by the learner; apply ml.with_off_policy_correction to the "
            f"recipe, or pass recompute=True to ml.logprobs"]


def _describe_policy_loss(node: Node, impl: str) -> str:
    corr = node.params.get("correction")
    if corr is None:
        return ""
    hp = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in corr.items() if k != "method")
    return (f"%{node.name}: off-policy correction {corr['method']}({hp}): ratio pi/pi_proximal, each token's loss "
            f"weighted by w(pi_proximal/pi_sampling), no gradient (materl.ops.offpolicy)")


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
    return learner.batch.stacked(values_node.name, rows, width=values.shape[1])


def _reads_advantages_not_returns(producer: Node) -> bool:
    """A value target read as ``%producer`` whose default output is advantages beside returns."""
    names = [o.name for o in spec_of(producer).outputs]
    return names[0] == "advantages" and "returns" in names


def check_value_targets(node: Node, info) -> list[str]:
    target = node.inputs[1]
    producer = info.producer(target)
    if producer is not None and "." not in target and _reads_advantages_not_returns(producer):
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
        logp = get(ref)  # a prepared (reference) value is padded to the batch's widest row: back to this one's
        logp = logp[:, :sb.mask.shape[1]] if logp.shape[1] >= sb.mask.shape[1] else \
            torch.nn.functional.pad(logp, (0, sb.mask.shape[1] - logp.shape[1]))
        seqs.append(sequence_logps(logp, sb.mask, average=name in LENGTH_NORMALISED))
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
    ), locality="batch", without_reference=_policy_without_reference, check=check_correction,
        describe=_describe_policy_loss,
        doc="a registered policy loss, aggregated, plus a KL term with reference log-probs"),
    OpSpec("value_loss", Role.LOSS, _LOSS, (Impl("torch", learn=value_loss_learn),), locality="batch",
           check=check_value_targets, doc="clipped value loss against returns"),
    OpSpec("preference_loss", Role.LOSS, _LOSS, (Impl("torch", learn=preference_learn),), locality="batch",
           doc="a registered preference loss over sequence log-probs (DPO and friends)"),
)
