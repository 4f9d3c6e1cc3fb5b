"""Tracing: ``@ml.recipe`` calls the body once with symbolic Values and records a graph.

Node constructors (``ml.generate``, ``ml.reward``, ...) add nodes to the active ``Builder``.
Nothing runs: a recipe is data.
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from materl.errors import RecipeError, UnknownNameError
from materl.graph.node import Node, Recipe, Scope, max_scope, ref_node

_BUILDER: contextvars.ContextVar[Builder | None] = contextvars.ContextVar("materl_builder", default=None)

# The ops whose value is an episode's rollout (the compiler's op table gives them Role.ROLLOUT;
# tests/compiler/test_spec.py checks the two agree).
ROLLOUT_OPS = ("generate", "generate_step", "structure_rollout", "env_rollout", "agent_episodes", "self_play")


class Value:
    """A symbolic result: node ``node`` and a field path (``completions.text``)."""

    __slots__ = ("node", "path")

    def __init__(self, node: str, path: tuple[str, ...] = ()):
        object.__setattr__(self, "node", node)
        object.__setattr__(self, "path", path)

    @property
    def ref(self) -> str:
        return ".".join((self.node,) + self.path)

    def __getattr__(self, attr: str) -> Value:
        if attr.startswith("_"):
            raise AttributeError(attr)
        builder = _BUILDER.get()
        if builder is not None and not self.path:
            builder.check_field(self.node, attr)
        return Value(self.node, self.path + (attr,))

    def __setattr__(self, *_):
        raise AttributeError("Values are immutable")

    # reward arithmetic: a Value (e.g. a custom op's scores) can join a reward expression
    def __add__(self, other):
        return RewardExpr.of(self) + other

    def __radd__(self, other):
        return other + RewardExpr.of(self) if isinstance(other, RewardExpr) else RewardExpr.of(self) + other

    def __sub__(self, other):
        return RewardExpr.of(self) - other

    def __rsub__(self, other):
        return RewardExpr.coerce(other) - RewardExpr.of(self)

    def __mul__(self, k: float):
        return RewardExpr.of(self) * k

    __rmul__ = __mul__

    def __neg__(self):
        return RewardExpr.of(self) * -1.0

    def __repr__(self) -> str:
        return f"%{self.ref}"


class Placeholder(Value):
    """A recipe parameter: an agent where a constructor wants one, data (an input node) elsewhere."""

    __slots__ = ()


class AgentRef:
    """A recipe parameter used as an agent (policy, ref_policy, value_model)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"@{self.name}"


@dataclass(frozen=True)
class RewardTerm:
    """One weighted term: a registry name / callable, or a Value computed elsewhere."""

    source: Any  # str | Callable | Value
    weight: float = 1.0
    params: tuple[tuple[str, Any], ...] = ()
    rollout: str | None = None  # ref of the rollout the reward scores
    step: str | None = None  # ref of a generate step: the reward lands on that step's last token
    name: str = ""

    def label(self) -> str:
        """The term's name in prints and metrics (``reward/<label>/mean``): ``name=``, else the
        registry name or function name; a Value's is its node's name (``Builder.term_label``
        adds the field for ops with several outputs)."""
        if self.name:
            return self.name
        if isinstance(self.source, Value):
            return self.source.node
        return self.source if isinstance(self.source, str) else getattr(self.source, "__name__", "reward")


class RewardExpr:
    """A weighted sum of reward terms; becomes one ``rewards`` node when something consumes it."""

    def __init__(self, terms: tuple[RewardTerm, ...]):
        self.terms = terms
        self.value: Value | None = None  # set once materialised
        builder = _BUILDER.get()
        if builder is not None:
            builder.pending_rewards.append(self)

    @staticmethod
    def of(v: Value) -> RewardExpr:
        return RewardExpr((RewardTerm(v),))

    @staticmethod
    def coerce(x) -> RewardExpr:
        if isinstance(x, RewardExpr):
            return x
        if isinstance(x, Value):
            return RewardExpr.of(x)
        raise RecipeError(f"cannot combine a reward with {x!r}; rewards combine with rewards and Values")

    def _absorb(self, *exprs: RewardExpr) -> None:
        builder = _BUILDER.get()
        for e in exprs:
            if builder is not None and e in builder.pending_rewards and e.value is None:
                builder.pending_rewards.remove(e)

    def __add__(self, other) -> RewardExpr:
        other = RewardExpr.coerce(other)
        self._absorb(self, other)
        return RewardExpr(self.terms + other.terms)

    __radd__ = __add__

    def __sub__(self, other) -> RewardExpr:
        return self + RewardExpr.coerce(other) * -1.0

    def __mul__(self, k: float) -> RewardExpr:
        if not isinstance(k, (int, float)):
            raise RecipeError(f"rewards scale by numbers, got {k!r}")
        self._absorb(self)
        return RewardExpr(tuple(RewardTerm(t.source, t.weight * k, t.params, t.rollout, t.step, t.name)
                                for t in self.terms))

    __rmul__ = __mul__

    def __neg__(self) -> RewardExpr:
        return self * -1.0

    def __repr__(self) -> str:
        return " + ".join(f"{t.weight:g}*{t.label()}" for t in self.terms)


class Builder:
    """Mutable graph under construction (one per trace)."""

    def __init__(self, name: str, nodes: list[Node] | None = None, losses: list | None = None,
                 params: list[str] | None = None, agents: list[str] | None = None,
                 defaults: dict | None = None):
        self.name = name
        self.nodes: list[Node] = list(nodes or [])
        self.losses: list[tuple[str, float]] = list(losses or [])
        self.params: list[str] = list(params or [])
        self.agents: list[str] = list(agents or [])
        self.defaults: dict = dict(defaults or {})
        self.pending_rewards: list[RewardExpr] = []

    # -- lookup --
    def get(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise UnknownNameError(f"recipe {self.name!r} has no node {name!r}; nodes: {', '.join(self.names())}")

    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def check_field(self, node_name: str, attr: str) -> None:
        node = next((n for n in self.nodes if n.name == node_name), None)
        if node is not None and node.outputs and attr not in node.outputs:
            fn = node.params.get("fn")
            raise RecipeError(
                f"op {getattr(fn, '__name__', node.op)!r} (node {node_name!r}) has no output {attr!r}; "
                f"outputs: {', '.join(node.outputs)}"
            )

    def unique(self, base: str) -> str:
        names = set(self.names())
        if base not in names:
            return base
        i = 1
        while f"{base}_{i}" in names:
            i += 1
        return f"{base}_{i}"

    # -- building --
    def add(self, op: str, inputs: list, params: dict, *, scope: Scope, name: str | None,
            default_name: str, outputs: tuple[str, ...] = (), fixed_scope: bool = False) -> Value:
        refs = [self.ref(x) for x in inputs]
        input_scopes = [self.get(ref_node(r)).scope for r in refs if not r.startswith("@") and ref_node(r) in self.names()]
        if not fixed_scope:
            scope = max_scope(scope, *input_scopes)
        if name is not None and name in self.names():
            raise RecipeError(f"duplicate node name {name!r} in recipe {self.name!r} (op {op})")
        node = Node(name or self.unique(default_name), op, tuple(refs), params, scope, outputs)
        self.nodes.append(node)
        return Value(node.name)

    def ref(self, x) -> str:
        if isinstance(x, AgentRef):
            if x.name not in self.agents:
                self.agents.append(x.name)
            return "@" + x.name
        if isinstance(x, RewardExpr):
            x = self.materialize(x)
        if isinstance(x, Value) and x.node in self.params and x.node not in self.names():
            if x.node in self.agents:
                raise RecipeError(f"parameter {x.node!r} of recipe {self.name!r} is an agent; it cannot also be data")
            self.nodes.append(Node(x.node, "input", (), {}, "episode"))
        if isinstance(x, Value):
            return x.ref
        raise RecipeError(f"recipe {self.name!r}: expected a Value from a node, got {type(x).__name__} {x!r}")

    def agent(self, x, what: str) -> AgentRef:
        """The agent argument of a constructor: a recipe parameter (or graph.agent(name))."""
        if isinstance(x, Placeholder):
            x = AgentRef(x.node)
        if not isinstance(x, AgentRef):
            raise RecipeError(f"{what} needs an agent parameter of the recipe first (e.g. policy), got {x!r}")
        if x.name in self.names() and self.get(x.name).op == "input":
            raise RecipeError(f"parameter {x.name!r} of recipe {self.name!r} is data; {what} needs an agent")
        if x.name not in self.agents:
            self.agents.append(x.name)
        return x

    def materialize(self, expr: RewardExpr, name: str | None = None) -> Value:
        """Turn a reward expression into one ``rewards`` node. Each term scores a rollout: the
        one it was wired to (``rollout=``), else the recipe's latest generated output; a
        ``step=`` term also records the step whose last token receives its reward."""
        if expr.value is not None:
            return expr.value
        if expr in self.pending_rewards:
            self.pending_rewards.remove(expr)
        refs: list[str] = []

        def index(ref: str) -> int:
            if ref not in refs:
                refs.append(ref)
            return refs.index(ref)

        terms = []
        for t in expr.terms:
            spec: dict[str, Any] = {"weight": t.weight, "label": self.term_label(t)}
            if isinstance(t.source, Value):
                spec["input"] = index(t.source.ref)
            else:
                spec["fn"], spec["params"] = t.source, dict(t.params)
            scored = t.rollout or (None if isinstance(t.source, Value) else self._default_scored(t))
            if scored is not None:
                spec["rollout"] = index(scored)
            if t.step is not None:
                spec["step"] = index(t.step)
            terms.append(spec)
        expr.value = self.add("rewards", [Value(*_split(r)) for r in refs], {"terms": terms},
                              scope="episode", name=name, default_name="rewards")
        return expr.value

    def term_label(self, term: RewardTerm) -> str:
        """``term.label()``; a Value of an op with several outputs adds the field (``penalty.scores``)."""
        source = term.source
        if term.name or not isinstance(source, Value) or not source.path or source.node not in self.names():
            return term.label()
        return term.label() if len(self.get(source.node).outputs) <= 1 else source.ref

    def _default_scored(self, term: RewardTerm) -> str:
        latest = self.latest_completions(f"reward {term.label()!r}")
        if latest is None:
            raise RecipeError(
                f"reward {term.label()!r} in recipe {self.name!r} has nothing to score: no generate "
                f"node comes before it; generate first or wire it with rollout="
            )
        return latest.ref

    def latest_completions(self, what: str = "") -> Value | None:
        """The value rewards and advantages score when not wired with ``rollout=``/``completions=``:
        the recipe's one rollout. Several rollouts that no later turn continues (two ``generate``
        nodes, as ReMax has) make that ambiguous: an error saying what to write instead."""
        producers = [n for n in self.nodes if n.op in ROLLOUT_OPS]
        continued = {ref_node(r) for n in producers for r in n.inputs}
        frontier = [n.name for n in producers if n.name not in continued]
        if len(frontier) > 1:
            raise RecipeError(
                f"{what or 'this node'} in recipe {self.name!r} could score any of {', '.join('%' + f for f in frontier)}; "
                f"wire it to one: rollout=<value> for ml.reward, completions=<value> for ml.advantages"
            )
        return Value(producers[-1].name) if producers else None

    def freeze(self, *, origin: str = "", doc: str = "") -> Recipe:
        for expr in list(self.pending_rewards):
            self.materialize(expr)
        self.nodes = unique_term_labels(self.nodes)
        return Recipe(self.name, tuple(self.params), tuple(self.agents), tuple(self.nodes),
                      tuple(self.losses), self.defaults, origin, doc)


def unique_term_labels(nodes: list[Node]) -> list[Node]:
    """Reward terms named apart over all the recipe's rewards nodes, in node order: a label taken
    by an earlier term becomes ``<label>_2``, ``<label>_3``... (each term has its own
    ``reward/<label>`` metric; two terms never add into one)."""
    taken: set[str] = set()
    out = []
    for n in nodes:
        if n.op != "rewards":
            out.append(n)
            continue
        terms = []
        for t in n.params["terms"]:
            label, k = t["label"], 2
            while label in taken:
                label, k = f"{t['label']}_{k}", k + 1
            taken.add(label)
            terms.append(t if label == t["label"] else {**t, "label": label})
        changed = any(a is not b for a, b in zip(terms, n.params["terms"]))
        out.append(n.replace(params={**n.params, "terms": terms}) if changed else n)
    return out


def _split(ref: str) -> tuple[str, tuple[str, ...]]:
    head, *rest = ref.split(".")
    return head, tuple(rest)


def active_builder(what: str) -> Builder:
    builder = _BUILDER.get()
    if builder is None:
        raise RecipeError(f"{what} builds a graph node; call it inside an @ml.recipe or @ml.algorithm body")
    return builder


def trace(fn: Callable, builder: Builder, args: dict[str, Any]) -> Any:
    token = _BUILDER.set(builder)
    try:
        return fn(**args)
    finally:
        _BUILDER.reset(token)


def signature_params(fn: Callable) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
