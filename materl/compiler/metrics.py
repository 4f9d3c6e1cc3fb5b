"""What a step reports about its rollouts: episode counts, reward means and spreads per reward
node and per reward term (and per-episode ``agent/`` and ``judge/`` figures), the share of groups
whose rewards are all equal (``groups/zero_std``), trained tokens, tool calls and their success
(0 and 0 on a tool recipe's step without a call), per-turn advantage statistics
(``advantage_turn_metrics``), prompt tokens the engine prefilled and reused from kept caches
(where it reports them) and per-node times.

``reward`` (and every ``reward/...``) is over the episodes that count: an episode masked out by a
tool outage (compile option ``infra_failures="mask"``) got whatever reward its broken tools
left it and is not trained on, so it is left out and counted as ``masked_episodes``."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

from materl.compiler.episode import Episode
from materl.compiler.spec import Kind, output_of, spec_of


def rollout_metrics(plan, episodes: list[Episode], rollout_of: Callable[[Episode], object],
                    timings: Mapping[str, float]) -> dict[str, float]:
    """Metrics of a rollout batch; ``rollout_of(episode)``: its Rollout or None, ``timings``: the
    step's stage times (``stage/rollout`` is reported as ``time/rollout``)."""
    ok = [e for e in episodes if e.error is None]
    counted = [e for e in ok if not outage_masked(e)]
    m: dict[str, float] = {
        "episodes": float(len(episodes)), "failed_episodes": float(len(episodes) - len(ok)),
        "filtered_episodes": float(sum(e.filtered for e in ok)), "masked_episodes": float(len(ok) - len(counted)),
    }
    m |= _rewards(plan, counted)
    rollouts = [r for r in map(rollout_of, ok) if r is not None]
    m["tokens"] = float(sum(len(s.token_ids) for r in rollouts for s in r.steps if s.trainable))  # sum(loss_mask)
    m |= tool_call_metrics(rollouts, uses_tools=uses_tools(plan))
    turns = [s.metadata for r in rollouts for s in r.steps if s.kind == "generate" and "prefilled" in s.metadata]
    if turns:  # the engine keeps KV across turns (the device loop): what each turn computed vs reused
        m["engine/prefilled_tokens"] = float(sum(t["prefilled"] for t in turns))
        m["engine/reused_tokens"] = float(sum(t["reused"] for t in turns))
    truncated = sum(r.metadata.get("truncated") == "context" for r in rollouts)
    if truncated or any(spec_of(plan.nodes[n]).turn for n in plan.episode):
        m["episodes/truncated_context"] = float(truncated)
    for e in episodes:
        for k, v in e.timings.items():
            m[f"time/node/{k}"] = m.get(f"time/node/{k}", 0.0) + v / max(1, len(episodes))
    if timings.get("stage/rollout"):
        m["time/rollout"] = timings["stage/rollout"]
    return m


def _rewards(plan, ok: list[Episode]) -> dict[str, float]:
    columns: dict[str, list] = {}  # key -> its per-episode figures
    reward_nodes = [n for n in plan.order if output_of(plan.nodes[n]).kind is Kind.SCORE]
    m: dict[str, float] = {}
    for name in reward_nodes:
        scored = [e for e in ok if name in e.values]
        totals = [_total(e.values[name]) for e in scored]
        if totals:
            columns["reward" if name == reward_nodes[0] else f"reward/{name}"] = totals
        if name == reward_nodes[0]:
            m |= _zero_std_groups(scored, totals)
    comps = sorted({k for e in ok for k in e.metrics if k.startswith(("reward/", "agent/", "judge/", "self_play/"))})
    for k in comps:
        columns[k] = [e.metrics[k] for e in ok if k in e.metrics]
    stats = _column_stats(columns)
    for key in columns:
        m["reward" if key == "reward" else f"{key}/mean"], m[f"{key}/std"] = stats[key]
    return m


def _zero_std_groups(episodes: list[Episode], totals: list[float]) -> dict[str, float]:
    """``groups/zero_std``: of the groups with two or more of ``episodes``, the share whose total
    rewards are all equal. A group-normalised estimator (GRPO, DAPO, RLOO, ...) gives such a group
    no advantage, so a step near 1 trains on next to nothing (TRL's ``frac_reward_zero_std``).
    Nothing when no group has two episodes (one a prompt, or failures left one)."""
    by_group: dict[int, list[float]] = {}
    for e, total in zip(episodes, totals):
        by_group.setdefault(e.group, []).append(total)
    groups = [v for v in by_group.values() if len(v) >= 2]
    if not groups:
        return {}
    return {"groups/zero_std": sum(max(v) == min(v) for v in groups) / len(groups)}


def _column_stats(columns: dict[str, list]) -> dict[str, tuple[float, float]]:
    """Each key's mean and population std over its figures, as a tensor of them (default dtype)
    gives them, with one tensor for all the keys that have as many figures: a row of a (K, N)
    tensor reduces exactly as that row alone does (checked bitwise), in three tensor ops instead
    of three per key."""
    by_count: dict[int, list[str]] = {}
    for key, values in columns.items():
        by_count.setdefault(len(values), []).append(key)
    out: dict[str, tuple[float, float]] = {}
    for keys in by_count.values():
        table = torch.tensor([columns[k] for k in keys], dtype=torch.get_default_dtype())
        out.update(zip(keys, zip(table.mean(1).tolist(), table.std(1, unbiased=False).tolist())))
    return out


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and population standard deviation of a few dozen numbers, in float64 (``math.fsum``:
    no tensor made for them); NaN when they hold both infinities."""
    mean = _fmean(values)
    if math.isnan(mean):
        return mean, mean
    return mean, math.sqrt(_fmean([(v - mean) ** 2 for v in values]))


def _fmean(values: list[float]) -> float:
    try:
        return math.fsum(values) / len(values)
    except ValueError:  # inf + -inf
        return math.nan


def _total(value) -> float:
    """An episode's reward: its number, or the sum of its per-token rewards."""
    if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.dim() == 0):
        return float(value)  # what the sum of one number is, without making a tensor of it
    return float(torch.as_tensor(value).sum())


def outage_masked(ep: Episode) -> bool:
    """Left out of the update because of a tool infrastructure failure of its own."""
    return ep.infra is not None and ep.excluded is not None


def uses_tools(plan) -> bool:
    """Whether the recipe's episodes may call tools: a ``call_tools`` node, a ``generate_step``
    shown tools, or an agent (its own code runs the calls it gets)."""
    return any(spec_of(plan.nodes[n]).may_call_tools(plan.nodes[n]) for n in plan.episode)


def tool_call_metrics(rollouts: list, *, uses_tools: bool) -> dict[str, float]:
    """``tool_calls``: the calls the model wrote (malformed ones too) per episode; ``tool_success``:
    the fraction of them that got an answer that is not an error (a call left unanswered, as an
    agent's last turn may be, did not succeed). On a recipe that uses tools both are reported on
    every step (0 and 0 without a call)."""
    calls = sum(len(r.tool_calls) for r in rollouts)
    answered = sum(min(len(r.tool_calls), sum(not x.is_error for x in r.tool_results)) for r in rollouts)
    if not (calls or uses_tools):
        return {}
    return {"tool_calls": calls / max(1, len(rollouts)), "tool_success": answered / calls if calls else 0.0}


def episode_rollout(plan, ep: Episode):
    """The episode's rollout: the value of its last rollout-producing node (None if it has none)."""
    return rollout_reader(plan)(ep)


def rollout_reader(plan) -> Callable[[Episode], object]:
    """``episode_rollout`` for many episodes: the rollout node looked up once."""
    name = plan.rollout_node()
    if name is None:
        return lambda ep: None
    return lambda ep: ep.rollout(name) if name in ep.values else None


def _floats(value) -> list[float]:
    """A per-token value as one flat list of Python floats (one copy, no per-turn tensor ops); a
    float tensor's own values, which float64 holds exactly."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() == 1:
        return value.tolist()
    return torch.as_tensor(value, dtype=torch.float64).flatten().tolist()


def advantage_turn_metrics(plan, episodes: list[Episode], rollout_of: Callable[[Episode], object], *,
                           max_turns: int = 8) -> dict[str, float]:
    """How the advantages fall on the model's turns: for turn k (1-based, up to ``max_turns``),
    and for each episode's first and last turn, the mean over episodes of that turn's mean
    per-token advantage (``advantages/turn_k/mean``, ``/std``; ``advantages/first_turn/...``,
    ``advantages/last_turn/...``). Reads the first node whose output is ``advantages``; nothing for
    a recipe without one or with per-episode (not per-token) values."""
    name = next((n for n in plan.order if output_of(plan.nodes[n]).name == "advantages"), None)
    if name is None:
        return {}
    per_turn: dict[str, list[float]] = {}
    for ep in episodes:
        if name not in ep.values or (rollout := rollout_of(ep)) is None:
            continue
        adv = _floats(ep.lookup(name, ()))
        means, pos = [], 0
        for step in rollout.steps:
            n = len(step.token_ids)
            if step.trainable and n and pos + n <= len(adv):
                means.append(_fmean(adv[pos:pos + n]))
            pos += n
        if len(adv) == 1 or not means:
            continue
        for k, v in enumerate(means[:max_turns], start=1):
            per_turn.setdefault(f"turn_{k}", []).append(v)
        per_turn.setdefault("first_turn", []).append(means[0])
        per_turn.setdefault("last_turn", []).append(means[-1])
    out: dict[str, float] = {}
    for key, vals in per_turn.items():
        out[f"advantages/{key}/mean"], out[f"advantages/{key}/std"] = mean_std(vals)
    return out
