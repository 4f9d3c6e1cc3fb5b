"""MCP tool servers (and in-process Python tools) as a ``Toolbox`` an episode can call without
ever raising.

    async with mcp_tools("python -m materl.tools.calculator",        # stdio: a command line
                         "http://127.0.0.1:8765/mcp",                # streamable HTTP: a URL
                         MCPServer(name="nb", command="python -m materl.tools.notebook",
                                   timeout_s=5, max_concurrency=2)) as toolbox:
        tokenizer.apply_chat_template(messages, tools=toolbox.tools)  # OpenAI function specs
        result = await toolbox.call("calculate", {"expression": "2**10"}, episode_id="ep-3")
        await toolbox.end_episode("ep-3")                             # per-episode state is dropped

    mcp_tools({"db": "npx some-sqlite-mcp", "calc": "python -m materl.tools.calculator"},
              isolation="episode")          # tools db.query, calc.calculate; one db per episode

Any MCP server plugs in by its command line or URL alone; materl needs nothing from it but the
protocol (``mcp`` SDK ``Client`` over ``stdio_client`` / ``streamable_http_client``). A
``PythonTools(factory)`` (``materl.rollout.python_tools``) plugs in the same way.

Guarantees:

- ``Toolbox.call`` never raises (cancellation aside). Every failure comes back as
  ``ToolResult(is_error=True, content=<text the model sees>, error_kind=...)`` on that call:
  ``invalid_call`` (unknown tool, arguments that are not an object or miss a required key),
  ``tool`` (the tool reported an error), ``timeout``, ``crash``, ``protocol`` (an answer that
  is not valid MCP), ``unavailable`` (server down, toolbox closed).
- Timeouts: a call's limit is its server's ``timeout_s``, else ``mcp_tools(timeout_s=)``, else
  the caller's ``call(timeout_s=)`` (a compiled step passes its ``tool_timeout_s``), else 30 s.
  It bounds the time the call spends on a live server, a retry included; waiting for a free
  slot (``max_concurrency`` per server) or a restarting server is not counted.
- Recovery (``materl.rollout._mcp_server``): a server that dies is restarted (at once when it
  died under calls; with exponential backoff while it keeps dying on its own) and the calls
  that were in flight on it are retried once, one at a time, when that cannot run a side
  effect twice: ``retry_on_crash="idempotent"`` (the default) retries the calls of tools that
  declare themselves read-only or idempotent (MCP annotations ``readOnlyHint`` /
  ``idempotentHint``), ``True`` every call, ``False`` none; ``restart_after_timeouts`` calls in
  a row that time out restart it too. An HTTP server is never given up on: it is reconnected with backoff for as
  long as the run lasts, each call waiting at most ``MCPServer(reconnect_s=)`` for it.
- Start: every tool's input schema is checked as a JSON Schema (``ToolError`` naming server
  and tool). Server settings live in ``materl.rollout.mcp_spec`` (``MCPServer``).
- Output: each result is cut to ``max_output_bytes`` UTF-8 bytes with a visible marker, and
  invalid Unicode is replaced, before anything tokenizes it (``materl.rollout.tool_output``).
- Per-episode state: ``isolation="episode"`` gives each episode id its own server instance,
  taken from a pool of ``pool_size`` (default 4) pre-started ones and stopped by
  ``end_episode``; each such stdio instance runs in a folder of its own (``{episode_dir}`` in
  its command, env values and cwd; under ``mcp_tools(workdir=)``), removed with it, so a
  server that keeps its state in a file starts every episode fresh. A shared server keeps
  ``pool_size`` (default 1) started replacements, so a crash costs no start-up wait. With
  ``isolation="shared"`` one process serves all episodes; a tool whose input schema has an
  ``episode_id`` property is then stateful by convention: the Toolbox hides that property from
  the model and fills it with ``call(..., episode_id=...)`` (``materl.tools.notebook``).
- Names: a server's tools may be prefixed (``MCPServer(prefix="db")`` or the dict form) as
  ``db.query``; two servers offering the same unprefixed name is an error at start.

A Toolbox belongs to the event loop that started it. verl counterpart:
``verl.tools.mcp_base_tool.MCPBaseTool`` with ``verl.tools.utils.mcp_clients``; TRL:
``GRPOTrainer(tools=...)`` (plain functions) and ``environment_factory``.
"""

from __future__ import annotations

import asyncio
import copy
import difflib
import logging
import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import anyio

from materl.errors import ConfigError, ToolError
from materl.rollout._json_calls import clean_value
from materl.rollout._mcp_connection import Answer
from materl.rollout.mcp_spec import MCPServer, looks_like_url
from materl.rollout.mcp_spec import START_TIMEOUT_S as CONNECT_TIMEOUT_S  # noqa: F401 (re-export)
from materl.rollout.mcp_spec import check_settings as _check_settings
from materl.rollout.parsers import error_result
from materl.rollout.python_tools import PythonTools
from materl.rollout.tool_backend import ToolBackend, ToolSettings, ToolSource
from materl.rollout.tool_output import DEFAULT_MAX_OUTPUT_BYTES, cap_bytes
from materl.rollout.types import ToolCall, ToolResult

__all__ = ["EPISODE_ID", "MCPServer", "PythonTools", "Toolbox", "list_tools", "mcp_tools"]

log = logging.getLogger(__name__)

EPISODE_ID = "episode_id"
DEFAULT_TIMEOUT_S = 30.0
Source = ToolSource  # MCPServer, PythonTools, or any source with a backend (tool_backend)


def as_server(spec: Source | str | Sequence[str]) -> Source:
    """A server spec from a command line (str or list), a URL, an ``MCPServer`` or ``PythonTools``."""
    if isinstance(spec, ToolSource):
        return spec
    if isinstance(spec, str):
        if looks_like_url(spec):  # ws://... is a URL with an unsupported scheme, never a command line
            return MCPServer(url=spec.strip())
        return MCPServer(command=spec)
    if isinstance(spec, Sequence) and all(isinstance(a, str) for a in spec):
        return MCPServer(command=list(spec))
    raise ConfigError(f"a tool server is a command line (str or list of str), an http(s) URL, an MCPServer or "
                      f"PythonTools; got {type(spec).__name__}: {spec!r}")


def _with_prefix(prefix: str, spec: Any) -> Source:
    if not isinstance(prefix, str) or not prefix or any(c in prefix for c in " \t\n"):
        raise ConfigError(f"a tool-name prefix must be a non-empty string without spaces, got {prefix!r}")
    return replace(as_server(spec), prefix=prefix)


def mcp_tools(*servers: Source | str | Sequence[str] | Mapping[str, Any], timeout_s: float | None = None,
              max_concurrency: int = 8, restart: bool = True, isolation: str = "shared", pool_size: int | None = None,
              retry_on_crash: bool | str = "idempotent", restart_after_timeouts: int = 3,
              max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES, separator: str = ".",
              workdir: str | None = None) -> Toolbox:
    """A ``Toolbox`` over the given servers; start it with ``async with`` or ``await start()``.

    A dict ``{prefix: server}`` prefixes each server's tools (``db.query``). The keywords are
    defaults for servers that set none; see the module docstring for what each guarantees.
    ``workdir``: where isolated server instances get their own folders (default: the system's
    temporary directory).
    verl: ``tools_config_file`` + ``MCPClientManager``; here a server is its command line.
    """
    specs: list[Source] = []
    for s in servers:
        if isinstance(s, Mapping):
            specs.extend(_with_prefix(p, v) for p, v in s.items())
        else:
            specs.append(as_server(s))
    if not specs:
        raise ConfigError("mcp_tools() needs at least one server: a command line, a URL, an MCPServer or "
                          "PythonTools")
    return Toolbox(specs, timeout_s=timeout_s, max_concurrency=max_concurrency, restart=restart, isolation=isolation,
                   pool_size=pool_size, retry_on_crash=retry_on_crash, restart_after_timeouts=restart_after_timeouts,
                   max_output_bytes=max_output_bytes, separator=separator, workdir=workdir)


def list_tools(server: Source | str | Sequence[str], *, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """Synchronous: start ``server``, return its tools as the model sees them, stop it (CLI)."""

    async def _go() -> list[dict[str, Any]]:
        async with Toolbox([as_server(server)], timeout_s=timeout_s, restart=False) as toolbox:
            return toolbox.tools

    return anyio.run(_go)


@dataclass(frozen=True)
class _Route:
    backend: ToolBackend
    tool: Any  # the server's tool (name, description, input_schema)
    public: str


class Toolbox:
    """Tools of several servers behind one ``call``; see the module docstring."""

    def __init__(self, servers: Sequence[Source], *, timeout_s: float | None = None, max_concurrency: int = 8,
                 restart: bool = True, isolation: str = "shared", pool_size: int | None = None,
                 retry_on_crash: bool | str = "idempotent",
                 restart_after_timeouts: int = 3, max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
                 separator: str = ".", workdir: str | None = None):
        _check_settings(timeout_s, max_concurrency, isolation, pool_size, restart_after_timeouts, where="mcp_tools",
                        retry_on_crash=retry_on_crash)
        if not (isinstance(max_output_bytes, int) and max_output_bytes >= 256):
            raise ConfigError(f"mcp_tools: max_output_bytes must be an integer >= 256, got {max_output_bytes!r}")
        self.timeout_s, self.max_output_bytes, self.separator = timeout_s, max_output_bytes, separator
        self._servers = list(servers)
        self._settings = dict(max_concurrency=max_concurrency, restart=restart, isolation=isolation,
                              pool_size=pool_size, retry_on_crash=retry_on_crash,
                              restart_after_timeouts=restart_after_timeouts, workdir=workdir)
        if workdir is not None and not os.path.isdir(workdir):
            raise ConfigError(f"mcp_tools: workdir={workdir!r} is not an existing directory")
        self._backends: list[ToolBackend] = []
        self._specs: dict[str, Source] = {}
        self._build_backends()
        self._routes: dict[str, _Route] = {}
        self._state = "new"  # new -> started -> closed

    def __repr__(self) -> str:
        return f"Toolbox({', '.join(b.name for b in self._backends)})"

    def __reduce__(self):
        """A Toolbox travels (to a rollout worker) as its description: the receiver starts its
        own servers."""
        return _rebuild_toolbox, (self._servers, dict(timeout_s=self.timeout_s, max_output_bytes=self.max_output_bytes,
                                                      separator=self.separator, **self._settings))

    def _build_backends(self) -> None:
        """One backend per server (fresh: no process started yet)."""
        settings = ToolSettings(timeout_s=self.timeout_s, **self._settings)
        self._backends, self._specs = [], {}
        labels: Counter = Counter()
        for spec in self._servers:
            labels[spec.label] += 1
            name = spec.label if labels[spec.label] == 1 else f"{spec.label}-{labels[spec.label]}"
            self._specs[name] = spec
            self._backends.append(spec.backend(name, settings))

    # -- lifecycle (materl.rollout.services.EpisodeService) --
    def build(self) -> Toolbox:
        """A Toolbox is its own spec (``materl.rollout.services.ServiceSpec``): the steps compiled
        from a recipe share the recipe's one Toolbox, and each stops the servers it started (a
        pickled Toolbox is a description: the receiver starts its own)."""
        return self

    @property
    def started(self) -> bool:
        return self._state == "started"

    async def start(self) -> Toolbox:
        """Start every server (concurrently) and list their tools; raises ``ToolError`` if one
        cannot start, after stopping the others. A closed Toolbox starts again with new server
        processes (a recipe's toolbox outlives the compiled steps that used it)."""
        if self._state == "started":
            return self
        if self._state == "closed":
            self._build_backends()
        try:
            await asyncio.gather(*(b.start() for b in self._backends))
            self._routes = self._build_routes()
        except BaseException:
            await self.aclose()
            raise
        self._state = "started"
        return self

    async def aclose(self) -> None:
        """Stop every server. Calls made afterwards return an error result."""
        self._state = "closed"
        await asyncio.gather(*(b.close() for b in self._backends), return_exceptions=True)

    async def __aenter__(self) -> Toolbox:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def end_episode(self, episode_id: str) -> None:
        """The episode ``episode_id`` is over: its per-episode server instances and Python tool
        objects are stopped (in the background; ``aclose`` waits for them). Never raises."""
        for backend in self._backends:
            try:
                backend.end_episode(str(episode_id))
            except Exception:  # noqa: BLE001 - ending an episode must not fail it
                log.exception("ending episode %r on tool server %r failed", episode_id, backend.name)

    def _build_routes(self) -> dict[str, _Route]:
        routes: dict[str, _Route] = {}
        for backend in self._backends:
            prefix = self._specs[backend.name].prefix
            for tool in backend.tools:
                public = f"{prefix}{self.separator}{tool.name}" if prefix else tool.name
                if public in routes:
                    raise ToolError(f"tool {public!r} is offered by two servers, {routes[public].backend.name!r} and "
                                    f"{backend.name!r}; give one a prefix: mcp_tools({{'a': ..., 'b': ...}}) or "
                                    f"MCPServer(prefix=...)")
                routes[public] = _Route(backend, tool, public)
        return routes

    # -- what the model sees --
    @property
    def tools(self) -> list[dict[str, Any]]:
        """OpenAI-format function specs, ready for ``apply_chat_template(..., tools=...)``."""
        self._require_started()
        return [_function_spec(r.public, r.tool) for r in self._routes.values()]

    def names(self) -> list[str]:
        self._require_started()
        return sorted(self._routes)

    def is_stateful(self, name: str) -> bool:
        """Whether tool ``name`` takes a hidden per-episode ``episode_id`` (the shared-server convention)."""
        route = self._routes.get(name)
        return route is not None and EPISODE_ID in (route.tool.input_schema.get("properties") or {})

    @property
    def restarts(self) -> dict[str, int]:
        """Server name -> times one of its instances was replaced after it died or hung."""
        return {b.name: b.restarts for b in self._backends}

    @property
    def stats(self) -> dict[str, dict[str, int]]:
        """Server name -> counters: starts, restarts, crashes, timeouts, timeout_restarts, retries,
        start_failures."""
        return {b.name: dict(b.stats) for b in self._backends}

    def _require_started(self) -> None:
        if self._state != "started":
            raise ToolError(f"the Toolbox is {self._state}; use `async with mcp_tools(...)` or `await start()` "
                            f"before reading its tools")

    # -- calls --
    async def call(self, name: str, arguments: Mapping[str, Any] | None = None, *, episode_id: str | None = None,
                   call_id: str = "", timeout_s: float | None = None) -> ToolResult:
        """Call tool ``name``; always returns a ``ToolResult`` (errors as ``is_error=True`` with
        ``error_kind``). ``timeout_s``: the limit when neither the server nor the toolbox set one."""
        start = time.perf_counter()
        try:
            answer = await self._call(name, arguments, episode_id, timeout_s)
        except Exception as exc:  # a bug here must not end the episode; cancellation still propagates
            log.exception("Toolbox.call(%r) failed", name)
            answer = Answer(f"tool {name!r} failed: {type(exc).__name__}: {exc}", "tool")
        result = ToolResult(name=name, content=answer.text, is_error=answer.kind is not None,
                            latency_s=time.perf_counter() - start, call_id=call_id, error_kind=answer.kind,
                            attempts=answer.attempts, server_s=answer.server_s)
        return cap_bytes(result, self.max_output_bytes)

    async def execute(self, call: ToolCall, *, episode_id: str | None = None,
                      timeout_s: float | None = None) -> ToolResult:
        """Run a parsed ``ToolCall``; a malformed one (``call.error``) gets ``error_result``."""
        if call.error is not None:
            return error_result(call)
        return await self.call(call.name, call.arguments, episode_id=episode_id, call_id=call.id, timeout_s=timeout_s)

    async def _call(self, name: str, arguments: Any, episode_id: str | None, timeout_s: float | None) -> Answer:
        if self._state != "started":
            return Answer(f"tool {name!r} cannot run: the toolbox is {self._state}", "unavailable")
        route = self._routes.get(name) if isinstance(name, str) else None
        if route is None:
            return Answer(_unknown_tool(name, self.names()), "invalid_call")
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, Mapping):
            return Answer(f"arguments for tool {name!r} must be a JSON object, got {type(arguments).__name__}",
                          "invalid_call")
        stateful = self.is_stateful(name)
        args = clean_value({k: v for k, v in arguments.items() if k != EPISODE_ID or not stateful})
        problem = _check_arguments(name, _model_schema(route.tool.input_schema), args)
        if problem:
            return Answer(problem, "invalid_call")
        if stateful:
            if episode_id is None:
                return Answer(f"tool {name!r} keeps per-episode state and needs an episode id; the caller must pass "
                              f"Toolbox.call(..., episode_id=...)", "invalid_call")
            args[EPISODE_ID] = str(episode_id)
        limit = self._timeout(route.backend, timeout_s)
        return await route.backend.call(route.tool.name, args, episode_id=None if episode_id is None
                                        else str(episode_id), timeout_s=limit)

    def _timeout(self, backend: ToolBackend, call_timeout_s: float | None) -> float:
        """The server's own limit, else the toolbox's, else the caller's, else 30 s."""
        return backend.timeout_s or self.timeout_s or call_timeout_s or DEFAULT_TIMEOUT_S


# -- helpers --
def _model_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """The input schema shown to the model: no ``episode_id``, no pydantic ``title`` noise."""
    out = copy.deepcopy(dict(schema))
    out.pop("title", None)
    props = out.get("properties")
    if isinstance(props, dict):
        props.pop(EPISODE_ID, None)
        out["properties"] = {k: ({kk: vv for kk, vv in v.items() if kk != "title"} if isinstance(v, dict) else v)
                             for k, v in props.items()}
    if isinstance(out.get("required"), list):
        out["required"] = [k for k in out["required"] if k != EPISODE_ID]
    out.setdefault("type", "object")
    return out


def _function_spec(name: str, tool: Any) -> dict[str, Any]:
    description = tool.description or getattr(tool, "title", None) or ""
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": _model_schema(tool.input_schema)}}


def _check_arguments(name: str, schema: Mapping[str, Any], args: Mapping[str, Any]) -> str | None:
    """Missing required / unexpected keys, named the way a model can fix them; types are left
    to the server, which validates them and answers with an error result."""
    props = schema.get("properties")
    missing = [k for k in schema.get("required", []) if k not in args]
    extra = [] if not isinstance(props, dict) or schema.get("additionalProperties") is True else \
        [k for k in args if k not in props]
    if not missing and not extra:
        return None
    parts = []
    if missing:
        parts.append("missing required argument(s) " + ", ".join(repr(k) for k in missing))
    if extra:
        parts.append("unexpected argument(s) " + ", ".join(repr(k) for k in extra))
    expected = ", ".join(f"{k} ({v.get('type', 'any')})" if isinstance(v, dict) else k
                         for k, v in (props or {}).items()) or "no arguments"
    return f"invalid arguments for tool {name!r}: {'; '.join(parts)}. Expected: {expected}"


def _unknown_tool(name: Any, valid: list[str]) -> str:
    msg = f"unknown tool {name!r}; available tools: {', '.join(valid) or '(none)'}"
    close = difflib.get_close_matches(str(name), valid, n=1, cutoff=0.6)
    return msg + (f". Did you mean {close[0]!r}?" if close else "")


def _rebuild_toolbox(servers: Sequence[Source], settings: dict[str, Any]) -> Toolbox:
    return Toolbox(servers, **settings)
