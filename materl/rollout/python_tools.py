"""In-process Python tools with per-episode state: an environment factory.

    class Ledger:
        \"\"\"A ledger the agent writes to.\"\"\"
        def __init__(self):
            self.rows = []
        def add(self, amount: int) -> str:
            \"\"\"Add an amount to the ledger.\"\"\"
            self.rows.append(amount)
            return f"{len(self.rows)} rows"
        def total(self) -> int:
            \"\"\"The sum of all amounts.\"\"\"
            return sum(self.rows)

    toolbox = ml.mcp_tools(ml.PythonTools(Ledger), "python -m materl.tools.calculator")

Each episode gets its own object: ``factory()`` is called on the episode's first call and the
object is closed (its ``close()`` or ``aclose()``, if it has one) when the episode ends
(``Toolbox.end_episode``, which the compiled step calls for every episode, success or failure).
The object's public methods are its tools: name, first docstring paragraph as the
description, a JSON schema from the type hints; arguments are validated against the hints
before the method runs. (TRL: ``GRPOTrainer(environment_factory=...)``; verifiers: one
environment per rollout.)

Calls of one episode run one at a time (the object needs no locks); different episodes run
concurrently. An ``async def`` method runs on the event loop and is cancelled at its timeout;
a plain method runs in a worker thread, and at its timeout the call returns a timeout error
while the thread runs on to completion in the background (Python cannot stop a thread), so
give slow synchronous tools a process of their own (an MCP server) instead. A raised exception
is a tool error (kind ``"tool"``) with the exception's type and message.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_type_hints

import anyio

from materl.errors import ConfigError
from materl.rollout._mcp_connection import Answer
from materl.rollout.tool_backend import ToolSettings

__all__ = ["PythonTools"]

log = logging.getLogger("materl.rollout.mcp")
LIFECYCLE = ("close", "aclose")


@dataclass(frozen=True)
class PythonTools:
    """A tool source: ``factory()`` builds one object per episode whose public methods are tools.
    ``name``: the source's name (default: the factory's name); ``prefix``: shown before each tool
    name (``prefix.method``); ``timeout_s``: per-call limit (default: the Toolbox's)."""

    factory: Callable[[], Any]
    name: str = ""
    prefix: str | None = None
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if not callable(self.factory):
            raise ConfigError(f"PythonTools needs a factory (a class or a function returning an object), "
                              f"got {type(self.factory).__name__}: {self.factory!r}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ConfigError(f"timeout_s must be > 0, got {self.timeout_s!r}")

    @property
    def label(self) -> str:
        return self.name or getattr(self.factory, "__name__", "python_tools").lower()

    def describe(self) -> str:
        return f"PythonTools({getattr(self.factory, '__qualname__', self.factory)!r})"

    def backend(self, name: str, settings: ToolSettings) -> _PythonBackend:
        """One object per episode (``tool_backend.ToolSource``); the Toolbox's settings do not apply."""
        return _PythonBackend(self, name)


@dataclass(frozen=True)
class _PyTool:
    name: str
    description: str
    input_schema: dict[str, Any]
    args_model: Any


def _tools_of(obj: Any) -> list[_PyTool]:
    """The public methods of ``obj`` as tools (schema and validator from the type hints)."""
    from pydantic import ConfigDict, create_model

    tools = []
    for name, method in inspect.getmembers(obj, callable):
        if name.startswith("_") or name in LIFECYCLE or not inspect.ismethod(method):
            continue
        hints = get_type_hints(method)
        fields: dict[str, Any] = {}
        for param in inspect.signature(method).parameters.values():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise ConfigError(f"tool method {type(obj).__name__}.{name} takes *args/**kwargs; tools need "
                                  f"named parameters")
            default = ... if param.default is param.empty else param.default
            fields[param.name] = (hints.get(param.name, Any), default)
        model = create_model(f"{name}_arguments", __config__=ConfigDict(extra="forbid"), **fields)
        schema = model.model_json_schema()
        schema.pop("title", None)
        for prop in schema.get("properties", {}).values():
            prop.pop("title", None)
        doc = inspect.getdoc(method) or ""
        tools.append(_PyTool(name, doc.split("\n\n")[0].strip(), {"type": "object", **schema}, model))
    return tools


class _PythonBackend:
    """A ``PythonTools`` source behind the Toolbox: one object per episode id."""

    def __init__(self, spec: PythonTools, name: str):
        self.spec, self.name = spec, name
        self.timeout_s = spec.timeout_s
        self.stats: Counter = Counter()
        self.tools: list[_PyTool] = []
        self._objects: dict[str, Any] = {}
        self._locks: dict[str, anyio.Lock] = {}
        self._ending: set[asyncio.Task] = set()
        self.restarts = 0

    async def start(self) -> None:
        probe = await _build(self.spec.factory)
        try:
            self.tools = _tools_of(probe)
        finally:
            await _close(probe, self.name)
        if not self.tools:
            raise ConfigError(f"{self.spec.describe()} has no public methods to offer as tools")

    async def call(self, tool: str, args: dict[str, Any], *, episode_id: str | None, timeout_s: float) -> Answer:
        if episode_id is None:
            return Answer(f"tool {tool!r} keeps per-episode state and needs an episode id; the caller must pass "
                          f"Toolbox.call(..., episode_id=...)", "invalid_call")
        spec = next(t for t in self.tools if t.name == tool)
        try:
            values = spec.args_model.model_validate(args).model_dump()
        except Exception as exc:  # pydantic.ValidationError: the model sees which argument is wrong
            return Answer(f"invalid arguments for tool {tool!r}: {_validation_text(exc)}", "invalid_call")
        lock = self._locks.setdefault(episode_id, anyio.Lock())
        async with lock:
            started = time.monotonic()
            answer = await self._run(tool, episode_id, values, timeout_s)
            return answer._replace(server_s=time.monotonic() - started)

    async def _run(self, tool: str, episode_id: str, values: dict[str, Any], timeout_s: float) -> Answer:
        """Build the episode's object on its first call, then run the method within the timeout."""
        with anyio.move_on_after(timeout_s) as scope:
            try:
                obj = self._objects.get(episode_id)
                if obj is None:
                    obj = self._objects[episode_id] = await _build(self.spec.factory)
                    self.stats["starts"] += 1
                method = getattr(obj, tool)
                if inspect.iscoroutinefunction(method):
                    value = await method(**values)
                else:
                    value = await anyio.to_thread.run_sync(lambda: method(**values), abandon_on_cancel=True)
            except Exception as exc:  # a tool error the model can read
                return Answer(f"tool {tool!r} failed: {type(exc).__name__}: {exc}", "tool")
        if scope.cancelled_caught:
            self.stats["timeouts"] += 1
            return Answer(f"tool {tool!r} timed out after {timeout_s:g} s", "timeout")
        return Answer(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str))

    def end_episode(self, episode_id: str) -> None:
        obj = self._objects.pop(episode_id, None)
        self._locks.pop(episode_id, None)
        if obj is not None:
            task = asyncio.get_running_loop().create_task(_close(obj, self.name))
            self._ending.add(task)
            task.add_done_callback(self._ending.discard)

    async def close(self) -> None:
        for episode_id in list(self._objects):
            self.end_episode(episode_id)
        await asyncio.gather(*list(self._ending), return_exceptions=True)


async def _build(factory: Callable[[], Any]) -> Any:
    obj = factory()
    return await obj if inspect.isawaitable(obj) else obj


async def _close(obj: Any, name: str) -> None:
    for attr in LIFECYCLE:
        fn = getattr(obj, attr, None)
        if callable(fn):
            try:
                with anyio.move_on_after(30):
                    out = fn() if inspect.iscoroutinefunction(fn) else await anyio.to_thread.run_sync(fn)
                    if inspect.isawaitable(out):
                        await out
            except Exception:  # closing must not fail the episode that ended
                log.exception("closing a %r tool object failed", name)
            return


def _validation_text(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    parts = [f"{'.'.join(str(p) for p in e.get('loc', ())) or 'arguments'}: {e.get('msg', '')}" for e in errors()]
    return "; ".join(parts)
