"""The seam between a ``Toolbox`` and its tool sources.

A source (``MCPServer``, ``PythonTools``, or any frozen dataclass with the ``ToolSource``
members) describes tools; its ``backend(name, settings)`` builds the ``ToolBackend`` that runs
them: an MCP server's supervised instances (``_mcp_server._MCPBackend``) or a Python object per
episode (``python_tools._PythonBackend``). The Toolbox only routes calls, by tool name, to the
backends: it never asks which kind a source is.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from materl.rollout._mcp_connection import Answer


@dataclass(frozen=True)
class ToolSettings:
    """The ``mcp_tools`` defaults a source's own fields override."""

    timeout_s: float | None = None
    max_concurrency: int = 8
    restart: bool = True
    isolation: str = "shared"
    pool_size: int | None = None
    retry_on_crash: bool | str = "idempotent"
    restart_after_timeouts: int = 3
    workdir: str | None = None


class ToolBackend(Protocol):
    """One running tool source. ``tools``: each with ``name``, ``description``, ``input_schema``;
    ``timeout_s``: its own per-call limit (None: the Toolbox's); ``stats``: counters (starts,
    restarts, crashes, timeouts, ...)."""

    name: str
    tools: list[Any]
    timeout_s: float | None
    stats: Counter

    @property
    def restarts(self) -> int: ...

    async def start(self) -> None: ...

    async def call(self, tool: str, args: dict[str, Any], *, episode_id: str | None, timeout_s: float) -> Answer: ...

    def end_episode(self, episode_id: str) -> None:
        """Stop what the episode used, in the background; never raises."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class ToolSource(Protocol):
    """A description of tools that a Toolbox can run: ``label`` names it, ``prefix`` is shown
    before its tools' names (``dataclasses.replace`` sets it), ``backend`` builds its runner."""

    prefix: str | None

    @property
    def label(self) -> str: ...

    def describe(self) -> str: ...

    def backend(self, name: str, settings: ToolSettings) -> ToolBackend: ...


__all__ = ["ToolBackend", "ToolSettings", "ToolSource"]
