"""Toolbox over real MCP servers: the shipped calculator and notebook (stdio, HTTP) and a
test-only server that is slow, crashes or fails on request. No mocks."""

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import pytest_asyncio

from materl.errors import ConfigError, ToolError
from materl.rollout.mcp import MCPServer, as_server, mcp_tools
from materl.rollout.parsers import TOOL_PARSERS

ROOT = Path(__file__).resolve().parents[2]
FLAKY = f"{sys.executable} {ROOT / 'tests/tools/flaky_server.py'}"
NOTEBOOK = f"python {ROOT / 'tools/notebook.py'}"

module_loop = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def toolbox():
    async with mcp_tools(
        "python -m materl.tools.calculator",
        NOTEBOOK,
        MCPServer(name="flaky", command=FLAKY, timeout_s=1.0, max_concurrency=2),
        timeout_s=20.0,
    ) as tb:
        yield tb


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def http_url():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "tools/calculator.py"), "--http", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/mcp"
    proc.kill()
    proc.wait()


@module_loop
async def test_tool_specs_are_openai_functions_without_episode_id(toolbox):
    assert toolbox.names() == ["calculate", "crash", "echo", "fail", "list_keys", "pid", "read", "reset_peak",
                               "slow", "write"]
    specs = {t["function"]["name"]: t for t in toolbox.tools}
    calc = specs["calculate"]
    assert calc["type"] == "function"
    assert calc["function"]["parameters"] == {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
    assert "Evaluate an arithmetic expression" in calc["function"]["description"]
    # notebook tools are stateful: episode_id is filled by the Toolbox, never shown to the model
    assert specs["write"]["function"]["parameters"]["properties"].keys() == {"key", "value"}
    assert specs["write"]["function"]["parameters"]["required"] == ["key", "value"]
    assert specs["list_keys"]["function"]["parameters"]["properties"] == {}
    assert toolbox.is_stateful("read") and not toolbox.is_stateful("calculate")


@module_loop
async def test_stdio_call(toolbox):
    result = await toolbox.call("calculate", {"expression": "2**64 + 1"}, call_id="c7")
    assert (result.content, result.is_error, result.call_id) == ("18446744073709551617", False, "c7")
    assert result.latency_s > 0


@module_loop
async def test_tool_error_comes_back_as_error_result(toolbox):
    result = await toolbox.call("calculate", {"expression": "__import__('os')"})
    assert result.is_error and "function calls are not allowed" in result.content
    result = await toolbox.call("fail", {"message": "no such city"})
    assert result.is_error and result.content.endswith("no such city")


@module_loop
async def test_unknown_tool(toolbox):
    result = await toolbox.call("calcualte", {"expression": "1"})
    assert result.is_error
    assert "unknown tool 'calcualte'" in result.content and "Did you mean 'calculate'?" in result.content


@module_loop
@pytest.mark.parametrize("arguments, expected", [
    ("2+2", "must be a JSON object, got str"),
    ({}, "missing required argument(s) 'expression'"),
    ({"expression": "1", "precision": 3}, "unexpected argument(s) 'precision'"),
    ({"expression": ["1+1"]}, "valid string"),  # a type error: the server's validation answers
])
async def test_invalid_arguments(toolbox, arguments, expected):
    result = await toolbox.call("calculate", arguments)
    assert result.is_error and expected in result.content


@module_loop
async def test_malformed_parsed_call_gets_parse_error(toolbox):
    [bad] = TOOL_PARSERS.get("hermes")('<tool_call>{"name": "calculate", "arguments": 5}</tool_call>').calls
    result = await toolbox.execute(bad)
    assert result.is_error and "could not be parsed" in result.content
    [good] = TOOL_PARSERS.get("hermes")('<tool_call>{"name": "echo", "arguments": {"text": "hi"}}</tool_call>').calls
    assert (await toolbox.execute(good)).content == "hi"


@module_loop
async def test_timeout_then_server_still_serves(toolbox):
    result = await toolbox.call("slow", {"seconds": 30})  # flaky's timeout_s is 1
    assert result.is_error and result.content == "tool 'slow' timed out after 1 s"
    assert (await toolbox.call("echo", {"text": "still here"})).content == "still here"


@module_loop
async def test_per_server_concurrency_limit(toolbox):
    await toolbox.call("reset_peak", {})
    results = await asyncio.gather(*(toolbox.call("slow", {"seconds": 0.2}) for _ in range(5)))
    assert not any(r.is_error for r in results)
    # flaky has max_concurrency=2, so the server never sees more than 2 calls at once
    peaks = [int(r.content.rsplit(" ", 1)[1]) for r in results]
    assert max(peaks) == 2


@module_loop
async def test_crash_mid_episode_then_restart(toolbox):
    pid_before = (await toolbox.call("pid", {})).content
    restarts = toolbox.restarts["flaky"]
    result = await toolbox.call("crash", {})
    # retried once on the restarted server (a crash may be another call's fault), then given up
    assert (result.is_error, result.error_kind, result.attempts) == (True, "crash", 2)
    assert "crashed during the call (the server closed the connection); it died again on the retry" in result.content
    after = await toolbox.call("echo", {"text": "back"})  # waits for the restarted server
    assert (after.content, after.is_error) == ("back", False)
    assert (await toolbox.call("pid", {})).content != pid_before
    assert toolbox.restarts["flaky"] == restarts + 2  # the crash and its retry's crash
    # the other servers were untouched
    assert (await toolbox.call("calculate", {"expression": "7*6"})).content == "42"


@module_loop
async def test_episode_state_and_isolation(toolbox):
    assert (await toolbox.call("write", {"key": "plan", "value": "add"}, episode_id="ep-1")).is_error is False
    # a model that writes episode_id itself cannot reach another episode: the Toolbox overwrites it
    await toolbox.call("write", {"key": "x", "value": "1", "episode_id": "ep-2"}, episode_id="ep-1")
    assert (await toolbox.call("read", {"key": "plan"}, episode_id="ep-1")).content == "add"
    assert (await toolbox.call("list_keys", {}, episode_id="ep-1")).content == "plan\nx"
    other = await toolbox.call("read", {"key": "plan"}, episode_id="ep-2")
    assert other.is_error and "no key 'plan'" in other.content
    missing = await toolbox.call("read", {"key": "plan"})
    assert missing.is_error and "needs an episode id" in missing.content


@module_loop
async def test_http_server(http_url):
    async with mcp_tools(http_url, timeout_s=10) as tb:
        assert tb.names() == ["calculate"]
        results = await asyncio.gather(*(tb.call("calculate", {"expression": f"{i}**3"}) for i in range(4)))
        assert [r.content for r in results] == ["0", "1", "8", "27"]
    closed = await tb.call("calculate", {"expression": "1"})
    assert closed.is_error and "closed" in closed.content


@module_loop
async def test_no_restart_leaves_server_down():
    async with mcp_tools(FLAKY, restart=False, timeout_s=10) as tb:
        assert (await tb.call("crash", {})).is_error
        result = await tb.call("echo", {"text": "x"})
        assert result.is_error and "is down" in result.content and "restart=False" in result.content


@module_loop
async def test_bad_command_fails_at_start():
    with pytest.raises(ToolError, match="could not start tool server 'nonexistent-mcp-binary'"):
        await mcp_tools("nonexistent-mcp-binary --stdio").start()


def test_server_specs():
    assert as_server("python -m materl.tools.calculator").argv == [sys.executable, "-m", "materl.tools.calculator"]
    assert as_server("python -m materl.tools.calculator").label == "calculator"
    assert as_server(["node", "srv/weather.py"]).label == "weather"
    assert as_server("http://127.0.0.1:9/mcp").url == "http://127.0.0.1:9/mcp"
    assert as_server("http://127.0.0.1:9/mcp").label == "127.0.0.1:9"
    with pytest.raises(ConfigError, match="exactly one of command= or url="):
        MCPServer(command="x", url="http://a/mcp")
    with pytest.raises(ConfigError, match=r"the ftp:// transport is not supported; accepted: http:// or https://"):
        MCPServer(url="ftp://a")
    # a URL of an unsupported scheme is never run as a command line (the SDK has no WebSocket client)
    with pytest.raises(ConfigError, match=r"'ws://127.0.0.1:9/mcp': the ws:// transport is not supported"):
        as_server("ws://127.0.0.1:9/mcp")
    with pytest.raises(ConfigError, match=r"uses \{episode_dir\}, which exists only for isolation='episode'"):
        mcp_tools(MCPServer(command=["srv", "--db", "{episode_dir}/x.db"]))
    with pytest.raises(ConfigError, match="got int"):
        as_server(3)
    with pytest.raises(ConfigError, match="at least one server"):
        mcp_tools()

