"""Fault injection: a real MCP server (tests/tools/faulty_server.py) that crashes, hangs, stops
answering, sends garbage, huge or invalid UTF-8 answers and error results, over stdio and
streamable HTTP. Every failure must come back on its own call with its kind, and the calls
that did nothing wrong must succeed. No mocks; no timing assertions (speed and the timeout
precision are measured in benchmarks/tool_faults.py)."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from materl.errors import ToolError
from materl.rollout.mcp import MCPServer, mcp_tools

ROOT = Path(__file__).resolve().parents[2]
FAULTY = ROOT / "tests/tools/faulty_server.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"the faulty HTTP server did not listen on port {port}")


@pytest.fixture(params=["stdio", "http"])
def server(request):
    """``server(*args, **MCPServer fields)`` -> an MCPServer for the faulty server. Over HTTP the
    server runs under a restart loop (as a deployed HTTP server would), so a crash brings it back."""
    loops = []

    def make(*args: str, **fields) -> MCPServer:
        if request.param == "stdio":
            return MCPServer(command=[sys.executable, str(FAULTY), *args], **fields)
        port = free_port()
        cmd = f'while true; do "{sys.executable}" "{FAULTY}" --http {port} {" ".join(args)}; sleep 0.05; done'
        loops.append(subprocess.Popen(["bash", "-c", cmd], start_new_session=True, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        wait_for_port(port)
        return MCPServer(url=f"http://127.0.0.1:{port}/mcp", **fields)

    make.transport = request.param
    yield make
    for proc in loops:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def test_a_crash_fails_its_own_call_and_the_others_are_retried(server):
    async with mcp_tools(server(timeout_s=20)) as tb:
        innocent = asyncio.create_task(tb.call("slow", {"seconds": 1.0}))
        await asyncio.sleep(0.2)  # let the slow call reach the server first
        crash = await tb.call("crash", {})
        slow = await innocent
        after = await tb.call("echo", {"text": "back"})
    # the crashing call is retried once (the crash might have been another call's), crashes again, fails
    assert (crash.error_kind, crash.attempts) == ("crash", 2)
    assert "crashed during the call" in crash.content and "it died again on the retry" in crash.content
    # the call that was in flight is retried on the restarted server and succeeds
    assert (slow.is_error, slow.content) == (False, "done: slow slow")
    assert (after.is_error, after.content) == (False, "back")
    stats = tb.stats[tb._backends[0].name]
    assert stats["crashes"] >= 2 and stats["retries"] >= 2


async def test_retry_on_crash_false_fails_the_calls_in_flight():
    spec = MCPServer(command=[sys.executable, str(FAULTY)], timeout_s=20, retry_on_crash=False)
    async with mcp_tools(spec) as tb:
        innocent = asyncio.create_task(tb.call("slow", {"seconds": 2.0}))
        await asyncio.sleep(0.2)
        crash = await tb.call("crash", {})
        slow = await innocent
        after = await tb.call("echo", {"text": "back"})
    assert (crash.error_kind, crash.attempts) == ("crash", 1)
    assert (slow.error_kind, slow.attempts) == ("crash", 1) and "retry_on_crash=False" in slow.content
    assert after.content == "back"  # the server itself was restarted


async def test_a_hung_call_times_out_and_the_server_keeps_serving(server):
    async with mcp_tools(server(timeout_s=1)) as tb:
        hung, other = await asyncio.gather(tb.call("hang", {}), tb.call("slow", {"seconds": 0.1}))
        after = await tb.call("echo", {"text": "still here"})
    assert (hung.error_kind, hung.content) == ("timeout", "tool 'hang' timed out after 1 s")
    assert hung.latency_s >= 1.0
    assert (other.is_error, after.content) == (False, "still here")


async def test_a_server_that_stops_answering_without_closing_is_restarted():
    spec = MCPServer(command=[sys.executable, str(FAULTY)], timeout_s=1, restart_after_timeouts=2)
    async with mcp_tools(spec) as tb:
        pid = (await tb.call("pid", {})).content
        frozen = await tb.call("freeze", {})  # the process stays alive with its pipes open
        second = await tb.call("echo", {"text": "x"})  # 2 timeouts in a row: restarted
        after = await tb.call("echo", {"text": "y"})
        new_pid = (await tb.call("pid", {})).content
    assert (frozen.error_kind, second.error_kind) == ("timeout", "timeout")
    assert (after.is_error, after.content) == (False, "y") and new_pid != pid
    assert tb.stats["faulty_server"]["timeout_restarts"] == 1


async def test_a_frozen_http_server_is_reconnected_and_never_given_up_on(server):
    if server.transport != "http":
        pytest.skip("stdio is covered by test_a_server_that_stops_answering_without_closing_is_restarted")
    async with mcp_tools(server(timeout_s=1, restart_after_timeouts=1, start_timeout_s=5, reconnect_s=2,
                                pool_size=0)) as tb:
        frozen = await tb.call("freeze", {})
        after = await tb.call("echo", {"text": "x"})  # reconnects fail (the process is frozen, not ours to restart)
        later = await tb.call("echo", {"text": "y"})  # still not marked down: each call waits reconnect_s again
    assert frozen.error_kind == "timeout"
    for result in (after, later):
        assert result.error_kind == "unavailable" and "did not answer within 2 s; reconnecting continues" in \
            result.content, result.content


async def test_garbage_answers_are_protocol_errors(server):
    async with mcp_tools(server(timeout_s=5)) as tb:
        garbage = await tb.call("garbage", {})
        after = await tb.call("echo", {"text": "fine"})
    assert garbage.error_kind == "protocol"
    assert ("invalid answer" if server.transport == "stdio" else "Failed to parse JSON response") in garbage.content
    assert (after.is_error, after.content) == (False, "fine")


async def test_a_stray_non_json_line_does_not_disturb_the_calls():
    async with mcp_tools(MCPServer(command=[sys.executable, str(FAULTY)], timeout_s=5)) as tb:
        noisy = await tb.call("noise", {})
        after = await tb.call("echo", {"text": "fine"})
    assert (noisy.is_error, noisy.content, after.content) == (False, "done: noise noise", "fine")


async def test_invalid_utf8_and_lone_surrogates_in_answers(server):
    async with mcp_tools(server(timeout_s=1)) as tb:
        bad = await tb.call("bad_utf8", {})
        lone = await tb.call("surrogate", {})
        after = await tb.call("echo", {"text": "fine"})
    if server.transport == "stdio":
        # stdio lines are decoded with errors="replace": the answer arrives, bad bytes as U+FFFD
        assert (bad.is_error, bad.content) == (False, "caf\ufffd \ufffd\ufffd bytes")
        # the SDK cannot parse a lone surrogate escape: that line is dropped, the call times out
        assert lone.error_kind == "timeout"
    else:  # an HTTP body that does not parse answers its own request
        assert bad.error_kind == "protocol" and lone.error_kind == "protocol"
    assert (after.is_error, after.content) == (False, "fine")


async def test_lone_surrogates_in_arguments_are_replaced_not_fatal(server):
    async with mcp_tools(server(timeout_s=5)) as tb:
        odd = await tb.call("echo", {"text": "a\ud800b"})
        after = await tb.call("echo", {"text": "fine"})
    assert (odd.is_error, odd.content) == (False, "a\ufffdb")
    assert after.content == "fine"


async def test_huge_output_is_cut_with_a_marker(server):
    async with mcp_tools(server(timeout_s=20), max_output_bytes=4096) as tb:
        huge = await tb.call("huge", {"size": 1_000_000})
    assert not huge.is_error
    assert huge.truncated == {"bytes": 1_000_000, "kept_bytes": 4096, "tokens": None, "kept_tokens": None}
    assert huge.content == "x" * 4096 + "\n[... tool output truncated: 4096 of 1000000 bytes shown]"


async def test_error_results_are_tool_errors(server):
    async with mcp_tools(server(timeout_s=5)) as tb:
        mcp_error = await tb.call("error", {})
        rpc_error = await tb.call("rpc_error", {})
    assert (mcp_error.error_kind, mcp_error.content) == ("tool", "the tool failed on purpose")
    assert rpc_error.error_kind == "tool" and rpc_error.content.endswith("the server refused the request on purpose")


async def test_a_server_that_stops_coming_back_is_marked_down(tmp_path):
    flag = tmp_path / "fail-from-now-on"
    spec = MCPServer(command=[sys.executable, str(FAULTY), "--fail-start-if-exists", str(flag)], timeout_s=5,
                     pool_size=0)
    async with mcp_tools(spec) as tb:
        assert (await tb.call("echo", {"text": "up"})).content == "up"
        flag.touch()
        crash = await tb.call("crash", {})
        down = await tb.call("echo", {"text": "x"})
    assert crash.error_kind == "unavailable"  # its retry found no server to run on
    assert down.error_kind == "unavailable" and "3 failed starts in a row" in down.content
    assert "failing at start on purpose" in down.content  # the server's stderr is in the message
    assert tb.stats["faulty_server"]["start_failures"] == 3


async def test_a_server_that_cannot_start_fails_the_toolbox_start():
    with pytest.raises(ToolError, match="(?s)could not start tool server 'faulty_server'.*failing at start on purpose"):
        await mcp_tools([sys.executable, str(FAULTY), "--fail-start"]).start()


async def test_concurrent_faults_fail_only_their_own_calls():
    """One shared process, calls at once: 2 crash, 1 hangs, 1 answers garbage, 4 are fine. The
    first crash kills every call in flight; their retries run one at a time, so each crashing
    call crashes its own retry and the others succeed."""
    spec = MCPServer(command=[sys.executable, str(FAULTY)], timeout_s=2, restart_after_timeouts=0, max_concurrency=8)
    faults = ["crash", "none", "hang", "none", "garbage", "crash", "none", "none"]
    async with mcp_tools(spec) as tb:
        results = await asyncio.gather(*(tb.call("work", {"fault": f, "seconds": 0.2}) for f in faults))
    kinds = {"crash": "crash", "hang": "timeout", "garbage": "protocol", "none": None}
    assert [r.error_kind for r in results] == [kinds[f] for f in faults]
