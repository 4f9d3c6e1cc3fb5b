"""The advantages node: a registered estimator (``materl.ops.advantages``) over the rewards, with
``%advantages`` and ``%advantages.returns`` as outputs, optionally with a KL penalty in the
reward (verl's ``use_kl_in_reward``). GRPO and RLOO over per-completion rewards also have a Mojo
kernel (``materl.kernels.group_advantages``); token-level rewards always take the torch op.
Step rewards under grpo / dr_grpo are credited by ``process`` (DeepSeekMath's process
supervision, ``materl.ops.step_credit``) unless the node says ``step_credit="sum"``.

Inputs: rewards, the scored rollout (its loss mask), then the estimator's extra tensors
(a baseline or values), then with ``kl_coef > 0`` the reference and the policy log-probs.
Estimators that read the rollouts' turns (turn-level GRPO, GiGPO: ``materl.ops.turn_credit``)
get them from ``materl.compiler.turns``. A per-completion reward among token-level ones lands on
its row's last trained token. Each episode's advantages and returns are as long as its
completion.
"""

from __future__ import annotations

from torch import Tensor

from materl.compiler.context import StageEnv
from materl.compiler.episode import Episode, as_rollout, is_scalar, pad_rows, to_tensor
from materl.compiler.spec import NOT_FOR, Impl, Kind, OpSpec, Output, Role
from materl.compiler.turns import ROLLOUT_PARAMS, rollout_tensors
from materl.errors import CompileError
from materl.graph.node import Node
from materl.kernels.advantages import ESTIMATORS, group_advantages
from materl.kernels.loader import load_or_reason
from materl.ops._masked import place_on_last_trained
from materl.ops.advantages import ADVANTAGES
from materl.ops.kl import kl_penalty
from materl.ops.step_credit import GRPO_FAMILY, PROCESS_SCALES


def _tensors(node: Node, inputs: list[list]) -> tuple[Tensor, Tensor, list[Tensor], dict]:
    """(rewards, mask, extra tensors, estimator hyperparameters), the KL penalty applied."""
    p = dict(node.params)
    for key in ("estimator", "step_credit", *ROLLOUT_PARAMS):
        p.pop(key, None)
    kl_coef, kl = p.pop("kl_coef", 0.0), p.pop("kl", "k1")
    mask = pad_rows([as_rollout(x).loss_mask for x in inputs[1]])
    width = mask.shape[1]
    rewards = _rewards(inputs[0], mask)
    n_extra = len(inputs) - 2 - (2 if kl_coef else 0)
    extra = [to_tensor(v, width=width) for v in inputs[2:2 + n_extra]]
    if kl_coef:
        ref, old = (to_tensor(v, width=width) for v in inputs[2 + n_extra:])
        if rewards.dim() == 1:
            rewards = place_on_last_trained(rewards, mask)
        rewards = rewards - kl_coef * kl_penalty(old, ref, estimator=kl) * mask
    return rewards, mask, extra, p


def _rewards(items, mask: Tensor) -> Tensor:
    """(B,) per-completion rewards, or (B,T) token-level ones where any row has them; a row's
    single number among token-level rows goes on its last trained token."""
    if isinstance(items, Tensor) or all(is_scalar(x) for x in items):
        return to_tensor(items, width=mask.shape[1])
    rows = [place_on_last_trained(to_tensor([x]), mask[i:i + 1])[0] if is_scalar(x) else x
            for i, x in enumerate(items)]
    return to_tensor(rows, width=mask.shape[1])


def _per_episode(out: dict[str, Tensor], inputs: list[list]) -> dict[str, list[Tensor]]:
    """Each output as one row per episode, cut to its completion (a TOKENS value is as long as it,
    whatever the other episodes of the call)."""
    lengths = [sum(len(s.token_ids) for s in as_rollout(x).steps) for x in inputs[1]]
    return {k: [v[i, :n] for i, n in enumerate(lengths)] for k, v in out.items()}


def _estimator(node: Node, inputs: list[list], hp: dict) -> tuple[str, dict]:
    """The estimator to run: ``process`` for a GRPO-family node whose rewards have step rewards
    (a per-token rewards value, before any KL penalty) unless ``step_credit="sum"``."""
    est = node.params["estimator"]
    credit = node.params.get("step_credit")
    if credit is not None and est not in GRPO_FAMILY:
        raise CompileError(f"node {node.name!r}: step_credit={credit!r} applies to the GRPO family "
                           f"({', '.join(GRPO_FAMILY)}); estimator {est!r} sums step rewards like verl")
    has_steps = to_tensor(inputs[0]).dim() == 2
    if est not in GRPO_FAMILY or not has_steps or credit == "sum":
        return est, hp
    scale = hp.get("scale", GRPO_FAMILY[est])
    if scale not in PROCESS_SCALES:
        raise CompileError(f"node {node.name!r}: step rewards are credited by 'process', which normalises per "
                           f"group; scale={scale!r} has no process form (valid: {', '.join(PROCESS_SCALES)}); "
                           f"or pass step_credit='sum' for verl's summed reward")
    return "process", {"eps": hp.get("eps", 1e-6), "scale": scale}


def advantages_torch(run: StageEnv, node: Node, eps: list[Episode], inputs: list[list]) -> dict:
    rewards, mask, extra, hp = _tensors(node, inputs)
    est, hp = _estimator(node, inputs, hp)
    fn = ADVANTAGES.get(est)
    derived = rollout_tensors(fn, node, [as_rollout(x) for x in inputs[1]], mask.shape[1])
    adv, returns = fn(rewards.double(), mask.double(), *[e.double() for e in extra], *derived,
                      group_ids=[ep.group_id for ep in eps], **hp)
    return _per_episode({"advantages": adv.float(), "returns": returns.float()}, inputs)


def advantages_mojo(run: StageEnv, node: Node, eps: list[Episode], inputs: list[list]) -> dict:
    """GRPO/RLOO in one kernel call over (B,) rewards; returns = advantages, as the op's."""
    rewards, mask, _, hp = _tensors(node, inputs)
    if rewards.dim() != 1:  # token-level rewards: the op's per-token returns-to-go
        return advantages_torch(run, node, eps, inputs)
    adv = group_advantages(rewards.double(), mask.double(), estimator=node.params["estimator"],
                           group_ids=[ep.group_id for ep in eps], impl="mojo", **hp).float()
    return _per_episode({"advantages": adv, "returns": adv}, inputs)


def _mojo_when(node: Node, options) -> str | None:

    est = node.params["estimator"]
    if est not in ESTIMATORS or node.params.get("kl_coef") or len(node.inputs) > 2:
        return NOT_FOR
    if set(node.params) - {"estimator", "scale", "eps", "step_credit"} or (est == "rloo" and node.params.get("scale", "group") != "group"):
        return NOT_FOR
    kernel, why = load_or_reason("advantages")
    return None if kernel is not None else why.splitlines()[0]


def _locality(node: Node) -> str:
    est = ADVANTAGES.get(node.params["estimator"]) if node.params.get("estimator") else None
    group = getattr(est, "statistics", "batch") == "group"  # estimators mark themselves (group_statistics)
    return "group" if group and node.params.get("scale", "group") != "batch" else "batch"


def _resolve(node: Node, options, defaults) -> Node:
    """The estimator left to compile time (the compile option ``advantage``, else the recipe's
    default, else grpo) and the compile option ``step_credit`` on a node that does not set its own."""
    if node.params.get("estimator") is None:
        est = options.advantage or defaults.get("advantage") or "grpo"
        node = node.replace(params={**node.params, "estimator": est})
    credit = options.step_credit
    if credit is None or node.params.get("step_credit") is not None:
        return node
    if node.params["estimator"] not in GRPO_FAMILY:
        raise CompileError(f"compile option step_credit={credit!r} applies to the GRPO family "
                           f"({', '.join(GRPO_FAMILY)}); node {node.name!r} uses estimator "
                           f"{node.params['estimator']!r}, which sums step rewards like verl (leave step_credit unset)")
    return node.replace(params={**node.params, "step_credit": credit})


def _without_reference(node: Node) -> Node:
    if node.params.get("kl_coef"):

        raise CompileError(f"reference='none', but node {node.name!r} puts a KL penalty to the reference in the "
                           f"reward (kl_coef={node.params['kl_coef']}); use another reference policy or kl_coef=0")
    return node


SPECS = (
    OpSpec("advantages", Role.SCORE, (Output("advantages", Kind.TOKENS), Output("returns", Kind.TOKENS)), (
        Impl("mojo", batch=advantages_mojo, when=_mojo_when, kernel=True),
        Impl("torch", batch=advantages_torch),
    ), locality=_locality, without_reference=_without_reference, resolve=_resolve,
        doc="per-token advantages and returns from rewards (a registered estimator)"),
)
