"""Notebook MCP server: a key-value notebook per episode, the example of a stateful tool.

    python -m materl.tools.notebook              # stdio
    python -m materl.tools.notebook --http 8766  # streamable HTTP

Tools: ``write(key, value)``, ``read(key)``, ``list_keys()``. Each also takes ``episode_id``,
which the model never sees: ``materl.rollout.mcp.Toolbox`` removes any input property named
``episode_id`` from the schema it shows the model and fills it from
``toolbox.call(..., episode_id=...)``. State lives in this server process, one notebook per
episode id, so an episode sees its own writes across turns and never another episode's.

Bounds: 256 keys per notebook, 10,000 characters per value, 4,096 notebooks (the least
recently used is dropped first, so a long training run does not grow without limit).
"""

from __future__ import annotations

from collections import OrderedDict

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations

try:
    from materl.tools._serve import main as _serve_main
except ImportError:  # pragma: no cover - run as a plain script from a checkout
    from _serve import main as _serve_main  # type: ignore[no-redef]

MAX_KEYS = 256
MAX_VALUE_CHARS = 10_000
MAX_KEY_CHARS = 200
MAX_EPISODES = 4096

_books: OrderedDict[str, dict[str, str]] = OrderedDict()

app = MCPServer("notebook", instructions="A private notebook for this task.", log_level="WARNING")


def _book(episode_id: str) -> dict[str, str]:
    book = _books.get(episode_id)
    if book is None:
        book = _books[episode_id] = {}
        while len(_books) > MAX_EPISODES:
            _books.popitem(last=False)
    _books.move_to_end(episode_id)
    return book


@app.tool(annotations=ToolAnnotations(idempotent_hint=True, destructive_hint=True, open_world_hint=False))
def write(key: str, value: str, episode_id: str) -> str:
    """Save a value under a key in your notebook (overwrites an existing key)."""
    if not key or len(key) > MAX_KEY_CHARS:
        raise ToolError(f"key must be 1 to {MAX_KEY_CHARS} characters, got {len(key)}")
    if len(value) > MAX_VALUE_CHARS:
        raise ToolError(f"value has {len(value)} characters; the limit is {MAX_VALUE_CHARS}")
    book = _book(episode_id)
    if key not in book and len(book) >= MAX_KEYS:
        raise ToolError(f"the notebook is full ({MAX_KEYS} keys); overwrite an existing key")
    book[key] = value
    return f"saved {key!r} ({len(value)} characters)"


@app.tool(annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
def read(key: str, episode_id: str) -> str:
    """Read the value saved under a key in your notebook."""
    book = _book(episode_id)
    if key not in book:
        keys = ", ".join(repr(k) for k in sorted(book)) or "none"
        raise ToolError(f"no key {key!r} in the notebook; saved keys: {keys}")
    return book[key]


@app.tool(annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
def list_keys(episode_id: str) -> list[str]:
    """List the keys saved in your notebook, sorted."""
    return sorted(_book(episode_id))


if __name__ == "__main__":
    _serve_main(app, "materl notebook MCP server")
