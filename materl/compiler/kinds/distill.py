"""The distill_advantages op kind: on-policy distillation's per-token advantages
(``ml.distill_advantages``, ``ml.with_distillation``; the math is ``materl.ops.distill``).

Inputs: the scored rollout (its loss mask), the student's log-probs (a trainable agent's
``ml.logprobs`` node: its prepared value is the sampling log-probs, or the proximal ones under
``recompute=True``), the teacher's (a frozen agent's ``ml.logprobs`` node over the same prompts and
completions: one no-gradient forward of the teacher over the student's exact ids, on the teacher's
own device), then optionally the task advantages the term is added to. Batch scope: it runs in the
learner's prepare, after both forwards. Each episode's mean reverse KL per trained token is
reported as ``<node>/reverse_kl`` (tinker-cookbook's ``teacher_kl``, averaged per episode).

Compile-time checks: the student is trainable, the teacher frozen, both read the same sequences,
and the two tokenizers are the same vocabulary (the teacher scores the student's ids; a teacher
with another tokenizer would score other tokens, so that is an error, never a silent mismatch).
"""

from __future__ import annotations

from typing import Any

from materl.compiler.context import StageEnv
from materl.compiler.episode import Episode, as_rollout, pad_rows, to_tensor
from materl.compiler.spec import Impl, Kind, OpSpec, Output, RecipeInfo, Role, spec_of
from materl.graph.node import Node, ref_node
from materl.ops.distill import distill_advantages


def distill_torch(run: StageEnv, node: Node, eps: list[Episode], inputs: list[list]) -> dict:
    mask = pad_rows([as_rollout(x).loss_mask for x in inputs[0]])
    width = mask.shape[1]
    student, teacher, *base = (to_tensor(v, width=width).double() for v in inputs[1:])
    adv, reverse_kl = distill_advantages(student, teacher, mask.double(), base[0] if base else None,
                                         coef=node.params["coef"], discount=node.params["discount"])
    tokens = mask.sum(1).clamp(min=1)
    for ep, kl in zip(eps, (reverse_kl.sum(1) / tokens).tolist()):
        ep.metrics[f"{node.name}/reverse_kl"] = kl
    return {"advantages": adv.float(), "reverse_kl": reverse_kl.float()}


def tokenizer_mismatch(student: Any, teacher: Any) -> str | None:
    """Why ``teacher`` cannot score ``student``'s token ids (None when the vocabularies agree)."""
    a, b = student.get_vocab(), teacher.get_vocab()
    if a == b:
        return None
    differ = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[:3]
    shown = ", ".join(f"{tok!r}={i} in {'student' if a.get(tok) == i else 'teacher'} only" for tok, i in differ)
    return (f"student vocabulary has {len(a)} tokens, teacher's {len(b)}; they differ (e.g. {shown}), so the "
            f"teacher would score other tokens than the student sampled")


def check_distill(node: Node, info: RecipeInfo) -> list[str]:
    """Wiring and agent checks, all at compile time (see the module docstring)."""
    sources = {role: info.producer(node.inputs[i]) for i, role in ((1, "student"), (2, "teacher"))}
    bad = [f"node {node.name!r}: its {role} log-probs %{node.inputs[i]} come from "
           f"{'op ' + n.op if n is not None else 'no node'}; they must come from ml.logprobs"
           for (role, n), i in zip(sources.items(), (1, 2)) if n is None or not spec_of(n).facts.logprobs]
    if bad:
        return bad
    student, teacher = sources["student"], sources["teacher"]
    problems = []
    if _sequences(student) != _sequences(teacher):
        problems.append(f"node {node.name!r}: the teacher's log-probs %{teacher.name} read {_sequences(teacher)}, "
                        f"the student's %{student.name} read {_sequences(student)}; the teacher must score the "
                        f"student's own sequences")
    agents = {role: info.agents.get(n.agents[0]) for role, n in sources.items()}
    s_agent, t_agent = agents["student"], agents["teacher"]
    if s_agent is not None and not s_agent.trainable:
        problems.append(f"node {node.name!r}: the student agent {student.agents[0]!r} is frozen; the student "
                        f"is the trainable agent that sampled the completions")
    if t_agent is not None and t_agent.trainable:
        problems.append(f"node {node.name!r}: the teacher agent {teacher.agents[0]!r} is trainable; a teacher "
                        f"is frozen (pass ml.Agent(..., trainable=False))")
    if s_agent is not None and t_agent is not None and s_agent is not t_agent:
        why = tokenizer_mismatch(s_agent.tokenizer, t_agent.tokenizer)
        if why:
            problems.append(f"node {node.name!r}: tokenizer mismatch between student {student.agents[0]!r} "
                            f"({s_agent.name}) and teacher {teacher.agents[0]!r} ({t_agent.name}): {why}")
    return problems


def _sequences(logprobs_node: Node) -> list[str]:
    """The (prompts, completions) refs a logprobs node reads."""
    return [r for r in logprobs_node.inputs if not r.startswith("@")]


def teacher_agents(plan) -> set[str]:
    """The agents a kept distill node reads as teachers (never references that follow the policy)."""
    teachers = set()
    for node in (plan.nodes[n] for n in plan.order):
        i = spec_of(node).teacher_input
        if i is not None:
            teachers.add(plan.nodes[ref_node(node.inputs[i])].agents[0])
    return teachers


SPECS = (
    OpSpec("distill_advantages", Role.SCORE,
           (Output("advantages", Kind.TOKENS), Output("reverse_kl", Kind.TOKENS)),
           (Impl("torch", batch=distill_torch),), locality="batch", check=check_distill, teacher_input=2,
           doc="on-policy distillation: per-token advantages -coef * (student - teacher log-prob), "
               "optionally discounted, added to task advantages"),
)
