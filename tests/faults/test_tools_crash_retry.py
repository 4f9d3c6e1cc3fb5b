"""A shared tool server that a neighbouring call crashes: which calls in flight are run again.

Whether the server had started a call when it died cannot be seen from outside, so a call is
retried only when its tool declares that running it again is harmless (MCP annotations
``readOnlyHint`` / ``idempotentHint``; ``retry_on_crash="idempotent"``, the default); a retry
that died with other calls in flight gets one more attempt. The real faulty server (tests/tools/faulty_server.py)
crashes on request; its ``insert`` has a side effect and declares nothing."""

import asyncio
import sys
from pathlib import Path

import pytest

from materl.errors import ConfigError
from materl.rollout.mcp import MCPServer, mcp_tools

FAULTY = [sys.executable, str(Path(__file__).resolve().parents[2] / "tests/tools/faulty_server.py")]


async def crash_under(tb, calls: list[tuple[str, dict]]) -> tuple[list, object]:
    """Start ``calls``, let them reach the server, crash it; their results and the crash's."""
    pending = [asyncio.create_task(tb.call(name, args)) for name, args in calls]
    await asyncio.sleep(0.3)
    crash = await tb.call("crash", {})
    return [await p for p in pending], crash


@pytest.mark.parametrize("retry", ["idempotent", True])
async def test_a_call_with_a_side_effect_is_not_run_twice_after_a_crash(retry):
    server = MCPServer(command=FAULTY, timeout_s=20, retry_on_crash=retry, max_concurrency=8)
    async with mcp_tools(server) as tb:
        (insert, work), crash = await crash_under(tb, [("insert", {"value": 5, "seconds": 1.5}),
                                                       ("work", {"seconds": 1.5})])
    assert (crash.error_kind, crash.attempts) == ("crash", 2)  # its retry crashed too: its own fault
    assert (work.error_kind, work.attempts, work.content) == (None, 2, "done: work none")  # idempotent: retried
    if retry == "idempotent":
        # the insert may have run before the crash (here it was asleep): it is not run a second time
        assert (insert.error_kind, insert.attempts) == ("crash", 1)
        assert "not retried: 'insert' does not declare itself read-only or idempotent" in insert.content
    else:  # retry_on_crash=True: the user vouches for every tool; the insert ran again on the new server
        assert (insert.error_kind, insert.attempts, insert.content) == (None, 2, "inserted; 1 rows")


async def test_calls_in_flight_when_neighbours_crash_the_server_twice_all_succeed():
    """Two waves of calls on one shared server; each wave has two calls that crash it (and crash
    their retries). Every other call of both waves succeeds: a bystander whose retry a new
    crashing call killed is retried once more; a crashing call fails after two or three attempts."""
    server = MCPServer(command=FAULTY, timeout_s=30, max_concurrency=16, restart_after_timeouts=0)
    faults = ["none", "crash", "none", "none", "crash", "none", "none", "none"]
    async with mcp_tools(server) as tb:
        first = [asyncio.create_task(tb.call("work", {"fault": f, "seconds": 0.5})) for f in faults]
        await asyncio.sleep(0.2)
        second = [asyncio.create_task(tb.call("work", {"fault": f, "seconds": 0.5})) for f in faults]
        results = [await t for t in first + second]
        stats = tb.stats[tb._backends[0].name]
    kinds = [(r.error_kind, min(r.attempts, 2) if r.error_kind else None) for r in results]
    assert kinds == [("crash", 2) if f == "crash" else (None, None) for f in faults] * 2, [r.content for r in results]
    assert stats["crashes"] >= 4


def test_retry_on_crash_takes_the_documented_choices():
    with pytest.raises(ConfigError, match=r"retry_on_crash='sometimes'; accepted: True .*'idempotent'.*False"):
        MCPServer(command=FAULTY, retry_on_crash="sometimes")
    with pytest.raises(ConfigError, match=r"mcp_tools: retry_on_crash=1;"):
        mcp_tools(FAULTY, retry_on_crash=1)
