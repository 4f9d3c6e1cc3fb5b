"""GiGPO advantages (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent
Training", arXiv:2505.10978): an episode-level group advantage plus a step-level one computed over
the steps of the group that acted from the same anchor state.

    rollout = ml.structure_rollout(...)                      # multi-turn episodes
    rewards = ml.reward(answer, rollout=rollout) + ml.reward(called_tool, rollout=rollout, step=turn_1)
    adv = ml.gigpo_advantages(rewards, rollout, omega=1.0, gamma=0.95)   # %adv, %adv.returns

A step is a model turn (``turn_advantages.turn_spans``): its reward r_t sums the token rewards
inside it (an outcome reward counts in the last turn). For the N episodes of a group:

    episode level (the paper's A^E):  A^E(tau_i) = (R(tau_i) - mean_j R(tau_j)) / F_norm,
                                      R(tau_i) = sum_t r_t^(i)
    step level (A^S): the steps of the group whose anchor state is the same s~ form G^S(s~);
        R_t^(i) = sum_{k >= t} gamma^(k-t) r_k^(i)          (discounted return of the step)
        A^S(a_t^(i)) = (R_t^(i) - mean over G^S(s~) of R) / F_norm
    combined: A = A^E + omega * A^S on every trained token of the turn

``F_norm`` is the std (``norm="std"``, unbiased, plus ``eps`` as in verl's GRPO) or 1
(``norm="none"``), the paper's two choices, used at both levels; its defaults are gamma 0.95,
omega 1. A group of one episode gets verl's singleton convention at the episode level (mean 0,
std 1). A state only one step of the group acted from has no step-level group to compare with:
its A^S is 0 (the paper's std of one value is undefined). Equal values give exactly 0.

The anchor state of turn t (0-based) of a rollout: ``anchor(rollout, t) -> hashable`` when given;
by default (``observation_anchor``) turn 0's is the prompt (the same for the whole group), a later
turn's is the ``"anchor"`` an environment put in ``EnvStep.info`` for the turn before (the state
it moved to; the same state at another turn is the same anchor, as in the paper), else the turn's
index and the exact token ids of the tool results / environment reply that precede it (two
episodes whose calls returned the same result are in the same state; the same result at another
turn is not, since the model's context differs).
``%adv.returns`` are the R_t^(i) on the turn's trained tokens.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable

import torch

from materl.compiler.context import Run
from materl.compiler.episode import Episode
from materl.compiler.kinds.turn_advantages import mean_std, turn_returns, turn_rewards, turn_spans
from materl.compiler.spec import Impl, Kind, OpSpec, Output, Role
from materl.errors import ConfigError
from materl.graph.node import Node
from materl.graph.trace import Value, active_builder
from materl.rollout.types import Rollout

NORMS = ("std", "none")


def gigpo_advantages(rewards, rollout, *, omega: float = 1.0, gamma: float = 0.95, norm: str = "std",
                     eps: float = 1e-6, anchor: Callable[[Rollout, int], Hashable] | None = None,
                     name: str | None = None) -> Value:
    """Recipe constructor: per-token GiGPO advantages (and ``.returns``) of ``rollout``."""
    if not 0.0 <= gamma <= 1.0 or eps < 0 or omega < 0:
        raise ConfigError(f"gigpo_advantages: gamma must be in [0, 1], eps >= 0 and omega >= 0; got gamma={gamma}, "
                          f"eps={eps}, omega={omega}")
    if norm not in NORMS:
        raise ConfigError(f"gigpo_advantages: unknown norm {norm!r}; valid: {', '.join(NORMS)}")
    if anchor is not None and not callable(anchor):
        raise ConfigError(f"gigpo_advantages(anchor=...) takes a function (rollout, turn) -> hashable, got {anchor!r}")
    params = {"omega": float(omega), "gamma": float(gamma), "norm": norm, "eps": float(eps)}
    if anchor is not None:
        params["anchor"] = anchor
    b = active_builder("gigpo_advantages")
    return b.add("gigpo_advantages", [rewards, rollout], params, scope="group", name=name,
                 default_name="gigpo_advantages")


def observation_anchor(rollout: Rollout, turn: int) -> Hashable:
    """The default anchor state of turn ``turn`` (module docstring)."""
    if turn == 0:
        return ("prompt",)
    gens = [i for i, s in enumerate(rollout.steps) if s.kind == "generate"]
    before, at = gens[turn - 1], gens[turn]
    given = rollout.steps[before].metadata.get("anchor")
    if given is not None:
        return ("env", given)
    return ("observation", turn, tuple(t for s in rollout.steps[before + 1:at] for t in s.token_ids))


def _normalised(value: float, stats: tuple[float, float], norm: str, eps: float) -> float:
    mean, std = stats
    if value == mean:  # includes every value of a group with std 0: no signal, even with eps = 0
        return 0.0
    return (value - mean) / (std + eps) if norm == "std" else value - mean


def gigpo_advantages_batch(run: Run, node: Node, eps: list[Episode], inputs: list[list]) -> dict:
    p = node.params
    anchor = p.get("anchor") or observation_anchor
    rollouts, masks, tokens = turn_rewards(inputs)
    spans = [turn_spans(r) for r in rollouts]
    step_returns = [turn_returns(t, s, p["gamma"]) for t, s in zip(tokens, spans)]
    totals = [turn_returns(t, s, 1.0)[0] if s else 0.0 for t, s in zip(tokens, spans)]  # R(tau): undiscounted sum
    episodes: dict[Hashable, list[float]] = defaultdict(list)
    states: dict[tuple, list[float]] = defaultdict(list)
    keys = []
    for ep, r, rets, total in zip(eps, rollouts, step_returns, totals):
        episodes[ep.group_id].append(total)
        row = []
        for j, value in enumerate(rets):
            key = (ep.group_id, _hashable(anchor(r, j), node, j))
            states[key].append(value)
            row.append(key)
        keys.append(row)
    ep_stats = {g: mean_std(v) for g, v in episodes.items()}
    step_stats = {k: mean_std(v) if len(v) > 1 else None for k, v in states.items()}
    advantages, returns = [], []
    for ep, r, mask, span, rets, total, row in zip(eps, rollouts, masks, spans, step_returns, totals, keys):
        a_episode = _normalised(total, ep_stats[ep.group_id], p["norm"], p["eps"])
        adv, ret = torch.zeros(len(r.completion_ids)), torch.zeros(len(r.completion_ids))
        for (a, b, _), value, key in zip(span, rets, row):
            stats = step_stats[key]
            a_step = _normalised(value, stats, p["norm"], p["eps"]) if stats is not None else 0.0
            adv[a:b + 1] = a_episode + p["omega"] * a_step
            ret[a:b + 1] = value
        advantages.append(adv * mask)
        returns.append(ret * mask)
    return {"advantages": advantages, "returns": returns}


def _hashable(key, node: Node, turn: int) -> Hashable:
    try:
        hash(key)
    except TypeError as exc:
        raise ConfigError(f"node {node.name!r}: the anchor function returned {type(key).__name__} {key!r:.80} for "
                          f"turn {turn}; an anchor state must be hashable (a str, int or tuple)") from exc
    return key


SPECS = (
    OpSpec("gigpo_advantages", Role.SCORE, (Output("advantages", Kind.TOKENS), Output("returns", Kind.TOKENS)),
           (Impl("torch", batch=gigpo_advantages_batch),), locality="group",
           doc="GiGPO: episode-level group advantage plus step-level advantage over same-anchor steps"),
)
