"""A test-only MCP server that misbehaves on request: slow calls, crashes, tool errors.

Imports only ``mcp`` (a stand-in for any third-party server); run as
``python tests/tools/flaky_server.py`` (stdio) or with ``--http PORT``.
"""

import os
import sys

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations

SAFE = ToolAnnotations(idempotent_hint=True)  # running it again is harmless: retried after a crash

app = MCPServer("flaky", log_level="ERROR")
_inflight = [0, 0]  # now, peak


@app.tool(annotations=SAFE)
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@app.tool(annotations=SAFE)
async def slow(seconds: float) -> str:
    """Sleep, then answer; reports the most calls that were in flight at once."""
    _inflight[0] += 1
    _inflight[1] = max(_inflight)
    try:
        await anyio.sleep(seconds)
    finally:
        _inflight[0] -= 1
    return f"slept {seconds} s; peak in flight {_inflight[1]}"


@app.tool(annotations=SAFE)
def reset_peak() -> str:
    """Forget the in-flight peak."""
    _inflight[1] = _inflight[0]
    return "ok"


@app.tool(annotations=SAFE)
def crash() -> str:
    """Kill this server process mid-call."""
    os._exit(3)


@app.tool(annotations=SAFE)
def fail(message: str) -> str:
    """Raise a tool error carrying the message."""
    raise ToolError(message)


@app.tool(annotations=SAFE)
def pid() -> int:
    """This server's process id."""
    return os.getpid()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--http":
        app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        app.run()
