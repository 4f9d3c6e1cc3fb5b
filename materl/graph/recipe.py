"""``@ml.recipe``, ``@ml.algorithm(using=...)`` and the plain transforms (``replace``, ``with_kl``,
``with_off_policy_correction``).

A transform is a function from a recipe to a new recipe; the base is never mutated.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from materl.errors import RecipeError, UnknownNameError
from materl.graph.kinds import facts
from materl.graph.node import Node, Recipe, ref_node
from materl.graph.trace import (
    AgentRef,
    Builder,
    Placeholder,
    RewardExpr,
    Value,
    active_builder,
    signature_params,
    trace,
)
from materl.graph.constructors import _kl_settings
from materl.ops.kl import ESTIMATOR_DEFAULT, KL_ALIASES, KL_ESTIMATORS
from materl.ops.offpolicy import correction_params


def recipe(fn: Callable | None = None, **defaults):
    """Trace ``fn`` into a Recipe. ``@ml.recipe`` or ``@ml.recipe(advantage="dr_grpo", ...)``:
    keyword defaults are used where a constructor leaves a choice to the recipe."""
    def build(f: Callable) -> Recipe:
        params = signature_params(f)
        builder = Builder(f.__name__, params=params, defaults=defaults)
        trace(f, builder, {p: Placeholder(p) for p in params})
        return _finish(builder, doc=inspect.getdoc(f) or "")

    return build(fn) if fn is not None else build


def algorithm(*, using: Recipe, **defaults):
    """Derive a recipe: the body gets a graph controller over a copy of ``using`` plus any extra
    parameters (new agents or inputs), and describes only what changes."""
    if not isinstance(using, Recipe):
        raise RecipeError(f"@ml.algorithm(using=...) needs a recipe, got {type(using).__name__}")

    def build(f: Callable) -> Recipe:
        names = signature_params(f)
        if not names:
            raise RecipeError(f"algorithm {f.__name__!r} must take the graph as its first parameter")
        extra = names[1:]
        builder = Builder(f.__name__, list(using.nodes), list(using.losses),
                          list(using.params) + [p for p in extra if p not in using.params],
                          list(using.agents), {**using.defaults, **defaults})
        args = {names[0]: Graph(builder), **{p: Placeholder(p) for p in extra}}
        trace(f, builder, args)
        return _finish(builder, origin=f"transform of {using.name!r}", doc=inspect.getdoc(f) or "")

    return build


def transform(base: Recipe, body: Callable[[Graph], None], *, name: str | None = None) -> Recipe:
    builder = Builder(name or base.name, list(base.nodes), list(base.losses), list(base.params),
                      list(base.agents), dict(base.defaults))
    trace(body, builder, {"graph": Graph(builder)})
    return _finish(builder, origin=f"transform of {base.name!r}", doc=base.doc)


def replace(base: Recipe, node: str, new: Callable[[Graph], Value], *, name: str | None = None) -> Recipe:
    """A new recipe where ``node`` is replaced by what ``new(graph)`` builds; every consumer of
    the old node now reads the new one, which takes over its name.

        dr = ml.replace(grpo, "advantages", lambda g: ml.advantages(g.rewards, estimator="dr_grpo"))
    """
    return transform(base, lambda graph: getattr(graph, node).replace_with(new(graph)), name=name)


def with_kl(base: Recipe, *, estimator: str = "k3", coef: float = 0.04, clamp: float | None = ESTIMATOR_DEFAULT,
            bias_correction: bool = False, name: str | None = None) -> Recipe:
    """Set the KL penalty ``coef * agg(KL_estimator(policy || ref))`` of every policy loss (each
    must already read reference log-probs); the term is replaced whole. ``clamp``: omitted, the
    estimator's default (10 for k3); None, no clamp. ``bias_correction=True``: times the ratio
    pi/pi_old with its gradient (TRL's default KL: ``estimator="k3", clamp=None,
    bias_correction=True``). See ``ml.policy_loss``."""
    KL_ESTIMATORS.get(KL_ALIASES.get(estimator, estimator))
    settings = _kl_settings("with_kl", clamp, bias_correction)
    losses = [n for n in base.nodes if facts(n).policy_gradient]
    if not losses:
        raise RecipeError(f"with_kl: {base.where} has no policy_loss node; nodes: "
                          f"{', '.join(n.name for n in base.nodes)}")
    nodes = []
    for n in base.nodes:
        if facts(n).policy_gradient:
            if len(n.inputs) < 3:
                raise RecipeError(
                    f"with_kl: policy loss {n.name!r} reads no reference log-probs; pass ref_logprobs "
                    f"to its constructor ({base.where})"
                )
            kept = {k: v for k, v in n.params.items() if k not in ("kl_clamp", "kl_bias_correction")}
            n = n.replace(params={**kept, "kl": estimator, "kl_coef": float(coef), **settings})
        nodes.append(n)
    extra = "".join(f", {k[3:]}={v!r}" for k, v in settings.items())
    return Recipe(name or base.name, base.params, base.agents, tuple(nodes), base.losses, base.defaults,
                  f"with_kl({estimator}, {coef:g}{extra}) of {base.name!r}", base.doc)


def with_off_policy_correction(base: Recipe, method: str, *, name: str | None = None, **hparams) -> Recipe:
    """Correct every policy loss of ``base`` for tokens the learner's policy did not sample.

        tis = ml.with_off_policy_correction(grpo, "tis", cap=2.0)
        mis = ml.with_off_policy_correction(grpo, "mis", upper=2.0, lower=0.5, level="sequence")
        areal = ml.with_off_policy_correction(grpo, "decoupled", cap=5.0)

    Each policy loss's logprobs node gets ``recompute=True`` (its old log-probs become a
    no-gradient forward of the policy at the start of the step, the proximal policy), and the loss
    gets ``correction={method, hyperparameters}``: its ratio is pi/pi_proximal and each token's
    loss is weighted by w(pi_proximal/pi_sampling). ``method`` is a
    ``materl.ops.offpolicy.CORRECTIONS`` name (tis, mis, decoupled); ``hparams`` its keywords,
    recorded with the defaults filled in, so ``print(recipe)`` shows what runs."""
    params = correction_params(method, hparams)
    nodes = base.node_map
    losses = [n for n in base.nodes if facts(n).policy_gradient]
    if not losses:
        raise RecipeError(f"with_off_policy_correction: {base.where} has no policy_loss node; nodes: "
                          f"{', '.join(nodes)}")
    sources = set()
    for n in losses:
        src = nodes.get(ref_node(n.inputs[1]))
        if src is None or not facts(src).logprobs:
            raise RecipeError(f"with_off_policy_correction: policy loss {n.name!r} reads %{n.inputs[1]}, "
                              f"{'a ' + src.op + ' node' if src is not None else 'no node'}; a correction needs "
                              f"log-probs from ml.logprobs ({base.where})")
        sources.add(src.name)
    new = []
    for n in base.nodes:
        if facts(n).policy_gradient:
            n = n.replace(params={**n.params, "correction": {"method": method, **params}})
        elif n.name in sources:
            n = n.replace(params={**n.params, "recompute": True})
        new.append(n)
    shown = ", ".join(f"{k}={v!r}" for k, v in params.items())
    return Recipe(name or base.name, base.params, base.agents, tuple(new), base.losses, base.defaults,
                  f"with_off_policy_correction({method}, {shown}) of {base.name!r}", base.doc)


def _finish(builder: Builder, *, origin: str = "", doc: str = "") -> Recipe:
    result = builder.freeze(origin=origin, doc=doc)
    problems = result.lint()
    if problems:
        raise RecipeError("; ".join(problems))
    return result


class NodeHandle(Value):
    """``graph.<name>`` inside a transform: a Value that can also be replaced."""
    __slots__ = ()

    def replace_with(self, new: Value | RewardExpr) -> None:
        builder = active_builder("replace_with")
        if isinstance(new, RewardExpr):
            new = builder.materialize(new)
        if not isinstance(new, Value) or new.path:
            raise RecipeError(f"replace_with needs a node's Value, got {new!r}")
        _replace(builder, self.node, new.node)


class Graph:
    """The graph controller handed to ``@ml.algorithm`` bodies."""
    def __init__(self, builder: Builder):
        object.__setattr__(self, "_builder", builder)

    def __getattr__(self, name: str) -> NodeHandle:
        if name.startswith("_"):
            raise AttributeError(name)
        b = self._builder
        if name in b.names():
            return NodeHandle(name)
        if name in b.params and name not in b.agents:
            b.ref(Placeholder(name))  # materialise the input node
            return NodeHandle(name)
        raise UnknownNameError(f"recipe {b.name!r} has no node {name!r}; nodes: {', '.join(b.names())}")

    def agent(self, name: str) -> AgentRef:
        if name not in self._builder.agents:
            raise UnknownNameError(f"recipe {self._builder.name!r} has no agent {name!r}; "
                                   f"agents: {', '.join(self._builder.agents)}")
        return AgentRef(name)

    def remove(self, name: str) -> None:
        b = self._builder
        b.get(name)
        users = [n.name for n in b.nodes if name in n.input_nodes]
        users += ["loss"] * any(ref_node(r) == name for r, _ in b.losses)
        if users:
            raise RecipeError(f"cannot remove node {name!r} from recipe {b.name!r}: used by {', '.join(users)}")
        b.nodes = [n for n in b.nodes if n.name != name]

    def names(self) -> list[str]:
        return self._builder.names()

    def __repr__(self) -> str:
        return str(self._builder.freeze())


def _rename(builder: Builder, old: str, new: str, *, only: set[str] | None = None) -> None:
    def fix(ref: str) -> str:
        head, _, rest = ref.partition(".")
        return (new + ("." + rest if rest else "")) if head == old else ref

    nodes = []
    for n in builder.nodes:
        if only is None or n.name in only:
            n = n.replace(inputs=tuple(fix(r) for r in n.inputs))
        if n.name == old and (only is None or old in only):
            n = n.replace(name=new)
        nodes.append(n)
    builder.nodes = nodes
    if only is None:
        builder.losses = [(fix(r), w) for r, w in builder.losses]


def _ancestors(builder: Builder, name: str) -> set[str]:
    nodes = {n.name: n for n in builder.nodes}
    seen: set[str] = set()
    todo = [name]
    while todo:
        for src in nodes[todo.pop()].input_nodes:
            if src in nodes and src not in seen:
                seen.add(src)
                todo.append(src)
    return seen


def _replace(builder: Builder, old: str, new: str) -> None:
    builder.get(old)
    if old == new:
        return
    inner = _ancestors(builder, new)
    consumers = {n.name for n in builder.nodes if n.name not in inner | {new, old}}
    _rename(builder, old, new, only=consumers)  # consumers now read the new node
    builder.losses = [(new + r[len(old):] if r.split(".")[0] == old else r, w) for r, w in builder.losses]
    if old in inner:  # the new node wraps the old one: keep it under another name
        _rename(builder, old, builder.unique(old + "_prev"))
    else:
        builder.nodes = [n for n in builder.nodes if n.name != old]
    _rename(builder, new, old)
    _restore_order(builder)


def _restore_order(builder: Builder) -> None:
    """Stable topological order: trace order, each node after its inputs."""
    nodes = {n.name: n for n in builder.nodes}
    done: dict[str, None] = {}

    def visit(name: str) -> None:
        if name in done or name not in nodes:
            return
        done[name] = None  # marks before recursing: cycles are reported by lint, not here
        for src in nodes[name].input_nodes:
            visit(src)
        order.append(nodes[name])

    order: list[Node] = []
    for n in builder.nodes:
        visit(n.name)
    builder.nodes = order
