"""Supervision of one MCP server: restarts, retries, per-episode instances.

- ``_Pool``: pre-started instances of a server (``_mcp_connection._Instance``), refilled in the
  background, so handing one out costs no start-up time.
- ``_Supervised``: one logical server handle (the shared server, or one episode's own
  instance): a concurrency limit, the live instance, and the recovery rules below.
- ``_MCPBackend``: what the Toolbox routes calls to: one ``_Supervised`` for
  ``isolation="shared"``, one per episode id for ``isolation="episode"`` (closed by
  ``end_episode``).

Recovery rules (``_Supervised.call``):

1. A call's ``timeout_s`` bounds the time it spends on a live server, its retry included; the
   wait for a free slot and for a (re)starting server is not counted (the latter is bounded by
   ``start_timeout_s``).
2. When the server dies under a call (the process exits, the pipe or HTTP transport fails, or
   it is killed by rule 3), a call in flight on it is retried once on the new instance with the
   rest of its time when running it again is safe (``may_retry``): with
   ``retry_on_crash="idempotent"`` (the default) when its tool declares itself read-only or
   idempotent (MCP tool annotations ``readOnlyHint`` / ``idempotentHint``), with ``True``
   always, with ``False`` never; never with ``restart=False``. A call that is not retried
   fails with kind ``"crash"``, saying why. Whether the server had started a call when it died
   cannot be known from outside (a request written to a pipe may or may not have been read),
   so only the tool can say that running it twice is harmless, which is what MCP's annotations
   are for. Retries run one at a time (beside new calls), so the call that caused the crash
   crashes its retry alone: it fails with kind ``"crash"`` after at most two restarts. (Two
   different calls that each crash the server while both are in flight can still fail a third
   call whose retry overlaps the second crash; ``isolation="episode"`` confines crashes to one
   episode. Running retries alone, or a third attempt for a retry that died beside other calls,
   were tried: on a shared server that 10% of calls crash they serialise it past 4x the
   critical path, benchmarks/RESULTS.md ``## crash_retries``.)
3. ``restart_after_timeouts`` calls in a row that time out on one instance (no answer of any
   kind in between) kill it; it is replaced like a crashed one (a server that hangs without
   closing its pipe is restarted instead of failing every later call).
4. A server that dies under calls is replaced at once (rule 2 bounds what a bad call costs:
   two restarts). A server that dies on its own, with no call in flight, is replaced at once
   the first time and then after an exponential backoff (0.5 s doubling to 8 s) while it keeps
   dying that way; an answered call resets the count. A replacement that fails to start is
   retried with the same backoff; ``max_start_failures`` failed starts in a row mark a stdio
   server down (calls get ``"unavailable"``) until the Toolbox is restarted.
5. An HTTP server that goes away (someone else runs it) is never marked down: the handle
   reconnects with backoff (0.5 s doubling to 2 s) for as long as the run lasts; meanwhile each
   call waits at most ``reconnect_s`` for it and then fails as ``"unavailable"``; the first
   call after it answers again uses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from materl.errors import ToolError
from materl.rollout._mcp_connection import RECONNECT_S, Answer, _Instance

if TYPE_CHECKING:
    from materl.rollout.mcp_spec import MCPServer

log = logging.getLogger("materl.rollout.mcp")


def retry_safe(tool: Any) -> bool:
    """Whether an MCP tool declares that running it again is harmless: annotations
    ``readOnlyHint`` or ``idempotentHint`` true (both default to false in MCP)."""
    notes = getattr(tool, "annotations", None)
    if notes is None:
        return False
    hints = (getattr(notes, name, None) for name in ("read_only_hint", "readOnlyHint", "idempotent_hint",
                                                      "idempotentHint"))
    return any(h is True for h in hints)


@dataclass(frozen=True)
class ServerPolicy:
    """The resolved settings of one server (``MCPServer`` fields over ``mcp_tools`` defaults)."""

    timeout_s: float | None  # None: the caller's default (the compiled step's tool_timeout_s)
    max_concurrency: int
    restart: bool
    retry_on_crash: bool | str  # True, False or "idempotent" (mcp_spec.RETRY_ON_CRASH)
    restart_after_timeouts: int  # 0: never restart for timeouts
    isolation: str  # "shared" | "episode"
    pool_size: int  # instances kept started and unused (a shared server's ready replacement, or new episodes')
    start_timeout_s: float = 60.0
    reconnect_s: float = RECONNECT_S  # HTTP: how long one call waits for the server to answer again
    workdir: str | None = None  # where isolated instances' own folders go (None: the system's temp dir)
    max_start_failures: int = 3  # stdio only: an HTTP server is never given up on
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    max_reconnect_backoff_s: float = 2.0  # HTTP: a server that is back is used within this time

    def crash_delay(self, idle_deaths_in_a_row: int) -> float:
        """Rule 4: no delay for the first death with no call in flight, then exponential backoff."""
        if idle_deaths_in_a_row <= 1:
            return 0.0
        return min(self.backoff_s * 2 ** (idle_deaths_in_a_row - 2), self.max_backoff_s)


class _Pool:
    """Ready instances of one server; ``get()`` hands one out and starts its replacement."""

    def __init__(self, spec: MCPServer, name: str, policy: ServerPolicy, stats: Counter):
        self.spec, self.name, self.policy, self.stats = spec, name, policy, stats
        self._idle: list[_Instance] = []
        self._filling: set[asyncio.Task] = set()
        self._starting: set[_Instance] = set()  # being started (closed with the pool)
        self._stopping: set[asyncio.Future] = set()  # failed starts being stopped
        self._count = 0
        self._closed = False

    async def get(self) -> _Instance:
        """A live, unused instance: an idle one, else one started now (``ToolError`` if it cannot start)."""
        while self._idle:
            inst = self._idle.pop(0)
            if inst.alive:
                self.refill()
                return inst
            await inst.close()
        inst = await self._start()
        self.refill()
        return inst

    async def first(self) -> _Instance:
        """The first instance (it lists the tools), started without filling the pool."""
        return await self._start()

    async def discard_idle(self) -> None:
        """Drop the idle instances (an HTTP server's idle sessions died with the server)."""
        idle, self._idle = self._idle, []
        await asyncio.gather(*(i.close() for i in idle), return_exceptions=True)

    def put(self, inst: _Instance) -> None:
        """Return an instance no call has used (its server holds no state yet)."""
        self._idle.append(inst)

    def refill(self) -> None:
        """Start instances in the background until ``pool_size`` are idle or starting."""
        while not self._closed and len(self._idle) + len(self._filling) < self.policy.pool_size:
            task = asyncio.get_running_loop().create_task(self._fill_one(), name=f"mcp-pool:{self.name}")
            self._filling.add(task)
            task.add_done_callback(self._filling.discard)

    async def _fill_one(self) -> None:
        try:
            inst = await self._start()
        except ToolError as exc:  # the next get() starts one itself and reports the error
            log.warning("tool server pool %r: %s", self.name, exc)
            return
        if self._closed:
            await inst.close()
        else:
            self._idle.append(inst)

    async def _start(self) -> _Instance:
        self._count += 1
        self.stats["starts"] += 1
        name = self.name if self.policy.isolation == "shared" and self._count == 1 else f"{self.name}#{self._count}"
        episode_dir = None
        if self.policy.isolation == "episode" and self.spec.url is None:  # its own working directory
            safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
            episode_dir = tempfile.mkdtemp(prefix=f"materl-{safe}-", dir=self.policy.workdir)
        inst = _Instance(self.spec, name, episode_dir=episode_dir)
        self._starting.add(inst)
        try:
            return await inst.start(self.policy.start_timeout_s)
        except ToolError:
            self.stats["start_failures"] += 1
            if inst.closing is not None:
                self._stopping.add(inst.closing)
                inst.closing.add_done_callback(self._stopping.discard)
            raise
        finally:
            self._starting.discard(inst)

    async def close(self) -> None:
        self._closed = True
        for task in list(self._filling):
            task.cancel()
        idle, self._idle = self._idle, []
        await asyncio.gather(*(i.close() for i in [*idle, *self._starting]), *self._filling, *self._stopping,
                             return_exceptions=True)


class _Supervised:
    """One logical server handle; see the recovery rules in the module docstring."""

    def __init__(self, pool: _Pool, name: str, stats: Counter, first: _Instance | None = None, *,
                 retry_safe_tools: frozenset[str] = frozenset()):
        self.pool, self.name, self.stats = pool, name, stats
        self.policy = pool.policy
        self.retry_safe_tools = retry_safe_tools  # tools that declare running again harmless
        self.slots = anyio.Semaphore(self.policy.max_concurrency)
        self._suspects = anyio.Lock()  # retries run one at a time (rule 2)
        self.current: _Instance | None = None
        self.down: str | None = None
        self.closing = False
        self.idle_deaths_in_a_row = 0
        self._adopted = 0
        self._ready = anyio.Event()
        self._replacing: asyncio.Task | None = None
        self._stopping: list[_Instance] = []
        if first is not None:
            self._adopt(first)

    def may_retry(self, tool: str) -> bool:
        """Rule 2: whether a call of ``tool`` that its server died under may run again."""
        how = self.policy.retry_on_crash
        return how is True or (how == "idempotent" and tool in self.retry_safe_tools)

    async def call(self, tool: str, args: dict[str, Any], timeout_s: float) -> Answer:
        async with self.slots:
            answer, budget = await self._attempt(tool, args, timeout_s, 1)
            if not answer.died:
                return answer._replace(server_s=timeout_s - budget)
            if budget > 0 and self.may_retry(tool) and self.policy.restart and not self.closing:
                self.stats["retries"] += 1
                answer, budget = await self._retry(tool, args, budget)
                if not answer.died:
                    return answer._replace(server_s=timeout_s - budget)
            used = timeout_s - budget
            if budget <= 0:  # its time ran out as the server died (e.g. killed after timeouts)
                return Answer(f"tool {tool!r} timed out after {timeout_s:g} s (its server {self.name!r} died "
                              f"meanwhile: {answer.text})", "timeout", attempts=answer.attempts, server_s=used)
            return Answer(self._crashed(tool, answer.text, answer.attempts), "crash", attempts=answer.attempts,
                          server_s=used)

    async def _retry(self, tool: str, args: dict[str, Any], budget: float) -> tuple[Answer, float]:
        """Rule 2: retried calls are sent one at a time. Waiting for the server to be back is not
        serialised: calls in flight when an HTTP server went away each wait at most
        ``reconnect_s`` side by side, not one after another."""
        if await self._live() is None:
            return Answer(self._unavailable(tool), "unavailable", attempts=2), budget
        async with self._suspects:
            return await self._attempt(tool, args, budget, 2)

    async def _attempt(self, tool: str, args: dict[str, Any], budget: float, attempt: int) -> tuple[Answer, float]:
        """One send on the live instance; returns the answer and the time left of the budget."""
        inst = await self._live()
        if inst is None:
            return Answer(self._unavailable(tool), "unavailable", attempts=attempt), budget
        started = time.monotonic()
        answer = await inst.request(tool, args, budget)
        budget -= time.monotonic() - started
        if answer.kind == "timeout":
            self.stats["timeouts"] += 1
            self._after_timeout(inst)
        elif not answer.died:
            self.idle_deaths_in_a_row = 0
        return answer._replace(attempts=attempt), budget

    def _crashed(self, tool: str, reason: str, attempts: int) -> str:
        if attempts > 1:
            why = "it died again on the retry after a restart"
        elif not self.policy.restart:
            why = "restart=False, so it stays down"
        elif self.policy.retry_on_crash is False:
            why = "not retried (retry_on_crash=False); the server is being restarted"
        elif not self.may_retry(tool):
            why = (f"not retried: {tool!r} does not declare itself read-only or idempotent (MCP annotations "
                   f"readOnlyHint / idempotentHint), so it may have run before the crash and must not run twice "
                   f"(retry_on_crash='idempotent'); the server is being restarted")
        else:
            why = "the toolbox is closing"
        return f"tool {tool!r} failed: its server {self.name!r} crashed during the call ({reason}); {why}"

    def _unavailable(self, tool: str) -> str:
        if self.down or self.closing:
            why = self.down or "the toolbox is closing"
        elif self.pool.spec.url is not None:
            why = f"it did not answer within {self.policy.reconnect_s:g} s; reconnecting continues"
        else:
            why = f"it did not come back within {self.policy.start_timeout_s:g} s"
        return f"tool {tool!r} is unavailable: its server {self.name!r} is down ({why})"

    def _after_timeout(self, inst: _Instance) -> None:
        n = self.policy.restart_after_timeouts
        if n and inst is self.current and inst.consecutive_timeouts >= n and self.policy.restart:
            self.stats["timeout_restarts"] += 1
            log.warning("tool server %r: %d calls in a row timed out; restarting it", self.name, n)
            inst.kill(f"it was restarted after {n} calls in a row timed out")

    # -- the live instance --
    def _adopt(self, inst: _Instance) -> None:
        inst._on_death = self._lost
        self.current = inst
        self._adopted += 1
        self._ready.set()

    def _lost(self, inst: _Instance) -> None:
        """An instance died (its own owner task calls this, synchronously)."""
        if inst is not self.current:
            return
        self.current = None
        self._stopping.append(inst)
        if self.closing:
            return
        if not inst.killed:  # a kill for timeouts is counted as a timeout restart (rule 3)
            self.stats["crashes"] += 1
            self.idle_deaths_in_a_row = 0 if inst.in_flight else self.idle_deaths_in_a_row + 1
        if not self.policy.restart:
            self.down = f"{inst.death_reason} (restart=False)"
            return
        self._start_replacement()

    def _start_replacement(self) -> None:
        if self._replacing is None and not self.closing and self.down is None:
            self._ready = anyio.Event()
            self._replacing = asyncio.get_running_loop().create_task(self._replace(), name=f"mcp-restart:{self.name}")

    async def _replace(self) -> None:
        delay, failures = self.policy.crash_delay(self.idle_deaths_in_a_row), 0
        http = self.pool.spec.url is not None
        if http and self._adopted:  # idle sessions of a server that just died
            await self.pool.discard_idle()
        try:
            while not self.closing:
                if delay:  # a long HTTP outage: one warning, then quiet retries
                    log.log(logging.DEBUG if http and failures > 1 else logging.WARNING, "tool server %r: %s in %.1f s",
                            self.name, "reconnecting" if http else "restarting", delay)
                    await anyio.sleep(delay)
                try:
                    inst = await self.pool.get()
                except ToolError as exc:
                    failures += 1
                    if not http and failures >= self.policy.max_start_failures:
                        self.down = f"{exc} ({failures} failed starts in a row)"
                        log.warning("tool server %r is down: %s", self.name, self.down)
                        return
                    delay = self._retry_delay(failures)
                    continue
                if self.closing:
                    await inst.close()
                    return
                self.stats["restarts"] += self._adopted > 0
                self._adopt(inst)
                return
        finally:
            self._replacing = None
            self._ready.set()

    def _retry_delay(self, failures: int) -> float:
        """Backoff after ``failures`` failed starts: 0.5 s doubling to 8 s for a stdio server;
        to 2 s for an HTTP server, which is retried for as long as the run lasts (someone else
        restarts it, and it is used again as soon as it answers)."""
        cap = self.policy.max_backoff_s if self.pool.spec.url is None else self.policy.max_reconnect_backoff_s
        return min(self.policy.backoff_s * 2 ** (failures - 1), cap)

    async def _live(self) -> _Instance | None:
        wait = self.policy.reconnect_s if self.pool.spec.url is not None else \
            self.policy.start_timeout_s + self.policy.max_backoff_s
        deadline = time.monotonic() + wait
        while not self.closing and self.down is None:
            inst = self.current
            if inst is not None and inst.alive:
                return inst
            if inst is not None:  # died while idle; its owner task is about to report it
                self._lost(inst)
            if self.current is None:
                self._start_replacement()
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            with anyio.move_on_after(left):
                await self._ready.wait()
        return None

    async def close(self) -> None:
        """Stop this handle's instance (and any replacement being started)."""
        self.closing = True
        if self._replacing is not None:
            self._replacing.cancel()
            with contextlib.suppress(BaseException):
                await self._replacing
        inst, self.current = self.current, None
        self._ready.set()
        await asyncio.gather(*(i.close() for i in [inst, *self._stopping] if i is not None), return_exceptions=True)


class _MCPBackend:
    """One MCP server behind the Toolbox: a shared handle, or one handle per episode."""

    def __init__(self, spec: MCPServer, name: str, policy: ServerPolicy):
        self.spec, self.name, self.policy = spec, name, policy
        self.timeout_s = policy.timeout_s
        self.stats: Counter = Counter()
        self.tools: list[Any] = []
        self.retry_safe_tools: frozenset[str] = frozenset()
        self.pool = _Pool(spec, name, policy, self.stats)
        self.shared: _Supervised | None = None
        self.episodes: dict[str, _Supervised] = {}
        self._ending: set[asyncio.Task] = set()

    async def start(self) -> None:
        first = await self.pool.first()
        try:
            check_input_schemas(self.name, first.tools)
        except ToolError:
            await first.close()
            raise
        self.tools = first.tools
        self.retry_safe_tools = frozenset(t.name for t in first.tools if retry_safe(t))
        if self.policy.isolation == "shared":
            self.shared = _Supervised(self.pool, self.name, self.stats, first, retry_safe_tools=self.retry_safe_tools)
        else:  # unused so far: the first episode gets it
            self.pool.put(first)
        self.pool.refill()

    async def call(self, tool: str, args: dict[str, Any], *, episode_id: str | None, timeout_s: float) -> Answer:
        handle = self.shared
        if handle is None:
            if episode_id is None:
                return Answer(f"tool {tool!r} runs one server instance per episode (isolation='episode') and "
                              f"needs an episode id; the caller must pass Toolbox.call(..., episode_id=...)",
                              "invalid_call")
            handle = self.episodes.get(episode_id)
            if handle is None:
                handle = self.episodes[episode_id] = _Supervised(self.pool, f"{self.name}[{episode_id}]", self.stats,
                                                                 retry_safe_tools=self.retry_safe_tools)
        return await handle.call(tool, args, timeout_s)

    def end_episode(self, episode_id: str) -> None:
        """Stop the episode's instance in the background (its state is never reused)."""
        handle = self.episodes.pop(episode_id, None)
        if handle is not None:
            task = asyncio.get_running_loop().create_task(handle.close(), name=f"mcp-end:{handle.name}")
            self._ending.add(task)
            task.add_done_callback(self._ending.discard)

    @property
    def restarts(self) -> int:
        return self.stats["restarts"]

    async def close(self) -> None:
        handles = ([self.shared] if self.shared else []) + list(self.episodes.values())
        self.episodes.clear()
        await asyncio.gather(*(h.close() for h in handles), *list(self._ending), self.pool.close(),
                             return_exceptions=True)


def check_input_schemas(server: str, tools: list[Any]) -> None:
    """Each tool's input schema must be a valid JSON Schema (2020-12, the version MCP names)
    describing an object; else ``ToolError`` naming the server, the tool and what is wrong."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    for tool in tools:
        schema = tool.input_schema
        problem = None
        try:
            Draft202012Validator.check_schema(schema)
        except SchemaError as exc:
            where = "/".join(str(p) for p in exc.absolute_path) or "(top level)"
            problem = f"{exc.message} (at {where})"
        if problem is None and schema.get("type", "object") != "object":
            problem = f"its type is {schema.get('type')!r}; MCP tool arguments are an object"
        if problem is None and not isinstance(schema.get("properties", {}), dict):
            problem = "'properties' is not an object"
        if problem is not None:
            raise ToolError(f"tool server {server!r}: tool {tool.name!r} has an invalid input schema: {problem}")
