"""The principles op kind: an LLM judge's score of each episode against each of a list of
principles, aggregated into one reward (``ml.judge(principles=[...])``;
``materl.rollout.principles``), with an optional critique-then-revise pass first.

Row-wise aggregates (mean, weighted_sum, min, max) run per episode as soon as its rollout exists,
batched with the episodes that finish in the same tick; ``pareto`` compares a group's episodes, so
it runs once the group is done. Each principle's score is an episode metric
``reward/<node>/<principle>`` (reported as ``.../mean`` and ``.../std``); a judge failure fails
the episodes it was judging, with its error. The node holds a ``PrinciplesSpec``; the live
``PrincipleJudge`` is the compiled step's (``StageEnv.service``).
"""

from __future__ import annotations

from materl.compiler.context import StageEnv
from materl.compiler.episode import Episode, as_rollout
from materl.compiler.kinds.rewards import prompt_text
from materl.compiler.spec import Impl, Kind, OpSpec, Output, Role
from materl.graph.node import Node


async def principle_scores(run: StageEnv, node: Node, eps: list[Episode], inputs: list[list]) -> list[float]:
    judge = run.service(node, "principles")
    rollouts = [as_rollout(x) for x in inputs[0]]
    prompts = [prompt_text(ep.prompt) for ep in eps]
    await judge.revise_all(prompts, rollouts)
    result = await judge.vector_reward().aevaluate(
        prompts=prompts, completions=[r.text for r in rollouts], rollouts=rollouts,
        group_ids=[ep.group_id for ep in eps])
    for name, scores in result.components.items():
        for ep, s in zip(eps, scores.tolist()):
            ep.metrics[f"reward/{node.name}/{name}"] = float(s)
    return result.total.tolist()


SPECS = (
    OpSpec("principles", Role.SCORE, (Output("score", Kind.ROW),), (Impl("judge", batch=principle_scores),),
           locality=lambda n: "group" if n.params["principles"].group_wise else "row", services=("principles",),
           doc="an LLM judge's score per principle, aggregated (mean, ..., pareto within the group)"),
)
