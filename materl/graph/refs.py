"""Scopes and references, shared by nodes, tracing and lint.

A reference names a node's value (``"completions"``), a field or named output of it
(``"completions.text"``, ``"advantages.returns"``) or an agent parameter (``"@policy"``).
"""

from __future__ import annotations

from typing import Literal

Scope = Literal["episode", "group", "batch"]
SCOPES: tuple[Scope, ...] = ("episode", "group", "batch")
SCOPE_RANK = {s: i for i, s in enumerate(SCOPES)}


def max_scope(*scopes: Scope) -> Scope:
    return max(scopes, key=SCOPE_RANK.__getitem__, default="episode")


def ref_node(ref: str) -> str:
    """'completions.text' -> 'completions'; '@policy' -> '@policy'."""
    return ref.split(".", 1)[0]
