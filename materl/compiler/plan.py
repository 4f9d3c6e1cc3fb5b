"""Planning: validate a recipe against its agents, prune dead nodes, order, pick an
implementation per node, and partition into stages.

Stages:
  rollout  - episode nodes, one async task per episode; group nodes fire when their group's
             episodes are done (unless they need batch-wide statistics).
  prepare  - learner, once per batch, no gradient: frozen-agent forwards, batch-wide advantages,
             batch-scope custom ops. A trainable agent's log-probs read here are the sampling
             log-probs (old log-probs); its values are a no-grad forward (old values).
  update   - learner, per micro-batch with gradient: trainable-agent forwards and the losses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from materl.compiler.options import CompileOptions
from materl.errors import CompileError
from materl.graph.lint import topo_order
from materl.graph.node import Node, Recipe, ref_node

LOSS_OPS = ("policy_loss", "value_loss", "preference_loss")
# estimators whose statistics stay inside one group; others need the whole batch
GROUP_LOCAL_ESTIMATORS = {"grpo", "dr_grpo", "rloo", "opo"}


@dataclass
class Plan:
    recipe: Recipe
    options: CompileOptions
    nodes: dict[str, Node]
    order: list[str]
    episode: list[str] = field(default_factory=list)
    group: list[str] = field(default_factory=list)
    prepare: list[str] = field(default_factory=list)
    update: list[str] = field(default_factory=list)
    live: set[str] = field(default_factory=set)  # recomputed with gradient each micro-batch
    pruned: list[str] = field(default_factory=list)
    impls: dict[str, str] = field(default_factory=dict)  # node -> implementation label
    fused: list[tuple[str, ...]] = field(default_factory=list)

    def stage_of(self, name: str) -> str:
        for stage in ("episode", "group", "prepare", "update"):
            if name in getattr(self, stage):
                return stage
        return "input"

    def explain(self) -> str:
        r = self.recipe
        lines = [f"plan for {r.where}"]
        titles = {
            "episode": "rollout stage: one async task per episode",
            "group": "rollout stage: per group, when the group's episodes are done",
            "prepare": "learner prepare: once per batch, no gradient",
            "update": "learner update: per micro-batch, with gradient",
        }
        o = self.options
        for stage, title in titles.items():
            names = getattr(self, stage)
            if not names:
                continue
            lines.append(f"  {title}")
            for name in names:
                extra = " (live)" if name in self.live else ""
                lines.append(f"    {self.nodes[name]}  <- {self.impls.get(name, 'python')}{extra}")
        if self.recipe.losses:
            terms = " + ".join(f"{w:g} * %{ref}" if w != 1 else f"%{ref}" for ref, w in self.recipe.losses)
            lines.append(f"  loss = {terms}")
        for group in self.fused:
            lines.append(f"  fused: {' + '.join(group[:-1])} {group[-1]} (one Mojo kernel call per group)")
        if self.pruned:
            lines.append(f"  pruned (unused): {', '.join(self.pruned)}")
        mb = o.micro_batch_size or "mini-batch"
        lines.append(
            f"  learner: epochs={o.epochs} mini_batch={o.mini_batch_size or 'batch'} micro_batch={mb} "
            f"lr={o.lr:g} max_grad_norm={o.max_grad_norm} reference={o.reference} group_size={o.group_size}"
        )
        return "\n".join(lines)


def make_plan(recipe: Recipe, agents: dict, options: CompileOptions, impl_for, *, rollout_only: bool = False) -> Plan:
    problems = recipe.lint()
    if problems:
        raise CompileError("; ".join(problems))
    unknown = sorted(set(agents) - set(recipe.agents) - set(recipe.params))  # unused parameters are fine
    if unknown:
        raise CompileError(f"compile: {recipe.where} has no agent parameter(s) {', '.join(unknown)}; "
                           f"agents: {', '.join(recipe.agents)}")
    if not recipe.losses and not rollout_only:
        raise CompileError(f"compile: {recipe.where} sets no loss; call ml.set_loss(...) in the recipe")
    nodes = _resolve_defaults(recipe, options)
    keep = set(nodes) if rollout_only else _needed(recipe, nodes)
    used = {a for name in keep for a in nodes[name].agents}
    missing = [a for a in recipe.agents if a in used and a not in agents]
    if missing:  # an agent only pruned nodes use need not be given
        raise CompileError(
            f"compile: {recipe.where} needs agent(s) {', '.join(missing)}; got {', '.join(agents) or 'none'}"
        )
    order = [n for n in topo_order(recipe) if n in keep]
    plan = Plan(recipe, options, nodes, order, pruned=[n.name for n in recipe.nodes if n.name not in keep])
    _partition(plan, agents)
    for name in plan.order:
        if nodes[name].op != "input":
            plan.impls[name] = impl_for(plan, nodes[name])
    _batch_fused_rewards(plan)
    return plan


def _batch_fused_rewards(plan: Plan) -> None:
    """A fused reward chain runs once per group (one kernel call over the group's completions)
    instead of once per episode, when no episode node reads it."""
    for name in list(plan.episode):
        if plan.impls.get(name) != "mojo-fused":
            continue
        if any(name in plan.nodes[other].input_nodes for other in plan.episode):
            continue
        plan.episode.remove(name)
        plan.group.insert(0, name)
        terms = plan.nodes[name].params["terms"]
        from materl.compiler.score_ops import fusable_terms

        plan.fused.append(tuple(terms[i]["label"] for i in fusable_terms(plan.nodes[name])) + (f"in %{name}",))


def _resolve_defaults(recipe: Recipe, options: CompileOptions) -> dict[str, Node]:
    default_adv = options.advantage or recipe.defaults.get("advantage") or "grpo"
    nodes = {}
    for n in recipe.nodes:
        if n.op == "advantages" and n.params.get("estimator") is None:
            n = n.replace(params={**n.params, "estimator": default_adv})
        nodes[n.name] = n
    return nodes


def _needed(recipe: Recipe, nodes: dict[str, Node]) -> set[str]:
    todo = [ref_node(r) for r, _ in recipe.losses] + [n for n, node in nodes.items() if node.op == "filter_groups"]
    keep: set[str] = set()
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep.add(name)
        todo.extend(nodes[name].input_nodes)
    return keep


def _partition(plan: Plan, agents: dict) -> None:
    nodes = plan.nodes
    for name in plan.order:
        n = nodes[name]
        trainable_forward = n.op in ("logprobs", "values") and agents[n.agents[0]].trainable
        upstream_live = any(src in plan.live for src in n.input_nodes) and n.op != "advantages"
        if trainable_forward or (n.scope == "batch" and upstream_live):
            plan.live.add(name)
        if n.op == "input":
            continue
        if n.scope == "episode":
            plan.episode.append(name)
        elif n.scope == "group" and _group_local(n, nodes, plan.prepare):
            plan.group.append(name)
        elif name in plan.live:
            plan.update.append(name)
        else:
            plan.prepare.append(name)
    for ref, _ in plan.recipe.losses:
        if ref_node(ref) not in plan.live:
            raise CompileError(
                f"compile: loss term {ref!r} of {plan.recipe.where} does not depend on any trainable agent; "
                f"trainable: {', '.join(a for a, ag in agents.items() if ag.trainable) or 'none'}"
            )


def _group_local(n: Node, nodes: dict[str, Node], deferred: list[str]) -> bool:
    if any(nodes[s].scope == "batch" or s in deferred for s in n.input_nodes):
        return False
    if n.op == "advantages":
        return n.params["estimator"] in GROUP_LOCAL_ESTIMATORS and n.params.get("scale", "group") != "batch"
    return True
