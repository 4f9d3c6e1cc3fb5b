"""What a stdio tool server inherits from the process that starts it: a server run as this
interpreter (``python -m ...``) finds modules through this process's ``PYTHONPATH`` (a materl
installed that way can start its own calculator), and every stdio server keeps
``PYTHONDONTWRITEBYTECODE``. A real server, started through the real MCP SDK."""

import json
import sys

import pytest

from materl.rollout.mcp import MCPServer, mcp_tools
from materl.rollout.mcp_spec import inherited_env

SERVER = '''
import json, os
from mcp.server.mcpserver import MCPServer
app = MCPServer("envprobe")

@app.tool()
def environment() -> str:
    """The server's PYTHONPATH and PYTHONDONTWRITEBYTECODE."""
    return json.dumps({k: os.environ.get(k) for k in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")})

app.run()
'''


@pytest.fixture
def only_on_pythonpath(tmp_path, monkeypatch):
    """A server module importable only through PYTHONPATH (as a materl installed that way is)."""
    (tmp_path / "envprobe_server.py").write_text(SERVER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    return tmp_path


async def test_a_python_m_server_finds_its_module_through_the_parents_pythonpath(only_on_pythonpath):
    async with mcp_tools("python -m envprobe_server", timeout_s=20) as tb:
        result = await tb.call("environment", {})
    assert not result.is_error, result.content
    assert json.loads(result.content) == {"PYTHONPATH": str(only_on_pythonpath), "PYTHONDONTWRITEBYTECODE": "1"}


async def test_env_given_for_the_server_wins_over_the_inherited_values(only_on_pythonpath):
    extra = only_on_pythonpath / "more"
    extra.mkdir()
    server = MCPServer(command="python -m envprobe_server",
                       env={"PYTHONPATH": f"{only_on_pythonpath}:{extra}", "PYTHONDONTWRITEBYTECODE": ""})
    async with mcp_tools(server, timeout_s=20) as tb:
        result = await tb.call("environment", {})
    assert json.loads(result.content) == {"PYTHONPATH": f"{only_on_pythonpath}:{extra}",
                                          "PYTHONDONTWRITEBYTECODE": ""}


def test_pythonpath_goes_only_to_this_interpreter(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/opt/site")
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    assert inherited_env([sys.executable, "-m", "x"]) == {"PYTHONPATH": "/opt/site", "PYTHONDONTWRITEBYTECODE": "1"}
    # another program (another Python's virtualenv, node, ...) would import this one's packages
    assert inherited_env(["/usr/bin/node", "server.js"]) == {"PYTHONDONTWRITEBYTECODE": "1"}
    monkeypatch.delenv("PYTHONPATH")
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE")
    assert inherited_env([sys.executable]) == {}
    argv, env, _ = MCPServer(command="python -m x", env={"A": "b"}).launch(None)
    assert argv[0] == sys.executable and env == {"A": "b"}
