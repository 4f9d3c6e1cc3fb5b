"""The notebook's tool functions called directly; state across turns and isolation between
episodes through a real server is in tests/rollout/test_mcp.py::test_episode_state_and_isolation."""

import pytest
from mcp.server.mcpserver.exceptions import ToolError

from materl.tools import notebook


@pytest.fixture(autouse=True)
def _empty():
    notebook._books.clear()
    yield
    notebook._books.clear()


def test_state_per_episode():
    notebook.write("a", "1", "ep1")
    notebook.write("b", "2", "ep1")
    notebook.write("a", "3", "ep1")  # overwrite
    notebook.write("a", "x", "ep2")
    assert notebook.read("a", "ep1") == "3" and notebook.read("a", "ep2") == "x"
    assert notebook.list_keys("ep1") == ["a", "b"] and notebook.list_keys("ep2") == ["a"]
    with pytest.raises(ToolError, match="no key 'b' in the notebook; saved keys: 'a'"):
        notebook.read("b", "ep2")


def test_bounds(monkeypatch):
    with pytest.raises(ToolError, match="value has 10001 characters; the limit is 10000"):
        notebook.write("k", "v" * 10_001, "ep")
    with pytest.raises(ToolError, match="key must be 1 to 200 characters, got 0"):
        notebook.write("", "v", "ep")
    monkeypatch.setattr(notebook, "MAX_KEYS", 2)
    notebook.write("k1", "v", "ep")
    notebook.write("k2", "v", "ep")
    notebook.write("k2", "w", "ep")  # overwriting is fine when full
    with pytest.raises(ToolError, match=r"the notebook is full \(2 keys\)"):
        notebook.write("k3", "v", "ep")


def test_least_recently_used_episode_is_dropped(monkeypatch):
    monkeypatch.setattr(notebook, "MAX_EPISODES", 2)
    notebook.write("k", "1", "ep1")
    notebook.write("k", "2", "ep2")
    notebook.read("k", "ep1")          # ep1 is now the most recent
    notebook.write("k", "3", "ep3")    # evicts ep2
    assert sorted(notebook._books) == ["ep1", "ep3"]
