"""The connection machinery behind ``materl.rollout.mcp.Toolbox``: one ``_Connection`` per
server, whose long-lived owner task enters and exits the SDK client's context managers (their
anyio cancel scopes must be left in the task that entered them), restarts a dropped server, and
lends the live client to calls made from other tasks."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import tempfile
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio

from materl.errors import ToolError

if TYPE_CHECKING:
    from materl.rollout.mcp import MCPServer

log = logging.getLogger("materl.rollout.mcp")

CONNECT_TIMEOUT_S = 60.0
MAX_START_FAILURES = 3


class _Connection:
    """One server: a long-lived owner task holds the SDK client; calls borrow it."""

    def __init__(self, spec: MCPServer, name: str, *, timeout_s: float, max_concurrency: int, restart: bool):
        self.spec, self.name = spec, name
        self.timeout_s, self.max_concurrency, self.restart = timeout_s, max_concurrency, restart
        self.tools: list[Any] = []
        self.restarts = 0
        self._client: Any = None
        self._failure: str | None = None
        self._closing = False
        self._task: asyncio.Task | None = None
        self._up: anyio.Event | None = None  # set while connected, or once given up / closing
        self._lost: anyio.Event | None = None  # set when the connection drops or on close
        self._slots: anyio.Semaphore | None = None
        self._errlog: Any = None

    async def start(self) -> None:
        self._up, self._slots = anyio.Event(), anyio.Semaphore(self.max_concurrency)
        if self.spec.url is None:  # the server's stderr, kept for crash reports (append mode: shared offset)
            self._errlog = tempfile.TemporaryFile("a+", encoding="utf-8", errors="replace", prefix="materl-mcp-")
        self._task = asyncio.get_running_loop().create_task(self._own(), name=f"mcp-server:{self.name}")
        await self._up.wait()
        if self._client is None:
            raise ToolError(f"could not start tool server {self.name!r} ({self.spec.describe()}): {self._failure}"
                            + self._stderr_note())

    async def close(self) -> None:
        self._closing = True
        if self._lost is not None:
            self._on_lost(self._lost)
        if self._up is not None:
            self._up.set()
        if self._task is not None:
            with anyio.move_on_after(15), contextlib.suppress(Exception):
                await asyncio.shield(self._task)
            if not self._task.done():
                self._task.cancel()
        if self._errlog is not None:
            self._errlog.close()

    async def _own(self) -> None:
        from mcp import Client

        ever_up, failures = False, 0
        while not self._closing:
            self._lost = lost = anyio.Event()
            connected, error = False, "the connection closed"
            try:
                async with Client(self._transport(functools.partial(self._on_lost, lost)), cache=None) as client:
                    with anyio.fail_after(CONNECT_TIMEOUT_S):
                        self.tools = await _list_all(client)
                    connected = ever_up = True
                    self._client = client
                    self._up.set()
                    await lost.wait()
            except Exception as exc:  # an ExceptionGroup from the transport's task group, OSError, ...
                error = _describe(exc)
            finally:
                self._on_lost(lost)
            if self._closing:
                break
            failures = 0 if connected else failures + 1
            if not ever_up or not self.restart or failures >= MAX_START_FAILURES:
                why = "restart=False" if ever_up and not self.restart else f"{failures} failed start(s)"
                self._failure = f"{error} ({why})"
                log.warning("tool server %r is down: %s%s", self.name, self._failure, self._stderr_note())
                self._up.set()
                return
            log.warning("tool server %r lost its connection (%s); restarting%s", self.name, error,
                        self._stderr_note())
            self.restarts += connected
            await anyio.sleep(0 if connected else min(0.5 * 2**failures, 5.0))

    def _on_lost(self, lost: anyio.Event) -> None:
        """The connection of generation ``lost`` ended: later calls wait for the next one.
        Runs synchronously in the reader, so no call is sent on a dead connection."""
        if lost is not self._lost:
            return
        lost.set()
        self._client = None
        if self._up.is_set() and not self._closing:
            self._up = anyio.Event()

    def _transport(self, on_lost: Any) -> Any:
        if self.spec.url is not None:
            from mcp.client.streamable_http import streamable_http_client

            return _watch(streamable_http_client(self.spec.url), on_lost)
        from mcp import StdioServerParameters
        from mcp.client.stdio import stdio_client

        argv = self.spec.argv
        params = StdioServerParameters(command=argv[0], args=argv[1:], env=dict(self.spec.env or {}),
                                       cwd=self.spec.cwd)
        return _watch(stdio_client(params, errlog=self._errlog), on_lost)

    async def _connected(self) -> Any:
        while True:
            if self._failure is not None or self._closing:
                return None
            if self._client is not None:
                return self._client
            await self._up.wait()

    async def call(self, name: str, args: dict[str, Any]) -> tuple[str, bool]:
        from mcp.shared.exceptions import MCPError
        from mcp.types import CONNECTION_CLOSED, REQUEST_TIMEOUT

        timed_out = f"tool {name!r} timed out after {self.timeout_s:g} s"
        async with self._slots:
            client = None
            with anyio.move_on_after(CONNECT_TIMEOUT_S):  # a restart in progress is not the tool's time
                client = await self._connected()
            if client is None:
                why = self._failure or ("the toolbox is closing" if self._closing
                                        else f"it did not come back within {CONNECT_TIMEOUT_S:g} s")
                return f"tool {name!r} is unavailable: its server {self.name!r} is down ({why})", True
            with anyio.move_on_after(self.timeout_s):
                try:
                    result = await client.call_tool(name, args, read_timeout_seconds=self.timeout_s)
                except MCPError as exc:
                    if exc.code == REQUEST_TIMEOUT:
                        return timed_out, True
                    if exc.code == CONNECTION_CLOSED:
                        then = "it is being restarted" if self.restart else "restart=False, so it stays down"
                        return (f"tool {name!r} failed: its server {self.name!r} crashed or dropped the connection "
                                f"during the call; {then}"), True
                    return f"tool {name!r} failed: {exc.message}", True
                except Exception as exc:  # an invalid result, a transport error, ...
                    return f"tool {name!r} failed: {_describe(exc)}", True
                return _result_text(result), bool(result.is_error)
        return timed_out, True

    def _stderr_note(self) -> str:
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


def _result_text(result: Any) -> str:
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
