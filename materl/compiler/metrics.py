"""What a step reports about its rollouts: episode counts, reward means and spreads per reward
node and per reward term (and per-episode ``agent/`` figures), trained tokens, tool calls and
their success (0 and 0 on a tool recipe's step without a call) and per-node times."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from materl.compiler.episode import Episode
from materl.compiler.spec import Kind, output_of


def rollout_metrics(plan, episodes: list[Episode], rollout_of: Callable[[Episode], object],
                    timings: Mapping[str, float]) -> dict[str, float]:
    """Metrics of a rollout batch; ``rollout_of(episode)``: its Rollout or None, ``timings``: the
    step's stage times (``stage/rollout`` is reported as ``time/rollout``)."""
    ok = [e for e in episodes if e.error is None]
    m: dict[str, float] = {
        "episodes": float(len(episodes)), "failed_episodes": float(len(episodes) - len(ok)),
        "filtered_episodes": float(sum(e.filtered for e in ok)),
    }
    m |= _rewards(plan, ok)
    rollouts = [r for r in (rollout_of(e) for e in ok) if r is not None]
    m["tokens"] = float(sum(sum(r.loss_mask) for r in rollouts))
    truncated = sum(r.metadata.get("truncated") == "context" for r in rollouts)
    if truncated or any(plan.nodes[n].op == "generate_step" for n in plan.episode):
        m["episodes/truncated_context"] = float(truncated)
    results = [x for r in rollouts for x in r.tool_results]
    if results or plan.calls_tools():  # every step of a tool recipe has both: 0 and 0 without a call
        m["tool_calls"] = len(results) / max(1, len(rollouts))
        m["tool_success"] = sum(not x.is_error for x in results) / len(results) if results else 0.0
    for e in episodes:
        for k, v in e.timings.items():
            m[f"time/node/{k}"] = m.get(f"time/node/{k}", 0.0) + v / max(1, len(episodes))
    if timings.get("stage/rollout"):
        m["time/rollout"] = timings["stage/rollout"]
    return m


def _rewards(plan, ok: list[Episode]) -> dict[str, float]:
    m: dict[str, float] = {}
    reward_nodes = [n for n in plan.order if output_of(plan.nodes[n]).kind is Kind.SCORE]
    for name in reward_nodes:
        totals = torch.tensor([float(torch.as_tensor(e.values[name]).sum()) for e in ok if name in e.values])
        if len(totals):
            key = "reward" if name == reward_nodes[0] else f"reward/{name}"
            m[f"{key}/mean" if key != "reward" else "reward"] = float(totals.mean())
            m[f"{key}/std"] = float(totals.std(unbiased=False))
    comps = sorted({k for e in ok for k in e.metrics if k.startswith(("reward/", "agent/"))})
    for k in comps:
        vals = torch.tensor([e.metrics[k] for e in ok if k in e.metrics])
        m[f"{k}/mean"], m[f"{k}/std"] = float(vals.mean()), float(vals.std(unbiased=False))
    return m
