"""One live MCP server connection (a stdio process, or an HTTP session): ``_Instance``.

An instance is started once and never revived: when it dies (the process exits, the pipe or
HTTP transport fails, or the supervisor kills it) its ``dead`` event is set, every call in
flight on it returns at once with ``Answer(died=True)``, and the supervisor
(``materl.rollout._mcp_server``) replaces it with a new instance. A long-lived owner task
enters and exits the SDK client's context managers (their anyio cancel scopes must be left in
the task that entered them); calls are plain requests on the client from the callers' tasks.

Each call's answer is classified here (``Answer.kind``): ``None`` (a result), ``"tool"`` (an
MCP ``isError`` result or a JSON-RPC error answer), ``"timeout"``, ``"protocol"`` (an answer
that is not a valid MCP result, e.g. garbage on the wire), or ``died=True`` (the supervisor
turns that into a retry or a ``"crash"``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio

from materl.errors import ToolError

if TYPE_CHECKING:
    from materl.rollout.mcp_spec import MCPServer

START_TIMEOUT_S = 60.0  # MCPServer.start_timeout_s: one start (connect and list tools)
# How long one call waits for an HTTP server that went away to answer again (MCPServer.reconnect_s).
RECONNECT_S = 10.0

log = logging.getLogger("materl.rollout.mcp")


class Answer(NamedTuple):
    """What one attempt of a call produced (text the model sees, and why it failed, if it did)."""

    text: str
    kind: str | None = None  # None, "tool", "timeout", "protocol" (see the module docstring)
    died: bool = False  # the connection died under the call
    attempts: int = 1
    server_s: float = 0.0  # time spent on a live server (its attempts), not waiting for one


class _DropSDKParseNoise(logging.Filter):
    """The SDK logs a full traceback for every unparseable line a server prints; an instance
    counts those lines and reports them once instead (``_Instance.garbage``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("Failed to parse JSONRPC message", "Error parsing JSON response"))


logging.getLogger("mcp.client.stdio").addFilter(_DropSDKParseNoise())
logging.getLogger("mcp.client.streamable_http").addFilter(_DropSDKParseNoise())


class _Instance:
    """One connection to a server; see the module docstring."""

    def __init__(self, spec: MCPServer, name: str, *, on_death: Any = None, episode_dir: str | None = None):
        self.spec, self.name = spec, name
        self.episode_dir = episode_dir  # this instance's own working directory, removed by close()
        self.tools: list[Any] = []
        self.dead = anyio.Event()
        self.death_reason = ""
        self.in_flight = 0
        self.answered = 0  # calls that got an answer (of any kind) from this instance
        self.consecutive_timeouts = 0
        self.garbage = 0  # unparseable messages the server sent
        self.killed = False  # stopped by kill() rather than dying on its own
        self.closing: asyncio.Future | None = None  # set when a failed start is being stopped
        self._on_death = on_death
        self._client: Any = None
        self._stop = anyio.Event()
        self._up = anyio.Event()
        self._failure = ""
        self._task: asyncio.Task | None = None
        self._abandoned: set[asyncio.Future] = set()
        self._errlog: Any = None

    def __repr__(self) -> str:
        state = "dead" if self.dead.is_set() else "up" if self._client is not None else "starting"
        return f"<instance {self.name} {state}>"

    @property
    def alive(self) -> bool:
        return self._client is not None and not self.dead.is_set()

    # -- lifecycle --
    async def start(self, timeout_s: float = START_TIMEOUT_S) -> _Instance:
        """Connect and list the tools; raises ``ToolError`` (with the server's stderr) on failure."""
        if self.spec.url is None:  # the server's stderr, kept for crash reports (append mode: shared offset)
            self._errlog = tempfile.TemporaryFile("a+", encoding="utf-8", errors="replace", prefix="materl-mcp-")
        self._task = asyncio.get_running_loop().create_task(self._own(timeout_s), name=f"mcp:{self.name}")
        try:
            with anyio.move_on_after(timeout_s):  # the handshake too (a frozen server never answers it)
                await self._up.wait()
        except BaseException:  # cancelled while starting: stop the half-started server too
            self.kill("cancelled while starting")
            self._task.cancel()
            raise
        if not self._up.is_set():
            self._failure = f"it did not complete the MCP handshake within {timeout_s:g} s"
        if self._client is None:
            error = ToolError(f"could not start tool server {self.name!r} ({self.spec.describe()}): {self._failure}"
                              + self.stderr_note())
            # stopped in the background (a server stuck in its handshake can take seconds to go);
            # whoever started it awaits ``closing`` before it closes
            self.closing = asyncio.ensure_future(self.close())
            raise error
        return self

    def kill(self, reason: str) -> None:
        """Declare the instance dead now (calls in flight return ``died``) and stop it in the
        background."""
        if not self.dead.is_set():
            self.killed = True
        self._mark_dead(reason)
        self._stop.set()

    async def close(self) -> None:
        """Stop the server and wait (bounded) until its process is gone."""
        self.kill(self.death_reason or "closed")
        if self._task is not None and not self._up.is_set():
            self._task.cancel()  # still connecting: the SDK's shielded shutdown stops the process
        try:
            if self._task is not None:
                # asyncio.wait: neither the task's own end (a cancelled start raises CancelledError)
                # nor our caller's cancellation leaks into or out of the owner task
                await asyncio.wait({self._task}, timeout=15)
                if not self._task.done():
                    self._task.cancel()
        finally:
            if self._errlog is not None:
                self._errlog.close()
            if self.episode_dir is not None:
                shutil.rmtree(self.episode_dir, ignore_errors=True)  # the process is gone: its state goes too

    async def _own(self, timeout_s: float) -> None:
        from mcp import Client

        try:
            transport = _watch(self._transport(), lambda: self._mark_dead("the server closed the connection"))
            async with Client(transport, cache=None, message_handler=self._on_message) as client:
                with anyio.fail_after(timeout_s):
                    self.tools = await _list_all(client)
                self._client = client
                self._up.set()
                await self._stop.wait()
        except Exception as exc:  # an ExceptionGroup from the transport's task group, OSError, timeout...
            self._failure = _describe(exc) if not isinstance(exc, TimeoutError) else \
                f"it did not list its tools within {timeout_s:g} s"
            self._mark_dead(f"the connection failed: {self._failure}")
        finally:
            self._mark_dead(self.death_reason or "the connection closed")
            self._client = None
            self._up.set()

    def _mark_dead(self, reason: str) -> None:
        if self.dead.is_set():
            return
        self.death_reason = reason
        self.dead.set()
        if self._on_death is not None and self._client is not None:
            self._on_death(self)

    async def _on_message(self, message: Any) -> None:
        if isinstance(message, Exception):
            self.garbage += 1
            if self.garbage == 1:
                log.warning("tool server %r sent a message that is not valid JSON-RPC: %s", self.name,
                            _describe(message)[:200])

    def _transport(self) -> Any:
        if self.spec.url is not None:
            from mcp.client.streamable_http import streamable_http_client

            return streamable_http_client(self.spec.url)
        from mcp import StdioServerParameters
        from mcp.client.stdio import stdio_client

        argv, env, cwd = self.spec.launch(self.episode_dir)
        params = StdioServerParameters(command=argv[0], args=argv[1:], env=env, cwd=cwd,
                                       encoding_error_handler="replace")
        return stdio_client(params, errlog=self._errlog)

    # -- calls --
    async def request(self, tool: str, args: dict[str, Any], timeout_s: float) -> Answer:
        """One attempt: send ``tools/call`` and wait at most ``timeout_s`` for its answer, or for
        this instance to die (then ``died=True`` at once)."""
        from mcp.shared.exceptions import MCPError
        from mcp.types import (
            CONNECTION_CLOSED,
            INVALID_REQUEST,
            PARSE_ERROR,
            REQUEST_TIMEOUT,
        )

        client = self._client
        if client is None or self.dead.is_set():
            return Answer(f"its server {self.name!r} is not running", died=True)
        self.in_flight += 1
        # The SDK's request runs in a task of its own that is abandoned (cancelled, not awaited)
        # at the deadline or when the instance dies: its clean-up (a courtesy cancel written to
        # a transport that may be stuck, up to 5 s) must not hold the caller past its timeout.
        # So the deadline is ours, not the SDK's read timeout.
        sent = asyncio.ensure_future(client.call_tool(tool, args))
        self._abandoned.add(sent)
        sent.add_done_callback(_forget(self._abandoned))
        death = asyncio.ensure_future(self.dead.wait())
        try:
            await asyncio.wait({sent, death}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.in_flight -= 1
            death.cancel()
            if not sent.done():
                sent.cancel()
        outcome = [sent.exception() or sent.result()] if sent.done() and not sent.cancelled() else []
        if not outcome:
            if self.dead.is_set():
                return Answer(self.death_reason, died=True)
            return self._timed_out(tool, timeout_s)
        result = outcome[0]
        if isinstance(result, MCPError):
            if result.code == REQUEST_TIMEOUT:
                return self._timed_out(tool, timeout_s)
            if result.code == CONNECTION_CLOSED and result.message == "Connection closed":
                # the SDK saw the end before our watcher did (servers may use the same code, -32000,
                # for their own errors: the SDK's message tells them apart)
                self._mark_dead("the server closed the connection")
                return Answer(self.death_reason, died=True)
            self._answered()
            kind = "protocol" if result.code in (PARSE_ERROR, INVALID_REQUEST) else "tool"
            return Answer(f"tool {tool!r} failed: {result.message}", kind)
        if isinstance(result, Exception):
            if self.dead.is_set():
                return Answer(self.death_reason, died=True)
            self._answered()  # e.g. a result that does not validate as CallToolResult
            return Answer(f"tool {tool!r} failed: its server sent an invalid answer ({_describe(result)[:300]})",
                          "protocol")
        self._answered()
        return Answer(result_text(result), "tool" if result.is_error else None)

    def _answered(self) -> None:
        self.answered += 1
        self.consecutive_timeouts = 0

    def _timed_out(self, tool: str, timeout_s: float) -> Answer:
        self.consecutive_timeouts += 1
        return Answer(f"tool {tool!r} timed out after {timeout_s:g} s", "timeout")

    def stderr_note(self) -> str:
        if self._errlog is None or self._errlog.closed:
            return ""
        try:
            self._errlog.flush()
            size = self._errlog.seek(0, os.SEEK_END)
            self._errlog.seek(max(0, size - 1500))
            tail = self._errlog.read().strip()
        except (OSError, ValueError):
            return ""
        return f"; server stderr ends with:\n{tail}" if tail else ""


def _forget(pending: set) -> Any:
    """A done-callback that drops a finished abandoned request and retrieves its exception."""

    def done(fut: asyncio.Future) -> None:
        pending.discard(fut)
        if not fut.cancelled():
            fut.exception()

    return done


# -- transport watch: know at once when a server's output ends --
@asynccontextmanager
async def _watch(transport: Any, on_lost: Any):
    async with transport as (read_stream, write_stream):
        yield _LossWatcher(read_stream, on_lost), write_stream


class _LossWatcher:
    """A read stream that calls ``on_lost()`` when the server's messages end (EOF or closed)."""

    def __init__(self, inner: Any, on_lost: Any):
        self._inner, self._on_lost = inner, on_lost

    async def receive(self) -> Any:
        try:
            return await self._inner.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._on_lost()
            raise

    def __aiter__(self) -> _LossWatcher:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> _LossWatcher:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __getattr__(self, name: str) -> Any:  # e.g. ``last_context`` of the SDK's context streams
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)


async def _list_all(client: Any) -> list[Any]:
    tools, cursor = [], None
    for _ in range(100):
        page = await client.list_tools(cursor=cursor)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            break
    return tools


def result_text(result: Any) -> str:
    """The text the model sees: text blocks joined, other blocks as short placeholders."""
    parts: list[str] = []
    for block in result.content:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind in ("image", "audio"):
            parts.append(f"[{kind} {block.mime_type}]")
        elif kind == "resource_link":
            parts.append(f"[resource {block.uri}]")
        elif kind == "resource":
            parts.append(getattr(block.resource, "text", None) or f"[resource {block.resource.uri}]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content))
    text = "\n".join(parts)
    if "errors.pydantic.dev" in text:  # validation errors end each item with a docs link; drop it
        text = "\n".join(line for line in text.splitlines() if "errors.pydantic.dev" not in line)
    return text


def _describe(exc: BaseException) -> str:
    """One line for an exception; an ExceptionGroup is described by its first leaf."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__

