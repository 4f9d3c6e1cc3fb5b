"""A shared tool server that a neighbouring call crashes: which calls in flight are run again.

Whether the server had started a call when it died cannot be seen from outside, so a call is
retried (once, one retry at a time) only when its tool declares that running it again is
harmless (MCP annotations ``readOnlyHint`` / ``idempotentHint``; ``retry_on_crash="idempotent"``,
the default). The real faulty server (tests/tools/faulty_server.py)
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


def test_retry_on_crash_takes_the_documented_choices():
    with pytest.raises(ConfigError, match=r"retry_on_crash='sometimes'; accepted: True .*'idempotent'.*False"):
        MCPServer(command=FAULTY, retry_on_crash="sometimes")
    with pytest.raises(ConfigError, match=r"mcp_tools: retry_on_crash=1;"):
        mcp_tools(FAULTY, retry_on_crash=1)
