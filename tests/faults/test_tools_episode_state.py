"""Per-episode tool state held in files: with ``isolation="episode"`` every server instance gets
its own working directory (``{episode_dir}``), so a file-backed third-party server starts each
episode from nothing, and no folder outlives its episode.

The server is the reference MCP memory server from the npm registry
(``@modelcontextprotocol/server-memory``: a knowledge graph kept in the JSON-lines file named
by ``MEMORY_FILE_PATH``), installed once into ``.cache/npm`` of the checkout. (The PyPI
``mcp-server-sqlite`` 2025.4.25 that issue #26 used is written against mcp 1.x and does not
start under the mcp 2.x materl depends on.) Also here: ``{episode_dir}`` as the cwd, and an
invalid tool input schema reported at start, naming server and tool.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from materl.errors import ToolError
from materl.rollout.mcp import MCPServer, mcp_tools
from materl.rollout.mcp_spec import inherited_env

ROOT = Path(__file__).resolve().parents[2]
FAULTY = [sys.executable, str(ROOT / "tests/tools/faulty_server.py")]
MEMORY_PACKAGE = "@modelcontextprotocol/server-memory@2026.8.31"
NPM_PREFIX = ROOT / ".cache/npm"


@pytest.fixture(scope="module")
def memory_server() -> str:
    """The memory server's binary, installed from the npm registry on first use."""
    binary = NPM_PREFIX / "node_modules/.bin/mcp-server-memory"
    if not binary.exists():
        npm = shutil.which("npm")
        if npm is None or shutil.which("node") is None:
            pytest.skip("node and npm are needed to install the third-party MCP memory server")
        subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(NPM_PREFIX), MEMORY_PACKAGE],
                       check=True, capture_output=True, timeout=300)
    return str(binary)


def read(path: Path) -> str:
    """A file's text; "" once it is gone (an ended episode's folder is removed in the background)."""
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def entities(text: str) -> list[tuple[str, list[str]]]:
    graph = json.loads(text)
    return [(e["name"], e["observations"]) for e in graph["entities"]]


async def test_every_episode_starts_from_an_empty_file(memory_server, tmp_path):
    # Each episode writes one entity, then reads the whole graph. Sharing one file, episode k
    # would read k entities (the 42, 83, 124, ...); with its own folder each reads 1.
    server = MCPServer(command=[memory_server], env={"MEMORY_FILE_PATH": "{episode_dir}/memory.jsonl"},
                       isolation="episode", pool_size=2, name="memory")
    seen = []
    async with mcp_tools(server, workdir=str(tmp_path), timeout_s=30) as toolbox:
        for k in range(5):
            ep = f"ep-{k}"
            made = await toolbox.call("create_entities", {"entities": [
                {"name": "counter", "entityType": "note", "observations": [ep]}]}, episode_id=ep)
            assert not made.is_error, made.content
            graph = await toolbox.call("read_graph", {}, episode_id=ep)
            seen.append(entities(graph.content))
            mine = [p for p in tmp_path.glob("*/memory.jsonl") if f'"{ep}"' in read(p)]
            assert len(mine) == 1, mine  # this episode's file, in a folder of its own under workdir
            await toolbox.end_episode(ep)
        await toolbox.aclose()  # waits for the ended episodes' instances
    assert seen == [[("counter", [f"ep-{k}"])] for k in range(5)]
    assert list(tmp_path.iterdir()) == []  # every episode's folder, pooled ones included, is gone


async def test_concurrent_episodes_do_not_share_state(memory_server, tmp_path):
    import asyncio

    server = MCPServer(command=[memory_server], env={"MEMORY_FILE_PATH": "{episode_dir}/memory.jsonl"},
                       isolation="episode", name="memory")

    async def episode(toolbox, ep: str) -> list:
        for i in range(2):
            await toolbox.call("create_entities", {"entities": [
                {"name": f"{ep}-{i}", "entityType": "note", "observations": []}]}, episode_id=ep)
        graph = await toolbox.call("read_graph", {}, episode_id=ep)
        await toolbox.end_episode(ep)
        return sorted(name for name, _ in entities(graph.content))

    async with mcp_tools(server, workdir=str(tmp_path), timeout_s=30) as toolbox:
        results = await asyncio.gather(*(episode(toolbox, f"e{k}") for k in range(4)))
    assert results == [[f"e{k}-0", f"e{k}-1"] for k in range(4)]
    assert list(tmp_path.iterdir()) == []


async def test_episode_dir_is_the_cwd_and_fills_the_command(tmp_path):
    # faulty_server's cwd() returns os.getcwd() and argv() its arguments (it ignores --marker)
    server = MCPServer(command=[*FAULTY, "--marker", "{episode_dir}/db"], isolation="episode", pool_size=0)
    async with mcp_tools(server, workdir=str(tmp_path)) as toolbox:
        a = (await toolbox.call("cwd", {}, episode_id="a")).content
        b = (await toolbox.call("cwd", {}, episode_id="b")).content
        assert Path(a).parent == tmp_path and Path(b).parent == tmp_path and a != b
        assert json.loads((await toolbox.call("argv", {}, episode_id="a")).content) == ["--marker", f"{a}/db"]
        assert Path(a).is_dir() and Path(b).is_dir()
        await toolbox.end_episode("a")
    assert not Path(a).exists() and not Path(b).exists()
    assert list(tmp_path.iterdir()) == []
    # the cwd moved, so a relative program path is made absolute; {episode_dir} fills the env too
    relative = Path(os.path.relpath(FAULTY[1]))
    spec = MCPServer(command=[sys.executable, str(relative)], isolation="episode", env={"DB": "{episode_dir}/x"})
    argv, env, cwd = spec.launch("/e/1")
    # python is absolute; the env is this process's inherited variables (mcp_spec.inherited_env) plus env=
    assert (argv, env, cwd) == ([sys.executable, str(relative)], {**inherited_env(argv), "DB": "/e/1/x"}, "/e/1")
    argv, _, _ = MCPServer(command=[str(relative), "--db", "{episode_dir}/db"]).launch("/e/1")
    assert argv == [str(ROOT / "tests/tools/faulty_server.py"), "--db", "/e/1/db"]


async def test_an_invalid_input_schema_is_reported_at_start_naming_server_and_tool():
    with pytest.raises(ToolError, match=r"tool server 'faulty': tool 'broken' has an invalid input schema: "
                                        r"'no-such-type' is not valid .*\(at properties/x/type\)"):
        await mcp_tools(MCPServer(command=[*FAULTY, "--bad-schema"], name="faulty")).start()


def test_materl_tools_prints_the_schema_error_and_a_ws_url_is_not_run():
    bad = subprocess.run([sys.executable, "-m", "materl.cli", "tools", *FAULTY, "--bad-schema"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2, bad.stderr
    assert "tool 'broken' has an invalid input schema" in bad.stderr and "Traceback" not in bad.stderr
    ws = subprocess.run([sys.executable, "-m", "materl.cli", "tools", "ws://127.0.0.1:9/mcp"],
                        capture_output=True, text=True, timeout=120)
    assert ws.returncode == 2, ws.stderr
    assert "the ws:// transport is not supported; accepted: http:// or https://" in ws.stderr
    assert "could not start" not in ws.stderr  # it was never run as a command line
