"""A streamable-HTTP tool server that goes away and comes back (issue #26, item 5): a real
server process (materl's calculator with ``--http``) is killed mid-run and restarted on the
same port. Calls during the outage fail as tool errors of kind ``unavailable`` (each waiting at
most ``reconnect_s``); once it answers again, calls succeed: it is never given up on, however
long it was gone (it used to be marked down for the run after ~1.8 s of failed reconnects)."""

import asyncio
import signal
import socket
import subprocess
import sys
import time

import pytest

from materl.rollout.mcp import MCPServer, mcp_tools


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "materl.tools.calculator", "--http", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # a liveness wait: until it listens
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                raise AssertionError(f"the HTTP calculator exited with {proc.returncode}") from None
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("the HTTP calculator did not listen within 60 s")


@pytest.fixture
def servers():
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_a_restarted_http_server_is_used_again(servers):
    port = free_port()
    servers.append(start_server(port))
    server = MCPServer(url=f"http://127.0.0.1:{port}/mcp", reconnect_s=0.5, name="calc")
    async with mcp_tools(server, timeout_s=10) as toolbox:
        first = await toolbox.call("calculate", {"expression": "6 * 7"})
        assert (first.is_error, first.content) == (False, "42")

        servers[0].send_signal(signal.SIGKILL)
        servers[0].wait()
        outage = []
        for _ in range(6):  # ~6 x 0.5 s down: longer than the old ~1.8 s before "down for the run"
            outage.append(await toolbox.call("calculate", {"expression": "1 + 1"}))
        assert all(r.is_error and r.error_kind == "unavailable" for r in outage), \
            [(r.error_kind, r.content) for r in outage]
        assert "unavailable: its server 'calc' is down" in outage[-1].content
        assert "reconnecting continues" in outage[-1].content

        servers.append(start_server(port))  # the same port, a new process (new MCP sessions)
        deadline = time.monotonic() + 30
        result = await toolbox.call("calculate", {"expression": "2 ** 10"})
        while result.is_error and time.monotonic() < deadline:  # until a reconnect lands (backoff <= 2 s)
            assert result.error_kind == "unavailable", result.content
            await asyncio.sleep(0.1)
            result = await toolbox.call("calculate", {"expression": "2 ** 10"})
        assert (result.is_error, result.content) == (False, "1024")
        after = [await toolbox.call("calculate", {"expression": f"{k} * 3"}) for k in range(3)]
        assert [(r.is_error, r.content) for r in after] == [(False, "0"), (False, "3"), (False, "6")]
        assert toolbox.stats["calc"]["restarts"] >= 1


async def test_a_call_waits_for_a_server_that_comes_back_within_reconnect_s(servers):
    port = free_port()
    servers.append(start_server(port))
    server = MCPServer(url=f"http://127.0.0.1:{port}/mcp", reconnect_s=60, name="calc")
    async with mcp_tools(server, timeout_s=10) as toolbox:
        assert (await toolbox.call("calculate", {"expression": "1 + 2"})).content == "3"
        servers[0].send_signal(signal.SIGKILL)
        servers[0].wait()
        waiting = asyncio.ensure_future(toolbox.call("calculate", {"expression": "5 * 5"}))
        await asyncio.sleep(3)  # the call is waiting through several failed reconnects
        assert not waiting.done()
        servers.append(await asyncio.to_thread(start_server, port))
        result = await asyncio.wait_for(waiting, 60)
        assert (result.is_error, result.content) == (False, "25")


async def test_calls_in_flight_during_an_outage_wait_side_by_side(servers):
    # Six calls meet the dead server at once. Each may wait reconnect_s for its first attempt
    # and reconnect_s for its retry, side by side: about 2 x 2 s in all. Retries that waited
    # for the server one after another (the bug) took k x reconnect_s for the k-th call: 12 s
    # for the last of six. 8 s sits between the two with room for a loaded machine.
    port = free_port()
    servers.append(start_server(port))
    server = MCPServer(url=f"http://127.0.0.1:{port}/mcp", reconnect_s=2.0, name="calc")
    async with mcp_tools(server, timeout_s=30) as toolbox:
        assert (await toolbox.call("calculate", {"expression": "1 + 2"})).content == "3"
        servers[0].send_signal(signal.SIGKILL)
        servers[0].wait()
        started = time.monotonic()
        results = await asyncio.gather(*(toolbox.call("calculate", {"expression": f"{k} + 1"}) for k in range(6)))
        elapsed = time.monotonic() - started
        assert all(r.is_error and r.error_kind == "unavailable" for r in results), \
            [(r.error_kind, r.content) for r in results]
        assert elapsed < 8.0, f"6 calls in an outage took {elapsed:.1f} s: their waits were serialised"
