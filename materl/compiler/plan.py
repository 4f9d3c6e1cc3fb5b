"""Planning: validate a recipe against its agents, prune dead nodes, order, pick an
implementation per node from the op table, and partition into stages.

Stages:
  rollout  - episode nodes, one async task per episode; group nodes fire when their group's
             episodes are done (unless they need batch-wide statistics).
  prepare  - learner, once per batch, no gradient: frozen-agent forwards, batch-wide scores,
             batch-scope custom ops. A trainable agent's log-probs read here are the sampling
             log-probs (old log-probs); its values are a no-grad forward (old values).
  update   - learner, per micro-batch with gradient: trainable-agent forwards and the losses.

Every decision is read from the node's ``OpSpec`` (its role, locality and implementation
rules); nothing here compares op names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from materl.compiler.options import CompileOptions
from materl.compiler.spec import RecipeInfo, Role, spec_of
from materl.errors import CompileError
from materl.graph.lint import topo_order
from materl.graph.node import Node, Recipe, ref_node
from materl.ops.reference import REFERENCE_POLICIES

STAGES = ("episode", "group", "prepare", "update")


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
    impls: dict[str, str] = field(default_factory=dict)  # node -> implementation name
    notes: dict[str, str] = field(default_factory=dict)  # node -> why a Mojo implementation is not used

    def impl(self, name: str):
        """The ``Impl`` chosen for node ``name`` (looked up once per plan and process)."""
        cache = self.__dict__.setdefault("_impl_cache", {})
        found = cache.get(name)
        if found is None:
            spec = spec_of(self.nodes[name])
            found = cache[name] = next(i for i in spec.impls if i.name == self.impls[name])
        return found

    def __getstate__(self) -> dict:
        """Pickled without the implementation cache (a worker looks them up in its own op table)."""
        return {k: v for k, v in self.__dict__.items() if k != "_impl_cache"}

    def role(self, name: str) -> Role:
        return spec_of(self.nodes[name]).role

    def stage_of(self, name: str) -> str:
        for stage in STAGES:
            if name in getattr(self, stage):
                return stage
        return "input"

    def rollout_node(self) -> str | None:
        """The last rollout-producing episode node: what an episode's tokens are."""
        return next((n for n in reversed(self.episode) if self.role(n) is Role.ROLLOUT), None)

    def generates(self) -> bool:
        return self.rollout_node() is not None

    def calls_tools(self) -> bool:
        """Whether an episode node calls tools (``call_tools``)."""
        return any(self.role(n) is Role.TOOLS for n in self.episode)

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
                note = f" ({self.notes[name]})" if name in self.notes else ""
                lines.append(f"    {self.nodes[name]}  <- {self.impls[name]}{note}{extra}")
        if self.recipe.losses:
            terms = " + ".join(f"{w:g} * %{ref}" if w != 1 else f"%{ref}" for ref, w in self.recipe.losses)
            lines.append(f"  loss = {terms}")
        for name in self.order:
            describe = spec_of(self.nodes[name]).describe
            if describe is not None and (text := describe(self.nodes[name], self.impls[name])):
                lines.append(f"  {text}")
        if self.pruned:
            lines.append(f"  pruned (unused): {', '.join(self.pruned)}")
        mb = o.micro_batch_size or "mini-batch"
        lines.append(
            f"  learner: epochs={o.epochs} mini_batch={o.mini_batch_size or 'batch'} micro_batch={mb} "
            f"lr={o.lr:g} max_grad_norm={o.max_grad_norm} reference={o.reference} group_size={o.group_size}"
        )
        return "\n".join(lines)


def make_plan(recipe: Recipe, agents: dict[str, Any], options: CompileOptions, *,
              rollout_only: bool = False) -> Plan:
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
    _check(recipe, {n: nodes[n] for n in keep}, agents, options)
    order = [n for n in topo_order(recipe) if n in keep]
    plan = Plan(recipe, options, nodes, order, pruned=[n.name for n in recipe.nodes if n.name not in keep])
    _partition(plan, agents)
    for name in plan.order:
        impl, note = spec_of(nodes[name]).choose(nodes[name], options)
        plan.impls[name] = impl.name
        if note:
            plan.notes[name] = note
    return plan


def _check(recipe: Recipe, nodes: dict[str, Node], agents: dict[str, Any], options: CompileOptions) -> None:
    """Every op kind's wiring checks and agent requirements, all problems in one error."""
    info = RecipeInfo(nodes, agents, options)
    problems: list[str] = []
    for node in nodes.values():
        spec = spec_of(node)
        problems += spec.check(node, info)
        for name in node.agents:
            if name in agents and (why := spec.agent_check(node, agents[name])):
                problems.append(why)
    if problems:
        raise CompileError(f"compile: {recipe.where}: " + "; ".join(problems))


def _resolve_defaults(recipe: Recipe, options: CompileOptions) -> dict[str, Node]:
    """Fill choices left to compile time: each spec's ``resolve`` (the default advantage
    estimator, the ``step_credit`` option), and with a reference policy that uses no reference
    model (``reference="none"``), the KL terms dropped."""
    uses_reference = REFERENCE_POLICIES.get(options.reference).uses_reference
    nodes = {}
    for n in recipe.nodes:
        spec = spec_of(n)
        if spec.resolve is not None:
            n = spec.resolve(n, options, recipe.defaults)
        if not uses_reference and spec.without_reference is not None:
            n = spec.without_reference(n)
        nodes[n.name] = n
    return nodes


def _needed(recipe: Recipe, nodes: dict[str, Node]) -> set[str]:
    """Nodes the losses depend on, plus filters (they act by side effect: dropping groups)."""
    todo = [ref_node(r) for r, _ in recipe.losses] + [n for n, node in nodes.items() if spec_of(node).always_runs]
    keep: set[str] = set()
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep.add(name)
        todo.extend(nodes[name].input_nodes)
    return keep


def _partition(plan: Plan, agents: dict[str, Any]) -> None:
    nodes = plan.nodes
    for name in plan.order:
        n = nodes[name]
        role = spec_of(n).role
        trainable_forward = role is Role.FORWARD and agents[n.agents[0]].trainable
        upstream_live = role is not Role.SCORE and any(src in plan.live for src in n.input_nodes)
        if trainable_forward or (n.scope == "batch" and upstream_live):
            plan.live.add(name)
        if role is Role.DATA:
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
    return spec_of(n).locality_of(n) in ("row", "group", "group_call")
