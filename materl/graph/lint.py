"""Recipe checks: cycles, missing inputs, duplicate names, scope errors, missing loss."""

from __future__ import annotations

from typing import TYPE_CHECKING

from materl.graph.refs import SCOPE_RANK, ref_node

if TYPE_CHECKING:
    from materl.graph.node import Recipe


def lint(recipe: Recipe) -> list[str]:
    """Every problem found, one message each (empty when the recipe is well formed)."""
    problems: list[str] = []
    where = recipe.where
    seen: dict[str, int] = {}
    for n in recipe.nodes:
        seen[n.name] = seen.get(n.name, 0) + 1
    for name, count in seen.items():
        if count > 1:
            problems.append(f"duplicate node name {name!r} ({count} nodes) in {where}")
    nodes = recipe.node_map
    for n in recipe.nodes:
        for agent in n.agents:
            if agent not in recipe.agents:
                problems.append(f"node {n.name!r} uses agent {agent!r}, which is not a parameter of {where}")
        for src in n.input_nodes:
            if src not in nodes:
                problems.append(
                    f"node {n.name!r} needs input {src!r}; recipe provides: "
                    f"{', '.join(x for x in nodes if x != n.name)} ({where})"
                )
            elif SCOPE_RANK[nodes[src].scope] > SCOPE_RANK[n.scope]:
                problems.append(
                    f"scope error: {nodes[src].scope}-scope value {src!r} feeds {n.scope}-scope node "
                    f"{n.name!r} ({where}); an {n.scope} node runs before {src!r} exists"
                )
    for ref, _ in recipe.losses:
        if ref_node(ref) not in nodes:
            problems.append(f"loss term {ref!r} is not a node of {where}")
    cycle = find_cycle(recipe)
    if cycle:
        problems.append(f"cycle: {' -> '.join(cycle)} ({where})")
    return problems


def find_cycle(recipe: Recipe) -> list[str] | None:
    nodes = recipe.node_map
    state: dict[str, int] = {}  # 1 = on stack, 2 = done
    stack: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        stack.append(name)
        for src in nodes[name].input_nodes:
            if src not in nodes:
                continue
            if state.get(src) == 1:
                return stack[stack.index(src):] + [src]
            if src not in state and (found := visit(src)):
                return found
        stack.pop()
        state[name] = 2
        return None

    for name in nodes:
        if name not in state and (found := visit(name)):
            return found
    return None


def topo_order(recipe: Recipe) -> list[str]:
    """Node names so that every node comes after its inputs (trace order breaks ties)."""
    nodes = recipe.node_map
    order: list[str] = []
    done: set[str] = set()

    def visit(name: str) -> None:
        if name in done:
            return
        done.add(name)
        for src in nodes[name].input_nodes:
            if src in nodes:
                visit(src)
        order.append(name)

    for n in recipe.nodes:
        visit(n.name)
    return order
