"""The command line every materl tool server shares: stdio by default, ``--http PORT`` for
streamable HTTP on 127.0.0.1 (endpoint ``http://127.0.0.1:PORT/mcp``).

    python -m materl.tools.calculator                 # stdio, for mcp_tools("python -m ...")
    python -m materl.tools.calculator --http 8765     # mcp_tools("http://127.0.0.1:8765/mcp")
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


def parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the shared ``--http PORT`` / ``--host`` options."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--http", type=int, metavar="PORT", default=None,
                   help="serve streamable HTTP on PORT (endpoint /mcp) instead of stdio")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    return p


def serve(app: Any, args: argparse.Namespace) -> None:
    """Run an ``mcp.server.mcpserver.MCPServer`` over stdio, or over HTTP when ``args.http``."""
    if args.http is None:
        app.run()
    else:
        app.run("streamable-http", host=args.host, port=args.http)


def main(app: Any, description: str, argv: Sequence[str] | None = None) -> None:
    """Parse the shared options and serve ``app``."""
    serve(app, parser(description).parse_args(argv))
