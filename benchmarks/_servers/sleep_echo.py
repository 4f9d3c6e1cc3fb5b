"""A test MCP server for benchmarks/rollout_overlap.py: one tool that waits, then echoes.

    python benchmarks/_servers/sleep_echo.py      # speaks MCP over stdio

``sleep_echo`` stands in for a slow tool (a sandbox, a web request): it awaits
``anyio.sleep`` so concurrent calls overlap inside the server, as real I/O-bound tools do.
"""

import anyio
from mcp.server.mcpserver import MCPServer

app = MCPServer("sleep_echo", log_level="WARNING")


@app.tool()
async def sleep_echo(text: str, seconds: float = 0.2) -> str:
    """Wait ``seconds`` (default 0.2), then return ``text`` unchanged."""
    await anyio.sleep(seconds)
    return text


if __name__ == "__main__":
    app.run()
