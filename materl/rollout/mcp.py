"""MCP tool servers as a ``Toolbox`` an episode can call without ever raising.

    async with mcp_tools("python -m materl.tools.calculator",        # stdio: a command line
                         "http://127.0.0.1:8765/mcp",                # streamable HTTP: a URL
                         MCPServer(name="nb", command="python -m materl.tools.notebook",
                                   timeout_s=5, max_concurrency=2)) as toolbox:
        tokenizer.apply_chat_template(messages, tools=toolbox.tools)  # OpenAI function specs
        result = await toolbox.call("calculate", {"expression": "2**10"}, episode_id="ep-3")

Any MCP server plugs in by its command line or URL alone; materl needs nothing from it but
the protocol (``mcp`` SDK ``Client`` over ``stdio_client`` / ``streamable_http_client``).

``Toolbox.call`` never raises (cancellation aside). An unknown tool name, arguments that are
not an object or miss a required key, a tool that fails (MCP ``isError``), a call past its
``timeout_s``, and a stdio server that crashes all come back as
``ToolResult(is_error=True, content=<text the model sees>)`` with the latency. A server whose
connection drops is restarted (``restart=True``) and later calls go to the new process; a
server that fails to come back three times in a row is marked down and its calls return an
error. Each server has its own concurrency limit (a semaphore). ``timeout_s`` bounds the
request itself: waiting for a free slot or for a restarting server is not counted (the latter
is bounded by ``CONNECT_TIMEOUT_S``); ``ToolResult.latency_s`` is the whole wait.

Per-episode state (convention): a tool whose input schema has a property named
``episode_id`` is stateful. The Toolbox removes that property from the schema the model sees
and fills it with ``call(..., episode_id=...)`` (overwriting anything the model wrote there),
so one server process can keep one state per episode; ``materl.tools.notebook`` is the
example. Calling such a tool without ``episode_id`` is an error result.

Each server connection lives in its own long-lived asyncio task, which enters and exits the
SDK's context managers (their anyio cancel scopes must be left in the task that entered
them); calls are plain requests on that connection from the caller's task. A Toolbox belongs
to the event loop that started it.

verl counterpart: ``verl.tools.mcp_base_tool.MCPBaseTool`` with ``verl.tools.utils.mcp_clients``
(a client pool built from a JSON config, one tool class per tool). TRL: ``GRPOTrainer(tools=...)``
takes plain Python functions, not MCP servers.
"""

from __future__ import annotations

import asyncio
import copy
import difflib
import logging
import os
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import anyio

from materl.errors import ConfigError, ToolError
from materl.rollout._mcp_connection import CONNECT_TIMEOUT_S, _Connection  # noqa: F401 (re-export)
from materl.rollout.parsers import error_result
from materl.rollout.types import ToolCall, ToolResult

__all__ = ["EPISODE_ID", "MCPServer", "Toolbox", "list_tools", "mcp_tools"]

log = logging.getLogger(__name__)

EPISODE_ID = "episode_id"


@dataclass(frozen=True, kw_only=True)
class MCPServer:
    """One MCP server: ``command`` (stdio; a string is split like a shell would) or ``url``
    (streamable HTTP). ``timeout_s`` and ``max_concurrency`` override the Toolbox defaults.
    A leading ``python``/``python3`` in ``command`` runs as ``sys.executable``. A stdio
    server gets the SDK's safe default environment (PATH, HOME, ...) plus ``env``.
    (Not the SDK's server class ``mcp.server.mcpserver.MCPServer``: this one only describes
    how to reach a server.)"""

    command: str | Sequence[str] | None = None
    url: str | None = None
    name: str = ""
    env: Mapping[str, str] | None = None
    cwd: str | None = None
    max_concurrency: int | None = None
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if (self.command is None) == (self.url is None):
            raise ConfigError(f"MCPServer needs exactly one of command= or url=, got command={self.command!r}, "
                              f"url={self.url!r}")
        if self.command is not None and not self.argv:
            raise ConfigError(f"MCPServer command is empty: {self.command!r}")
        if self.url is not None and urlsplit(self.url).scheme not in ("http", "https"):
            raise ConfigError(f"MCPServer url must start with http:// or https://, got {self.url!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ConfigError(f"max_concurrency must be >= 1, got {self.max_concurrency!r}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ConfigError(f"timeout_s must be > 0, got {self.timeout_s!r}")

    @property
    def argv(self) -> list[str]:
        if self.command is None:
            return []
        argv = shlex.split(self.command) if isinstance(self.command, str) else [str(a) for a in self.command]
        if argv and argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        return argv

    @property
    def label(self) -> str:
        """``name``, else derived: ``-m pkg.mod`` -> ``mod``, ``path/x.py`` -> ``x``, URL -> host:port."""
        if self.name:
            return self.name
        if self.url is not None:
            return urlsplit(self.url).netloc or self.url
        argv = self.argv
        if "-m" in argv[:-1]:
            return argv[argv.index("-m") + 1].rsplit(".", 1)[-1]
        script = next((a for a in argv if a.endswith(".py")), argv[0])
        return os.path.splitext(os.path.basename(script))[0]

    def describe(self) -> str:
        return self.url if self.url is not None else shlex.join(self.argv)


def as_server(spec: MCPServer | str | Sequence[str]) -> MCPServer:
    """A server spec from a command line (str or list), a URL, or an ``MCPServer``."""
    if isinstance(spec, MCPServer):
        return spec
    if isinstance(spec, str):
        if spec.strip().startswith(("http://", "https://")):
            return MCPServer(url=spec.strip())
        return MCPServer(command=spec)
    if isinstance(spec, Sequence) and all(isinstance(a, str) for a in spec):
        return MCPServer(command=list(spec))
    raise ConfigError(f"a tool server is a command line (str or list of str), an http(s) URL or an MCPServer; "
                      f"got {type(spec).__name__}: {spec!r}")


def mcp_tools(*servers: MCPServer | str | Sequence[str], timeout_s: float = 30.0, max_concurrency: int = 8,
              restart: bool = True) -> Toolbox:
    """A ``Toolbox`` over the given MCP servers; start it with ``async with`` or ``await start()``.

    timeout_s: per-call limit (seconds) for servers that set none. max_concurrency: concurrent
    calls per server. restart: restart a stdio server (reconnect an HTTP one) whose connection
    drops. verl: ``tools_config_file`` + ``MCPClientManager``; here a server is its command line.
    """
    if not servers:
        raise ConfigError("mcp_tools() needs at least one server: a command line, a URL or an MCPServer")
    return Toolbox([as_server(s) for s in servers], timeout_s=timeout_s, max_concurrency=max_concurrency,
                   restart=restart)


def list_tools(server: MCPServer | str | Sequence[str], *, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """Synchronous: start ``server``, return its tools as the model sees them, stop it (CLI)."""

    async def _go() -> list[dict[str, Any]]:
        async with Toolbox([as_server(server)], timeout_s=timeout_s, restart=False) as toolbox:
            return toolbox.tools

    return anyio.run(_go)


class Toolbox:
    """Tools of several MCP servers behind one ``call``; see the module docstring."""

    def __init__(self, servers: Sequence[MCPServer], *, timeout_s: float = 30.0, max_concurrency: int = 8,
                 restart: bool = True):
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be > 0, got {timeout_s!r}")
        if max_concurrency < 1:
            raise ConfigError(f"max_concurrency must be >= 1, got {max_concurrency!r}")
        labels: dict[str, int] = {}
        self._conns: list[_Connection] = []
        for spec in servers:
            label = spec.label
            labels[label] = labels.get(label, 0) + 1
            name = label if labels[label] == 1 else f"{label}-{labels[label]}"
            self._conns.append(_Connection(spec, name, timeout_s=spec.timeout_s or timeout_s,
                                           max_concurrency=spec.max_concurrency or max_concurrency,
                                           restart=restart))
        self._routes: dict[str, _Connection] = {}
        self._state = "new"  # new -> started -> closed

    def __repr__(self) -> str:
        return f"Toolbox({', '.join(c.name for c in self._conns)})"

    # -- lifecycle --
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
            self._conns = [_Connection(c.spec, c.name, timeout_s=c.timeout_s, max_concurrency=c.max_concurrency,
                                       restart=c.restart) for c in self._conns]
        try:
            await asyncio.gather(*(c.start() for c in self._conns))
            self._routes = self._build_routes()
        except BaseException:
            await self.aclose()
            raise
        self._state = "started"
        return self

    async def end_episode(self, episode_id: str) -> None:
        """Episode ``episode_id`` ended: per-episode server state may be dropped (servers keep
        their state keyed by the episode id they are given; nothing to release here)."""

    async def aclose(self) -> None:
        """Stop every server. Calls made afterwards return an error result."""
        self._state = "closed"
        await asyncio.gather(*(c.close() for c in self._conns), return_exceptions=True)

    async def __aenter__(self) -> Toolbox:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _build_routes(self) -> dict[str, _Connection]:
        routes: dict[str, _Connection] = {}
        for conn in self._conns:
            for tool in conn.tools:
                if tool.name in routes:
                    raise ToolError(f"tool {tool.name!r} is offered by two servers, {routes[tool.name].name!r} "
                                    f"and {conn.name!r}; tool names must be unique across a Toolbox")
                routes[tool.name] = conn
        return routes

    # -- what the model sees --
    @property
    def tools(self) -> list[dict[str, Any]]:
        """OpenAI-format function specs, ready for ``apply_chat_template(..., tools=...)``."""
        self._require_started()
        return [_function_spec(t) for c in self._conns for t in c.tools]

    def names(self) -> list[str]:
        self._require_started()
        return sorted(self._routes)

    def is_stateful(self, name: str) -> bool:
        """Whether tool ``name`` takes a hidden per-episode ``episode_id``."""
        tool = self._tool(name)
        return tool is not None and EPISODE_ID in (tool.input_schema.get("properties") or {})

    @property
    def restarts(self) -> dict[str, int]:
        """Server name -> times its connection was re-established after it dropped."""
        return {c.name: c.restarts for c in self._conns}

    def _require_started(self) -> None:
        if self._state != "started":
            raise ToolError(f"the Toolbox is {self._state}; use `async with mcp_tools(...)` or `await start()` "
                            f"before reading its tools")

    def _tool(self, name: str) -> Any:
        conn = self._routes.get(name)
        return None if conn is None else next((t for t in conn.tools if t.name == name), None)

    # -- calls --
    async def call(self, name: str, arguments: Mapping[str, Any] | None = None, *, episode_id: str | None = None,
                   call_id: str = "") -> ToolResult:
        """Call tool ``name``; always returns a ``ToolResult`` (errors as ``is_error=True``)."""
        start = time.perf_counter()
        try:
            content, is_error = await self._call(name, arguments, episode_id)
        except Exception as exc:  # a bug here must not end the episode; cancellation still propagates
            log.exception("Toolbox.call(%r) failed", name)
            content, is_error = f"tool {name!r} failed: {type(exc).__name__}: {exc}", True
        return ToolResult(name=name, content=content, is_error=is_error,
                          latency_s=time.perf_counter() - start, call_id=call_id)

    async def execute(self, call: ToolCall, *, episode_id: str | None = None) -> ToolResult:
        """Run a parsed ``ToolCall``; a malformed one (``call.error``) gets ``error_result``."""
        if call.error is not None:
            return error_result(call)
        return await self.call(call.name, call.arguments, episode_id=episode_id, call_id=call.id)

    async def _call(self, name: str, arguments: Any, episode_id: str | None) -> tuple[str, bool]:
        if self._state != "started":
            return f"tool {name!r} cannot run: the toolbox is {self._state}", True
        tool = self._tool(name)
        if tool is None:
            return _unknown_tool(name, self.names()), True
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, Mapping):
            return f"arguments for tool {name!r} must be a JSON object, got {type(arguments).__name__}", True
        args = {k: v for k, v in arguments.items() if k != EPISODE_ID or not self.is_stateful(name)}
        problem = _check_arguments(name, _model_schema(tool.input_schema), args)
        if problem:
            return problem, True
        if self.is_stateful(name):
            if episode_id is None:
                return (f"tool {name!r} keeps per-episode state and needs an episode id; the caller must pass "
                        f"Toolbox.call(..., episode_id=...)"), True
            args[EPISODE_ID] = str(episode_id)
        return await self._routes[name].call(name, args)


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


def _function_spec(tool: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": tool.name,
                                             "description": tool.description or tool.title or "",
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
