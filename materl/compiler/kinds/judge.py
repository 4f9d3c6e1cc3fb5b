"""The judge op kind: an LLM judge's score per episode (``ml.judge``; ``materl.rollout.judge``).

Absolute judging is episode-scope: each episode awaits its own judge call as soon as its rollout
exists, while other episodes still generate (the judge's latency overlaps the rollout, bounded
by the judge's semaphore). Relative judging (RULER) is group-scope: a group's episodes go to the
judge in one call once the group is done. A judge failure fails the episode (absolute) or the
group's episodes (relative), with the judge's error recorded. The node holds the judge's spec
(``JudgeSpec``); the live ``Judge`` is the compiled step's (``StageEnv.service``), which closes its
connection pools when the step closes.

Each judged episode records the call that scored it: ``judge/<node>/calls`` in its metrics (the
requests sent, 1 + the retries used; for a relative call, the group's call, so each of its
episodes shows the same count), reported per step as its mean and spread, and the judge's
answer in its ``notes`` (shown in the run's samples).
"""

from __future__ import annotations

import anyio

from materl.compiler.context import StageEnv
from materl.compiler.episode import Episode, as_rollout
from materl.compiler.kinds.rewards import prompt_text
from materl.compiler.spec import NOT_FOR, Impl, Kind, OpSpec, Output, Role
from materl.graph.node import Node


async def judge_episode(run: StageEnv, node: Node, ep: Episode, rollout) -> float:
    verdict = await run.service(node, "judge").verdict(prompt_text(ep.prompt), as_rollout(rollout))
    record(node, ep, verdict)
    return verdict.value


def record(node: Node, ep: Episode, verdict) -> None:
    """The judge call behind ``ep``'s score, in its metrics and notes (module docstring)."""
    ep.metrics[f"judge/{node.name}/calls"] = float(verdict.attempts)
    ep.notes[f"judge/{node.name}"] = verdict.answer


async def judge_groups(run: StageEnv, node: Node, eps: list[Episode], inputs: list[list]) -> list[float]:
    """One judge call per group (concurrently), scores back in the episodes' order."""
    judge, rollouts = run.service(node, "judge"), [as_rollout(x) for x in inputs[0]]
    groups: dict[int, list[int]] = {}
    for i, ep in enumerate(eps):
        groups.setdefault(ep.group, []).append(i)
    scores: list[float] = [0.0] * len(eps)
    errors: list[Exception] = []

    async def one(members: list[int]) -> None:
        try:
            verdict = await judge.group_verdict(prompt_text(eps[members[0]].prompt), [rollouts[i] for i in members])
        except Exception as exc:  # noqa: BLE001 - raised below as itself, not as an ExceptionGroup
            errors.append(exc)
            return
        for i, s in zip(members, verdict.value):
            scores[i] = s
            record(node, eps[i], verdict)

    async with anyio.create_task_group() as tg:
        for members in groups.values():
            tg.start_soon(one, members)
    if errors:  # the scheduler then judges group by group, so only the failing groups fail
        raise errors[0]
    return scores


def _relative(node: Node) -> bool:
    return bool(node.params.get("relative"))


SPECS = (
    OpSpec("judge", Role.SCORE, (Output("score", Kind.ROW),), (
        Impl("absolute", episode=judge_episode, when=lambda n, o: NOT_FOR if _relative(n) else None),
        Impl("relative", batch=judge_groups, when=lambda n, o: None if _relative(n) else NOT_FOR),
    ), locality=lambda n: "group" if _relative(n) else "episode", services=("judge",),
        doc="an LLM judge's score per episode against a rubric (relative: a group in one call)"),
)
