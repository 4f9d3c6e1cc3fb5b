"""Reference policies that follow a trainable agent: which frozen agent mirrors which, and their
update after each step (``options.reference``: "frozen" never moves, "ema", periodic resets, ...;
``materl.ops.reference``). (TRL: ``ref_model`` + ``sync_ref_model``; verl: the ref worker.)"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from materl.compiler.kinds.distill import teacher_agents
from materl.ops.reference import REFERENCE_POLICIES, make_reference_policy

Pair = tuple[Any, Any, Any]  # (reference agent, source agent, policy)


def reference_pairs(plan, agents: Mapping[str, Any], options) -> list[Pair]:
    """(reference agent, source agent, policy) for each frozen agent that mirrors a trainable one,
    under a policy that moves it (``follows``: none under "frozen" or "none", the default); an
    agent no kept node reads is left out (it is never loaded)."""
    if not getattr(REFERENCE_POLICIES.get(options.reference), "follows", True):
        return []
    trainable = [n for n, a in agents.items() if a.trainable and getattr(a, "head", None) != "value"]
    used = {a for name in plan.order for a in plan.nodes[name].agents}
    teachers = teacher_agents(plan)  # a distillation teacher stays as it is
    pairs = []
    for name, a in agents.items():
        if a.trainable or not trainable or getattr(a, "head", None) == "value" or name not in used or name in teachers:
            continue
        source = "policy" if "policy" in trainable else trainable[0]
        policy = make_reference_policy(options.reference, **dict(options.reference_options))
        pairs.append((a, agents[source], policy))
    return pairs


def update_references(pairs: Iterable[Pair], *, step: int, kl: float | None, source=None) -> None:
    """Move each reference toward its source after optimizer step ``step``. ``source(agent)``: the
    source's parameters as whole tensors on the reference's device (default: its parameters,
    moved there when the two agents sit on different devices)."""
    for ref, src, policy in pairs:
        ref_params = list(ref.model.parameters())
        with torch.no_grad():
            params = source(src) if source is not None else _on(ref_params, src.model.parameters())
            policy.update(ref_params, params, step=step, kl=kl if kl is not None else 0.0)


def _on(like: list[torch.Tensor], params: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]:
    return (p if p.device == r.device else p.to(r.device) for r, p in zip(like, params))  # lazy: "frozen" reads none
