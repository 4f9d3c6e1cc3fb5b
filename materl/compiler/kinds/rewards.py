"""Scoring: the rewards node (a recipe's reward sum) and group filters (dynamic sampling).

A rewards node's terms compile to the one reward algebra, ``materl.ops.rewards``: the terms that
score the same thing (a rollout, or one generate step of it) form one ``RewardSum``, called
once over the batch of episodes, which validates every score and sums them. Then placement on
the scored rollout's tokens: a step term's total lands on its step's last token, token-level
totals stay per token, and a per-completion total lands on the last trained token
(``place_on_last_trained``); ``turn_gamma`` re-places per turn. The value is a float per episode,
or a per-token tensor as long as the completion when any term is step- or token-level.

The Mojo implementation computes the built-in terms it can fuse (length, repetition, diversity,
pattern match) in one kernel call, and sentiment and toxicity with the text kernels, and hands
their scores to the same sum.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from materl.compiler.context import StageEnv
from materl.compiler.episode import Episode, as_rollout, pad_rows
from materl.compiler.spec import NOT_FOR, Impl, Kind, OpSpec, Output, Role, may_be_turn
from materl.errors import CompileError, ShapeError
from materl.graph.node import Node
from materl.kernels.fusion import RewardChain, fusable
from materl.kernels import loader
from materl.kernels.rewards import pad_ids
from materl.kernels.text_rewards import TEXT_KERNELS
from materl.ops._masked import place_on_last_trained
from materl.ops.rewards import Reward, RewardSum
from materl.rollout.multiturn import TurnResult
from materl.rollout.types import Rollout, Step, last_user_message


def prompt_text(prompt: Any) -> str:
    """The ``prompts`` a reward sees: a chat prompt's last user message (``Rollout.question``)."""
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt", prompt.get("messages"))
    if isinstance(prompt, list):
        return last_user_message(prompt)
    return str(prompt)


def scored_input(node: Node) -> int | None:
    """The input index of the rollout the node's token-level placement refers to."""
    return next((t["rollout"] for t in node.params["terms"] if "rollout" in t), None)


def _binding(term: Mapping) -> tuple[int | None, int | None]:
    return term.get("rollout"), term.get("step")


async def score(run: StageEnv, node: Node, eps: list[Episode], inputs: list[list], *,
                given: Mapping[int, Tensor] | None = None) -> list:
    """The node's weighted reward per episode; ``given``: term index -> precomputed unweighted scores."""
    terms, given, n = node.params["terms"], given or {}, len(eps)
    scored = scored_input(node)
    base = [as_rollout(x) for x in inputs[scored]] if scored is not None else None
    outcome, tokens = torch.zeros(n), None
    bindings: dict[tuple, list[int]] = {}
    for i, term in enumerate(terms):
        key = _binding(term) if "input" not in term else (scored, None)
        bindings.setdefault(key, []).append(i)
    for (rollout_at, step_at), members in bindings.items():
        rollouts = [as_rollout(x) for x in inputs[rollout_at]] if rollout_at is not None else None
        steps = [x.step if isinstance(x, TurnResult) else None for x in inputs[step_at]] if step_at is not None else None
        rsum = RewardSum(tuple(_reward(terms[i], inputs, given.get(i)) for i in members))
        result = await rsum.aevaluate(**_batch(eps, rollouts, steps))
        for label, scores in result.components.items():
            for ep, total in zip(eps, _row_sums(scores)):
                ep.metrics[f"reward/{label}"] = ep.metrics.get(f"reward/{label}", 0.0) + total
        total = result.total
        if steps is not None:
            tokens = _add(tokens, _on_step_ends(node, total, base, steps))
        elif total.dim() == 2:
            if rollout_at != scored:
                raise CompileError(f"rewards node {node.name!r}: token-level rewards scoring a rollout other than "
                                   f"{node.inputs[scored]!r} cannot be placed on its tokens")
            tokens = _add(tokens, total)
        else:
            outcome += total
    gammas = [r.metadata.get("turn_gamma") for r in base] if base is not None else []
    if tokens is None and all(g is None for g in gammas):
        return outcome.tolist()
    mask = pad_rows([r.loss_mask for r in base])
    tokens = (tokens if tokens is not None else torch.zeros_like(mask))[:, :mask.shape[1]]
    tokens = tokens + place_on_last_trained(outcome, mask)
    out = []
    for i, r in enumerate(base):
        row = tokens[i, :len(r.completion_ids)]
        out.append(torch.tensor(turn_discounted(row.tolist(), r, gammas[i])) if gammas[i] is not None else row)
    return out


def _row_sums(scores: Tensor) -> list[float]:
    """Each episode's score (a token-level row: its sum) as a Python float; one conversion for
    per-episode scores instead of one per row."""
    if isinstance(scores, Tensor) and scores.dim() == 1 and scores.is_floating_point():
        return scores.tolist()
    return [float(row.sum()) for row in scores]


def _add(acc: Tensor | None, t: Tensor) -> Tensor:
    if acc is None:
        return t
    width = max(acc.shape[1], t.shape[1])
    pad = torch.nn.functional.pad
    return pad(acc, (0, width - acc.shape[1])) + pad(t, (0, width - t.shape[1]))


def _on_step_ends(node: Node, total: Tensor, base: list[Rollout], steps: list[Step | None]) -> Tensor:
    if total.dim() != 1:
        raise ShapeError(f"rewards node {node.name!r}: a step= reward scores the step as a whole; got token-level "
                         f"scores of shape {list(total.shape)}")
    width = max((len(r.completion_ids) for r in base), default=0)
    out = torch.zeros(len(base), width)
    for i, (r, step) in enumerate(zip(base, steps)):
        end = next((e for s, e in zip(r.steps, r.step_ends) if s is step), None) if step is not None else None
        if end is not None and end >= 0:
            out[i, end] += total[i]
    return out


def _reward(term: Mapping, inputs: list[list], given: Tensor | None) -> Reward:
    """The term as a ``Reward``: its function, or the values another node computed (``input``
    terms) or a kernel precomputed (``given``) returned as the function's result."""
    if given is not None:
        return Reward(_constant(given), term["weight"], term["label"])
    if "input" in term:
        return Reward(_constant(inputs[term["input"]]), term["weight"], term["label"])
    return _cached_reward(term["fn"], term["weight"], term["label"], tuple(sorted(term["params"].items())))


def _constant(values):
    def scores(**_):
        return values
    return scores


@functools.lru_cache(maxsize=512)
def _cached(fn, weight: float, label: str, params: tuple) -> Reward:
    return Reward.from_spec(fn, weight, name=label, **dict(params))


def _cached_reward(fn, weight: float, label: str, params: tuple) -> Reward:
    """A Reward is frozen and building one inspects the function's signature, so plain ones are
    built once per process (parameters that are not hashable: every time)."""
    try:
        return _cached(fn, weight, label, params)
    except TypeError:  # unhashable parameter values
        return Reward.from_spec(fn, weight, name=label, **dict(params))


def _batch(eps: list[Episode], rollouts: list[Rollout] | None, steps: list[Step | None] | None) -> dict:
    if steps is not None:
        completions = [s.text if s is not None else "" for s in steps]
        ids = [list(s.token_ids) if s is not None else [] for s in steps]
    elif rollouts is not None:
        completions, ids = [r.text for r in rollouts], [r.completion_ids for r in rollouts]
    else:
        completions, ids = [""] * len(eps), None
    columns = {k: [ep.columns.get(k) for ep in eps] for k in dict.fromkeys(k for ep in eps for k in ep.columns)}
    batch = dict(prompts=[prompt_text(ep.prompt) for ep in eps], completions=completions, rollouts=rollouts,
                 group_ids=[ep.group_id for ep in eps], **columns)
    if ids is not None:
        batch["completion_ids"] = ids
    return batch


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


# -- the fused Mojo chain ---------------------------------------------------------------------


def fusable_terms(node: Node) -> list[int]:
    """Indices of the terms a fused Mojo reward chain can compute: built-in kernel rewards
    scoring the same rollout (not a step)."""
    terms = node.params["terms"]
    idx = [i for i, t in enumerate(terms) if isinstance(t.get("fn"), str) and "step" not in t
           and "rollout" in t and fusable(t["fn"], t.get("params", {}))]
    return [i for i in idx if terms[i]["rollout"] == terms[idx[0]]["rollout"]] if idx else []


@functools.lru_cache(maxsize=64)
def _chain(spec: tuple):

    chain = RewardChain([(fn, dict(params), 1.0) for fn, params in spec])
    chain.kernel()  # built (and cached on disk) now
    return chain


def reward_chain(node: Node):
    """The node's fused chain (unit weights: each part is the unweighted reward), one per process."""
    terms = node.params["terms"]
    return _chain(tuple((terms[i]["fn"], tuple(sorted(terms[i].get("params", {}).items()))) for i in fusable_terms(node)))


def text_terms(node: Node) -> list[int]:
    """Indices of the terms the text kernels compute (sentiment, toxicity) scoring a rollout."""
    allowed = {"sentiment": {"target"}, "toxicity": set()}
    return [i for i, t in enumerate(node.params["terms"]) if isinstance(t.get("fn"), str) and t["fn"] in allowed
            and "step" not in t and "rollout" in t and set(t.get("params", {})) <= allowed[t["fn"]]]


def _fused_when(node: Node, options) -> str | None:
    if not fusable_terms(node) and not text_terms(node):
        return NOT_FOR
    try:
        if fusable_terms(node):
            reward_chain(node)
        if text_terms(node):
            kernel, why = loader.load_or_reason("text_rewards")
            if kernel is None:
                return why
    except Exception as e:  # noqa: BLE001 - the reason explain() shows
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None


async def fused_score(run: StageEnv, node: Node, eps: list[Episode], inputs: list[list]) -> list:
    terms, given = node.params["terms"], {}
    fused = fusable_terms(node)
    if fused:
        rollouts = [as_rollout(x) for x in inputs[terms[fused[0]]["rollout"]]]
        _, parts = reward_chain(node)(*pad_ids([r.completion_ids for r in rollouts]))
        given.update(zip(fused, parts.values()))
    for i in text_terms(node):  # one kernel call per term over the batch's texts (the texts the python impl scores)
        texts = [as_rollout(x).text for x in inputs[terms[i]["rollout"]]]
        given[i] = TEXT_KERNELS[terms[i]["fn"]](texts, impl="mojo", **terms[i].get("params", {}))
    return await score(run, node, eps, inputs, given=given)


def _describe(node: Node, impl: str) -> str:
    if impl != "mojo-fused":
        return ""
    terms = node.params["terms"]
    labels = [terms[i]["label"] for i in fusable_terms(node) + text_terms(node)]
    return f"fused: {' + '.join(labels)} in %{node.name} (Mojo kernel calls per batch of episodes)"


# -- filters ------------------------------------------------------------------------------------


def filter_groups(run: StageEnv, node: Node, eps: list[Episode], inputs: list[list]) -> list[bool]:
    """Keep a group only if its rewards differ (DAPO dynamic sampling)."""
    scores = [float(torch.as_tensor(v).sum()) for v in inputs[0]]
    by_group: dict = {}
    for ep, s in zip(eps, scores):
        by_group.setdefault(ep.group_id, []).append(s)
    keep = [max(by_group[ep.group_id]) - min(by_group[ep.group_id]) > 1e-12 for ep in eps]
    for ep, k in zip(eps, keep):
        ep.filtered = ep.filtered or not k
    return keep


def check_rewards(node: Node, info) -> list[str]:
    problems = []
    for term in node.params["terms"]:
        if "step" in term:
            producer = info.producer(node.inputs[term["step"]])
            if producer is not None and not may_be_turn(producer):
                problems.append(f"reward {term['label']!r} has step={node.inputs[term['step']]!r}, a {producer.op} "
                                f"value, so it would land nowhere; step= takes a generate_step value (the turn "
                                f"whose last token receives the reward)")
    return problems


SPECS = (
    OpSpec("rewards", Role.SCORE, (Output("rewards", Kind.SCORE),), (
        Impl("mojo-fused", batch=fused_score, when=_fused_when, kernel=True),
        Impl("python", batch=score),
    ), locality="row", check=check_rewards, describe=_describe,
        doc="a weighted sum of reward terms per episode"),
    OpSpec("filter_groups", Role.SCORE, (Output("keep", Kind.FLAG),), (Impl("python", batch=filter_groups),),
           locality="group", always_runs=True, doc="drop groups whose rewards are all equal (DAPO)"),
)
