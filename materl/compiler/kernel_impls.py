"""Policy-loss implementations for the learner: the torch op path, and the fused Mojo kernel
where ``materl.kernels`` provides one for the node's settings."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from materl.graph.node import Node
from materl.ops.masked_stats import masked_scalar


def _split_params(node: Node) -> tuple[dict, dict]:
    p = dict(node.params)
    fixed = {k: p.pop(k, d) for k, d in (("loss", "ppo_clip"), ("agg", "token_mean"), ("kl", None),
                                         ("kl_coef", 0.0), ("norm", None))}
    return fixed, p


def torch_policy_loss(node: Node, logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor,
                      ref_logp: Tensor | None, *, denom: float | None) -> tuple[Tensor, dict]:
    from materl.ops.aggregate import LOSS_AGG
    from materl.ops.kl import kl_penalty
    from materl.ops.losses import POLICY_LOSSES

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


def supports(node: Node) -> tuple[bool, str]:
    """Whether a fused kernel can run this node (and why not)."""
    try:
        from materl.kernels import policy_loss as fused
    except ImportError as e:
        return False, f"materl.kernels.policy_loss unavailable ({e})"
    return fused.supports(node.op, dict(node.params))


def policy_loss_for(label: str) -> Callable:
    if label == "mojo":
        from materl.kernels.policy_loss import learner_policy_loss

        return learner_policy_loss
    return torch_policy_loss
