"""Rewards, advantages and group filters: the scoring nodes between rollout and learner."""

from __future__ import annotations

import functools
from typing import Any

import torch

from materl.compiler.impls import register
from materl.compiler.values import Episode, pad_rows, to_tensor
from materl.errors import CompileError
from materl.graph.node import Node
from materl.rollout.episode import EpisodeState, StepResult
from materl.rollout.types import Rollout, Step


def as_rollout(x: Any) -> Rollout:
    if isinstance(x, Rollout):
        return x
    if isinstance(x, (StepResult, EpisodeState)):
        return x.rollout
    raise CompileError(f"expected a rollout (from generate, generate_step or structure_rollout), got {type(x).__name__}")


def prompt_text(prompt: Any) -> str:
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt", prompt.get("messages"))
    if isinstance(prompt, list):
        users = [m["content"] for m in prompt if m.get("role") == "user"]
        return users[-1] if users else ""
    return str(prompt)


def last_trainable(r: Rollout) -> int:
    mask = r.loss_mask
    return max((i for i, m in enumerate(mask) if m), default=len(mask) - 1)


def _step_index(r: Rollout, step: Step | None) -> int | None:
    if step is None:
        return None
    for s, end in zip(r.steps, r.step_ends):
        if s is step:
            return end
    return None


def fusable_terms(node: Node) -> list[int]:
    """Indices of the terms a fused Mojo reward chain can compute: built-in kernel rewards
    scoring the same rollout (not a step)."""
    from materl.kernels.fusion import fusable

    terms = node.params["terms"]
    idx = [i for i, t in enumerate(terms) if isinstance(t.get("fn"), str) and "step" not in t
           and "rollout" in t and fusable(t["fn"], t.get("params", {}))]
    return [i for i in idx if terms[i]["rollout"] == terms[idx[0]]["rollout"]] if idx else []


def reward_chain(plan, node: Node):
    """The node's fused chain (unit weights: each part is the unweighted reward), built once per plan."""
    from materl.kernels.fusion import RewardChain

    cache = plan.__dict__.setdefault("_reward_chains", {})
    if node.name not in cache:
        terms = node.params["terms"]
        cache[node.name] = RewardChain([(terms[i]["fn"], terms[i].get("params", {}), 1.0) for i in fusable_terms(node)])
    return cache[node.name]


async def fused_rewards_batch(rt, node: Node, eps: list[Episode], inputs: list[list]) -> list:
    """The fusable terms in one Mojo kernel call over ``eps``; the other terms as in rewards_batch."""
    from materl.kernels.rewards import pad_ids

    fused = fusable_terms(node)
    terms = node.params["terms"]
    rollouts = [as_rollout(x) for x in inputs[terms[fused[0]]["rollout"]]]
    _, parts = reward_chain(rt.plan, node)(*pad_ids([r.completion_ids for r in rollouts]))
    scores = list(parts.values())
    base = [0.0] * len(eps)
    for k, i in enumerate(fused):
        label = f"reward/{terms[i]['label']}"
        for e, ep in enumerate(eps):
            ep.metrics[label] = ep.metrics.get(label, 0.0) + float(scores[k][e])
            base[e] += terms[i]["weight"] * float(scores[k][e])
    rest = [t for i, t in enumerate(terms) if i not in fused]
    return await rewards_batch(rt, node, eps, inputs, terms=rest, base=base)


async def fused_rewards_episode(rt, node: Node, ep: Episode, *values):
    return (await fused_rewards_batch(rt, node, [ep], [[v] for v in values]))[0]


async def rewards_batch(rt, node: Node, eps: list[Episode], inputs: list[list], *, terms: list | None = None,
                        base: list[float] | None = None) -> list:
    """Weighted sum of the node's terms for each episode: a float, or a per-token list when a
    term is step-level (its reward on its step's last token) or token-level. ``terms``/``base``:
    a subset of the terms, added to already computed outcome rewards (the fused path)."""
    n = len(eps)
    outcome = list(base) if base is not None else [0.0] * n
    per_token: list[list[float] | None] = [None] * n
    for term in node.params["terms"] if terms is None else terms:
        rollouts = [as_rollout(x) for x in inputs[term["rollout"]]] if "rollout" in term else None
        if "input" in term:
            scores = to_tensor(inputs[term["input"]], n)
        else:
            steps = [x.step if isinstance(x, StepResult) else None for x in inputs[term["step"]]] if "step" in term else None
            batch = _reward_batch(eps, rollouts, steps)
            scores = await _reward_of(term).ascore(**batch)
        w = term["weight"]
        for i, ep in enumerate(eps):
            row = scores[i]
            label = f"reward/{term['label']}"
            ep.metrics[label] = ep.metrics.get(label, 0.0) + float(row.sum())
            if "step" in term or row.dim() == 1:
                r = rollouts[i]
                if per_token[i] is None:
                    per_token[i] = [0.0] * len(r.completion_ids)
                if "step" in term:
                    where = _step_index(r, steps[i])
                    if where is not None:
                        per_token[i][where] += w * float(row)
                else:
                    for t, v in enumerate(row.tolist()[: len(per_token[i])]):
                        per_token[i][t] += w * v
            else:
                outcome[i] += w * float(row)
    rollouts0 = [as_rollout(_first_rollout(node, inputs, i)) for i in range(n)] if any(
        p is not None for p in per_token) or _discounted(node, inputs) else None
    if rollouts0 is None:
        return outcome
    out = []
    for i, r in enumerate(rollouts0):
        tokens = per_token[i] if per_token[i] is not None else [0.0] * len(r.completion_ids)
        if tokens:
            tokens[last_trainable(r)] += outcome[i]
        gamma = r.metadata.get("turn_gamma")
        out.append(turn_discounted(tokens, r, gamma) if gamma is not None else tokens)
    return out


def _discounted(node: Node, inputs: list[list]) -> bool:
    try:
        return any(as_rollout(x).metadata.get("turn_gamma") is not None for x in inputs[_rollout_input(node)])
    except (CompileError, IndexError):
        return False


def _rollout_input(node: Node) -> int:
    for term in node.params["terms"]:
        if "rollout" in term:
            return term["rollout"]
    raise CompileError(f"rewards node {node.name!r} scores no rollout")


def turn_discounted(tokens: list[float], r: Rollout, gamma: float) -> list[float]:
    """Re-place per-token rewards so that every token of turn j has return-to-go
    R_j = sum_{k >= j} gamma^(k-j) r_k, where r_k sums the rewards inside turn k (its generate step
    and the tool tokens after it). Turn j's reward moves to its last trained token as
    R_j - R_{j+1}; undiscounted estimators then see the turn-discounted returns."""
    spans, start = [], 0
    for s, end in zip(r.steps, r.step_ends):
        if s.kind == "generate":
            spans.append([start, end])
        elif spans:
            spans[-1][1] = end
        start = end + 1
    if not spans:
        return tokens
    per_turn = [sum(tokens[a:b + 1]) for a, b in spans]
    returns = [0.0] * (len(spans) + 1)
    for j in range(len(spans) - 1, -1, -1):
        returns[j] = per_turn[j] + gamma * returns[j + 1]
    gen_ends = [end for s, end in zip(r.steps, r.step_ends) if s.kind == "generate"]
    out = [0.0] * len(tokens)
    for j, end in enumerate(gen_ends):
        out[end] = returns[j] - returns[j + 1]
    return out


@functools.lru_cache(maxsize=256)
def _cached_reward(fn, params: tuple):
    from materl.ops.rewards import Reward

    return Reward.from_spec(fn, **{k: v for k, _, v in params})


def _reward_of(term: dict):
    """The term's ``Reward``, built once per (fn, params) when every parameter is a plain scalar:
    a Reward is frozen, and building one inspects the function's signature (~20 us, paid per
    episode per term per step before; benchmarks/overhead.py)."""
    from materl.ops.rewards import Reward

    fn, items = term["fn"], sorted(term["params"].items())
    if getattr(fn, "__hash__", None) is not None and all(v is None or type(v) in (str, int, float, bool)
                                                         for _, v in items):
        return _cached_reward(fn, tuple((k, type(v), v) for k, v in items))
    return Reward.from_spec(fn, **term["params"])


def _first_rollout(node: Node, inputs: list[list], i: int):
    for term in node.params["terms"]:
        if "rollout" in term:
            return inputs[term["rollout"]][i]
    raise CompileError(f"rewards node {node.name!r} has step rewards but no rollout to place them on")


def _reward_batch(eps: list[Episode], rollouts: list[Rollout], steps: list[Step | None] | None) -> dict:
    if steps is not None:
        completions = [s.text if s is not None else "" for s in steps]
        ids = [list(s.token_ids) if s is not None else [] for s in steps]
    else:
        completions = [r.text for r in rollouts]
        ids = [r.completion_ids for r in rollouts]  # token-level rewards align with these
    columns: dict[str, list] = {}
    for ep in eps:
        for k in ep.columns:
            columns.setdefault(k, [])
    for k in columns:
        columns[k] = [ep.columns.get(k) for ep in eps]
    return dict(prompts=[prompt_text(ep.prompt) for ep in eps], completions=completions, completion_ids=ids,
                rollouts=rollouts, group_ids=[ep.group_id for ep in eps], **columns)


async def rewards_episode(rt, node: Node, ep: Episode, *values):
    return (await rewards_batch(rt, node, [ep], [[v] for v in values]))[0]


def advantages_batch(rt, node: Node, eps: list[Episode], inputs: list[list]) -> dict:
    from materl.ops.advantages import ADVANTAGES
    from materl.ops.kl import kl_penalty

    p = dict(node.params)
    est = p.pop("estimator")
    kl_coef, kl = p.pop("kl_coef", 0.0), p.pop("kl", "k1")
    rollouts = [as_rollout(x) for x in inputs[1]]
    mask = pad_rows([r.loss_mask for r in rollouts])
    width = mask.shape[1]
    rewards = to_tensor(inputs[0], len(eps), width=width)
    n_extra = len(inputs) - 2 - (2 if kl_coef else 0)
    extra = [to_tensor(v, len(eps), width=width) for v in inputs[2:2 + n_extra]]
    if kl_coef:
        ref, old = (to_tensor(v, len(eps), width=width) for v in inputs[2 + n_extra:])
        if rewards.dim() == 1:
            rewards = _outcome_on_last_token(rewards, mask)
        rewards = rewards - kl_coef * kl_penalty(old, ref, estimator=kl) * mask
    adv, returns = ADVANTAGES.get(est)(rewards.double(), mask.double(), *[e.double() for e in extra],
                                       group_ids=[ep.group_id for ep in eps], **p)
    return {"advantages": adv.float(), "returns": returns.float()}


def _outcome_on_last_token(r_B, mask):
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & (mask > 0)
    first_last = last & (last.cumsum(-1) == 1)
    return first_last.float() * r_B[:, None]


def filter_groups_batch(rt, node: Node, eps: list[Episode], inputs: list[list]) -> list[bool]:
    """Keep a group only if its rewards differ (DAPO dynamic sampling)."""
    scores = [float(torch.as_tensor(v).sum()) for v in inputs[0]]
    by_group: dict = {}
    for ep, s in zip(eps, scores):
        by_group.setdefault(ep.group_id, []).append(s)
    keep = [max(by_group[ep.group_id]) - min(by_group[ep.group_id]) > 1e-12 for ep in eps]
    for ep, k in zip(eps, keep):
        ep.filtered = ep.filtered or not k
    return keep


register("rewards", "python", episode=rewards_episode, batch=rewards_batch)
register("rewards", "mojo-fused", episode=fused_rewards_episode, batch=fused_rewards_batch)
register("advantages", "torch", batch=advantages_batch)
register("filter_groups", "python", batch=filter_groups_batch)
