"""Values, nodes and recipes: the symbolic layer. Recipes never see tensors; they wire Values.

    %advantages = advantages(%rewards) {estimator=grpo} [group]

A ``Node`` is ``(name, op, inputs, params, scope)``. Inputs are references: ``"completions"`` (the
node's value), ``"completions.text"`` (a field of it) or ``"@policy"`` (an agent parameter).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from materl.errors import UnknownNameError
from materl.graph.lint import lint as _lint
from materl.graph.refs import SCOPE_RANK, SCOPES, Scope, max_scope, ref_node  # noqa: F401  (re-exported)


@dataclass(frozen=True)
class Node:
    name: str
    op: str
    inputs: tuple[str, ...] = ()
    params: Mapping[str, Any] = field(default_factory=dict)
    scope: Scope = "batch"
    outputs: tuple[str, ...] = ()  # named outputs of custom ops; () = one unnamed value

    def __post_init__(self):
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))

    def __reduce__(self):  # a read-only mapping does not pickle; its dict does
        return Node, (self.name, self.op, self.inputs, dict(self.params), self.scope, self.outputs)

    @property
    def input_nodes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(ref_node(r) for r in self.inputs if not r.startswith("@")))

    @property
    def agents(self) -> tuple[str, ...]:
        return tuple(r[1:] for r in self.inputs if r.startswith("@"))

    def replace(self, **changes) -> Node:
        kw = dict(name=self.name, op=self.op, inputs=self.inputs, params=dict(self.params),
                  scope=self.scope, outputs=self.outputs)
        kw.update(changes)
        return Node(**kw)

    def __str__(self) -> str:
        args = ", ".join(r if r.startswith("@") else f"%{r}" for r in self.inputs)
        shown = {k: v for k, v in self.params.items() if not k.startswith("_")}
        if "terms" in shown:
            shown["terms"] = _Terms(shown["terms"], self.inputs)
        params = " {" + ", ".join(f"{k}={_short(v)}" for k, v in shown.items()) + "}" if shown else ""
        return f"%{self.name} = {self.op}({args}){params} [{self.scope}]"


class _Terms(tuple):
    """Reward terms shown as ``0.1*length + 0.9*diversity``; a step term as ``0.2*fmt@%turn_1``."""

    def __new__(cls, terms, inputs: tuple[str, ...] = ()):
        obj = super().__new__(cls, terms)
        obj.inputs = inputs
        return obj

    def __str__(self) -> str:
        parts = []
        for t in self:
            target = f"@%{self.inputs[t['step']]}" if "step" in t and t["step"] < len(self.inputs) else ""
            parts.append(f"{t['weight']:g}*{t['label']}{target}")
        return " + ".join(parts)


def _short(v: Any) -> str:
    if isinstance(v, _Terms):
        return str(v)
    if callable(v) and hasattr(v, "__name__"):
        return v.__name__
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        inner = ", ".join(_short(x) for x in v)
        return f"[{inner}]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_short(x)}" for k, x in v.items()) + "}"
    return repr(v) if isinstance(v, str) else str(v)


@dataclass(frozen=True)
class Recipe:
    """An immutable graph: parameters, nodes in trace order, and weighted loss terms."""

    name: str
    params: tuple[str, ...]
    agents: tuple[str, ...]  # the parameters used as agents; the others are data inputs
    nodes: tuple[Node, ...]
    losses: tuple[tuple[str, float], ...] = ()
    defaults: Mapping[str, Any] = field(default_factory=dict)
    origin: str = ""  # "transform of 'grpo'" for derived recipes
    doc: str = ""

    def __post_init__(self):
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))

    def __reduce__(self):
        return Recipe, (self.name, self.params, self.agents, self.nodes, self.losses, dict(self.defaults),
                        self.origin, self.doc)

    @property
    def node_map(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    def node(self, name: str) -> Node:
        nodes = self.node_map
        if name not in nodes:
            raise UnknownNameError(
                f"recipe {self.name!r} has no node {name!r}; nodes: {', '.join(nodes)}"
            )
        return nodes[name]

    def users(self, name: str) -> list[str]:
        return [n.name for n in self.nodes if name in n.input_nodes] + [
            "loss" for ref, _ in self.losses if ref_node(ref) == name
        ]

    @property
    def where(self) -> str:
        return f"recipe {self.name!r}" + (f", {self.origin}" if self.origin else "")

    def lint(self) -> list[str]:
        return _lint(self)

    def __str__(self) -> str:
        head = f"recipe {self.name}({', '.join(self.params)})"
        if self.origin:
            head += f"  # {self.origin}"
        lines = [head] + [f"  {n}" for n in self.nodes]
        if self.losses:
            terms = " + ".join(f"{w:g} * %{r}" if w != 1 else f"%{r}" for r, w in self.losses)
            lines.append(f"  loss = {terms}")
        return "\n".join(lines)

    __repr__ = __str__
