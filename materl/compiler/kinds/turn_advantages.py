"""Turn-level advantages: GRPO's group statistics taken per turn of multi-turn episodes.

    rollout = ml.env_rollout(policy, env, prompts)          # or generate_step turns + structure_rollout
    rewards = ml.reward("step_rewards")                     # rewards on each turn's last token
    adv = turn_advantages(rewards, rollout, gamma=1.0)     # %adv, %adv.returns
    ml.set_loss(ml.policy_loss(adv, ml.logprobs(policy, prompts, rollout)))

Turn j of an episode is its j-th model turn plus the untrained tokens after it (tool output, an
environment's reply). Its reward r_j sums the per-token rewards inside it (a per-completion
reward counts on the last trained token, i.e. in the last turn), its return is
R_j = sum_{k >= j} gamma^(k-j) r_k, and every trained token of turn j gets

    A_j = (R_j - mean_g(R_j)) / (std_g(R_j) + eps)

with the mean and unbiased std over the group's episodes that have a turn j (a turn that only
one episode reached gets mean 0, std 1, GRPO's singleton convention; a turn whose returns are
all equal gets exactly 0, never a rounding residue divided by eps). Whole-episode GRPO
compares every token against the group's final scores; this compares turn 1 with turn 1 and
turn 2 with turn 2, so a good first call is not blamed for a bad second answer (the credit
assignment of turn-level GRPO variants, e.g. MT-GRPO, arXiv:2505.11821). ``%adv.returns`` are
the R_j on their turn's trained tokens.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor

from materl.compiler.context import Run
from materl.compiler.episode import Episode, as_rollout, to_tensor
from materl.compiler.spec import Impl, Kind, OpSpec, Output, Role
from materl.errors import ConfigError
from materl.graph.node import Node
from materl.graph.trace import Value, active_builder
from materl.ops._masked import place_on_last_trained
from materl.rollout.types import Rollout


def turn_advantages(rewards, rollout, *, gamma: float = 1.0, eps: float = 1e-6, name: str | None = None) -> Value:
    """Recipe constructor: per-token turn-level advantages (and ``.returns``) of ``rollout``."""
    if not 0.0 <= gamma <= 1.0 or eps < 0:
        raise ConfigError(f"turn_advantages: gamma must be in [0, 1] and eps >= 0, got gamma={gamma}, eps={eps}")
    b = active_builder("turn_advantages")
    return b.add("turn_advantages", [rewards, rollout], {"gamma": float(gamma), "eps": float(eps)}, scope="group",
                 name=name, default_name="turn_advantages")


def turn_spans(r: Rollout) -> list[tuple[int, int, int]]:
    """(first token, last token, last trained token) of each turn of ``r``."""
    spans: list[list[int]] = []
    start = 0
    for step, end in zip(r.steps, r.step_ends):
        if step.kind == "generate":
            spans.append([start, end, end])
        elif spans:
            spans[-1][1] = end
        start = end + 1
    return [tuple(s) for s in spans]


def turn_returns(tokens: Tensor, spans: list[tuple[int, int, int]], gamma: float) -> list[float]:
    rewards = [float(tokens[a:b + 1].sum()) for a, b, _ in spans]
    out, running = [0.0] * len(spans), 0.0
    for j in range(len(spans) - 1, -1, -1):
        running = rewards[j] + gamma * running
        out[j] = running
    return out


def turn_rewards(inputs: list[list]) -> tuple[list[Rollout], list[Tensor], list[Tensor]]:
    """(rollouts, float masks, per-token rewards) of a turn-level node's inputs (rewards, rollout):
    a per-completion reward lands on the row's last trained token."""
    rollouts = [as_rollout(x) for x in inputs[1]]
    masks = [torch.tensor(r.loss_mask, dtype=torch.float32) for r in rollouts]
    tokens = []
    for value, mask in zip(inputs[0], masks):
        row = to_tensor([value])[0] if not isinstance(value, Tensor) else value.float()
        tokens.append(place_on_last_trained(row[None], mask[None])[0] if row.dim() == 0 else row)
    return rollouts, masks, tokens


def turn_advantages_batch(run: Run, node: Node, eps: list[Episode], inputs: list[list]) -> dict:
    gamma, epsilon = node.params["gamma"], node.params["eps"]
    rollouts, masks, tokens = turn_rewards(inputs)
    spans = [turn_spans(r) for r in rollouts]
    returns = [turn_returns(t, s, gamma) for t, s in zip(tokens, spans)]
    by_turn: dict[tuple, list[float]] = defaultdict(list)
    for ep, rets in zip(eps, returns):
        for j, value in enumerate(rets):
            by_turn[(ep.group_id, j)].append(value)
    stats = {key: mean_std(values) for key, values in by_turn.items()}
    advantages, out_returns = [], []
    for ep, r, mask, span, rets in zip(eps, rollouts, masks, spans, returns):
        adv, ret = torch.zeros(len(r.completion_ids)), torch.zeros(len(r.completion_ids))
        for j, (a, b, _) in enumerate(span):
            mean, std = stats[(ep.group_id, j)]
            adv[a:b + 1] = (rets[j] - mean) / (std + epsilon) if rets[j] != mean else 0.0
            ret[a:b + 1] = rets[j]
        advantages.append(adv * mask)
        out_returns.append(ret * mask)
    return {"advantages": advantages, "returns": out_returns}


def mean_std(values: list[float]) -> tuple[float, float]:
    """GRPO's group statistics of ``values``: (mean, unbiased std); one value gives (0, 1) (verl's
    singleton convention) and equal values (the value, 0), so they get advantage exactly 0."""
    if len(values) < 2:
        return 0.0, 1.0
    if min(values) == max(values):
        return values[0], 0.0
    t = torch.tensor(values, dtype=torch.float64)
    return float(t.mean()), float(t.std())


SPECS = (
    OpSpec("turn_advantages", Role.SCORE, (Output("advantages", Kind.TOKENS), Output("returns", Kind.TOKENS)),
           (Impl("torch", batch=turn_advantages_batch),), locality="group",
           doc="GRPO advantages normalised per turn position within each group"),
)
