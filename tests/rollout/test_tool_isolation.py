"""Per-episode tool state: one server instance per episode (from a pre-started pool, stopped when
the episode ends), tool-name prefixes, and in-process Python tools built per episode. Real
server processes; the state under test is the server's own (rows inserted, then summed)."""

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import pytest

from materl.errors import ConfigError, ToolError
from materl.rollout.mcp import MCPServer, PythonTools, mcp_tools

ROOT = Path(__file__).resolve().parents[2]
FAULTY = [sys.executable, str(ROOT / "tests/tools/faulty_server.py")]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def wait_until(predicate, what: str, limit_s: float = 20.0) -> None:
    """Poll a condition (a liveness wait, not a timing assertion)."""
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {limit_s} s")
        await asyncio.sleep(0.05)


async def insert_then_total(tb, episodes=("ep-a", "ep-b", "ep-a")):
    values = {"ep-a": 1, "ep-b": 10}
    for i, ep in enumerate(episodes):
        await tb.call("insert", {"value": values[ep] * (i + 1)}, episode_id=ep)
    return {ep: json.loads((await tb.call("total", {}, episode_id=ep)).content) for ep in sorted(set(episodes))}


async def test_shared_server_state_leaks_across_episodes():
    async with mcp_tools(FAULTY) as tb:  # the finding, kept as the reason for isolation="episode"
        totals = await insert_then_total(tb)
    assert totals == {"ep-a": {"rows": 3, "sum": 1 + 20 + 3}, "ep-b": {"rows": 3, "sum": 24}}


async def test_episode_isolation_gives_each_episode_its_own_server():
    async with mcp_tools(FAULTY, isolation="episode", pool_size=2) as tb:
        totals = await insert_then_total(tb)
        pids = {ep: int((await tb.call("pid", {}, episode_id=ep)).content) for ep in ("ep-a", "ep-b")}
    # ep-a inserted 1 then 3; ep-b inserted 20
    assert totals == {"ep-a": {"rows": 2, "sum": 4}, "ep-b": {"rows": 1, "sum": 20}}
    assert pids["ep-a"] != pids["ep-b"]


async def test_end_episode_stops_its_instance_and_a_reused_id_starts_fresh():
    async with mcp_tools(FAULTY, isolation="episode", pool_size=1) as tb:
        await tb.call("insert", {"value": 5}, episode_id="ep-1")
        pid = int((await tb.call("pid", {}, episode_id="ep-1")).content)
        await tb.end_episode("ep-1")
        await wait_until(lambda: not alive(pid), f"server process {pid} exiting after end_episode")
        again = json.loads((await tb.call("total", {}, episode_id="ep-1")).content)
    assert again == {"rows": 0, "sum": 0}


async def test_the_pool_prestarts_instances_and_refills():
    async with mcp_tools(FAULTY, isolation="episode", pool_size=3) as tb:
        stats = tb.stats["faulty_server"]
        await wait_until(lambda: tb.stats["faulty_server"]["starts"] == 3, "the pool filling to 3 instances")
        backend = tb._backends[0]
        ready = {i.name for i in backend.pool._idle}
        await tb.call("echo", {"text": "x"}, episode_id="e1")
        # the episode got a pre-started instance; the pool started its replacement
        assert backend.episodes["e1"].current.name in ready
        await wait_until(lambda: tb.stats["faulty_server"]["starts"] == 4, "the pool refilling")
    assert stats["starts"] == 3


async def test_episode_isolation_needs_an_episode_id():
    async with mcp_tools(FAULTY, isolation="episode", pool_size=0) as tb:
        result = await tb.call("echo", {"text": "x"})
    assert result.error_kind == "invalid_call" and "needs an episode id" in result.content


async def test_a_crash_in_one_episode_does_not_touch_another():
    async with mcp_tools(FAULTY, isolation="episode", pool_size=2) as tb:
        await tb.call("insert", {"value": 7}, episode_id="calm")
        crash, slow = await asyncio.gather(tb.call("crash", {}, episode_id="wild"),
                                           tb.call("slow", {"seconds": 0.5}, episode_id="calm"))
        calm = json.loads((await tb.call("total", {}, episode_id="calm")).content)
    assert crash.error_kind == "crash" and (slow.is_error, slow.attempts) == (False, 1)
    assert calm == {"rows": 1, "sum": 7}  # its server never restarted, its state is intact


async def test_prefixes_name_each_servers_tools():
    async with mcp_tools({"db": FAULTY, "calc": "python -m materl.tools.calculator"}) as tb:
        names = tb.names()
        result = await tb.call("calc.calculate", {"expression": "6*7"})
        echo = await tb.call("db.echo", {"text": "hi"})
        specs = {t["function"]["name"] for t in tb.tools}
    assert "calc.calculate" in names and "db.echo" in names and "calculate" not in names
    assert specs == set(names)
    assert (result.content, echo.content) == ("42", "hi")


async def test_two_servers_with_the_same_tool_names_need_prefixes():
    with pytest.raises(ToolError, match="tool 'work' is offered by two servers, 'faulty_server' and 'faulty_server-2'; give one a prefix"):
        await mcp_tools(FAULTY, FAULTY).start()
    with pytest.raises(ConfigError, match="prefix must be a non-empty string"):
        mcp_tools({"": FAULTY})
    with pytest.raises(ConfigError, match="isolation='per-call'; accepted: shared, episode"):
        mcp_tools(FAULTY, isolation="per-call")


# -- PythonTools ------------------------------------------------------------------------------

CLOSED: list[int] = []


class Ledger:
    """A ledger per episode."""

    def __init__(self):
        self.rows: list[int] = []

    def add(self, amount: int, note: str = "") -> str:
        """Add an amount to the ledger.

        More text that is not the description."""
        self.rows.append(amount)
        return f"{len(self.rows)} rows"

    def total(self) -> dict:
        """The sum and count of the amounts."""
        return {"rows": len(self.rows), "sum": sum(self.rows)}

    def explode(self) -> str:
        """Always fails."""
        raise ValueError("the ledger is on fire")

    async def wait(self, seconds: float) -> str:
        """Sleep (async)."""
        await asyncio.sleep(seconds)
        return "woke"

    def block(self, seconds: float) -> str:
        """Sleep (in a worker thread)."""
        time.sleep(seconds)
        return "woke"

    def close(self) -> None:
        CLOSED.append(len(self.rows))


async def test_python_tools_keep_state_per_episode_and_close_it():
    async with mcp_tools(PythonTools(Ledger, prefix="ledger"), timeout_s=0.5) as tb:
        assert CLOSED == [0]  # the object built at start to list the tools
        CLOSED.clear()
        spec = {t["function"]["name"]: t["function"] for t in tb.tools}
        await tb.call("ledger.add", {"amount": 3}, episode_id="a")
        await tb.call("ledger.add", {"amount": 4, "note": "x"}, episode_id="a")
        await tb.call("ledger.add", {"amount": 100}, episode_id="b")
        totals = [(await tb.call("ledger.total", {}, episode_id=e)).content for e in ("a", "b")]
        bad = await tb.call("ledger.add", {"amount": "many"}, episode_id="a")
        fire = await tb.call("ledger.explode", {}, episode_id="a")
        slow_async = await tb.call("ledger.wait", {"seconds": 30}, episode_id="a")
        slow_sync = await tb.call("ledger.block", {"seconds": 2}, episode_id="a")
        no_episode = await tb.call("ledger.total", {})
        await tb.end_episode("a")
        await wait_until(lambda: CLOSED == [2], "episode a's ledger closing")
    assert spec["ledger.add"]["description"] == "Add an amount to the ledger."
    assert spec["ledger.add"]["parameters"] == {
        "type": "object", "properties": {"amount": {"type": "integer"}, "note": {"default": "", "type": "string"}},
        "required": ["amount"], "additionalProperties": False}
    assert totals == ['{"rows": 2, "sum": 7}', '{"rows": 1, "sum": 100}']
    assert bad.error_kind == "invalid_call" and "amount" in bad.content
    assert (fire.error_kind, fire.content) == ("tool", "tool 'explode' failed: ValueError: the ledger is on fire")
    assert slow_async.error_kind == slow_sync.error_kind == "timeout"
    assert no_episode.error_kind == "invalid_call"
    assert sorted(CLOSED) == [1, 2]  # aclose closed episode b's ledger too


def test_python_tools_bad_factory():
    with pytest.raises(ConfigError, match="PythonTools needs a factory"):
        PythonTools(42)
