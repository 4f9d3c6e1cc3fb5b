"""Tools inside compiled episodes: the compile option ``tool_timeout_s`` reaches every call, the
scheduler ends each episode's tool state (success, failure or deadline), and
``max_tool_output_tokens`` bounds what a tool adds to the context. The tiny random model never
writes a tool call, so an async op gives turn 1 one (its sampled ids stay as they are)."""

import asyncio
import dataclasses
import os
import sys
import time
from pathlib import Path

import pytest

import materl as ml
from materl.compiler.compiled import Compiled
from materl.compiler.options import CompileOptions
from materl.rollout.multiturn import TurnResult
from materl.rollout.mcp import MCPServer, PythonTools, mcp_tools
from materl.rollout.types import ToolCall

ROOT = Path(__file__).resolve().parents[2]
FAULTY = [sys.executable, str(ROOT / "tests/tools/faulty_server.py")]


def forced_call_recipe(toolbox, tool: str, args: dict):
    @ml.op
    async def force_call(step) -> {"step": TurnResult}:
        state = step.history
        last = dataclasses.replace(state.steps[-1], tool_calls=[ToolCall(tool, dict(args), id="call_0")],
                                   finish_reason="tool_call")
        return {"step": TurnResult(dataclasses.replace(state, steps=state.steps[:-1] + [last], done=False), last)}

    @ml.recipe
    def forced(policy, prompts):
        first = ml.generate_step(policy, prompts, name="turn_1")
        step = force_call(first)
        results = ml.call_tools(step, tools=toolbox, name="tools_1")
        ml.structure_rollout(ml.generate_step(policy, step.history, results, name="turn_2"), name="rollout")

    return forced


async def rollout(toolbox, tool, args, *, prompts=("a",), **options):
    compiled = Compiled(forced_call_recipe(toolbox, tool, args), {"policy": ml.Agent("tiny-random")},
                        CompileOptions(max_new_tokens=3, group_size=2, **options), rollout_only=True)
    try:
        return await compiled.rollout(list(prompts)), compiled
    finally:
        await compiled.aclose()


def tool_results(episodes):
    return [r for ep in episodes for r in ep.values["rollout"].tool_results]


async def test_the_compile_option_tool_timeout_s_reaches_every_call():
    episodes, _ = await rollout(mcp_tools(FAULTY), "hang", {}, tool_timeout_s=1)
    assert [r.content for r in tool_results(episodes)] == ["tool 'hang' timed out after 1 s"] * 2
    assert all(ep.error is None for ep in episodes)
    # a server's own timeout_s wins over the compile option
    episodes, _ = await rollout(mcp_tools(MCPServer(command=FAULTY, timeout_s=1.5)), "hang", {}, tool_timeout_s=30)
    assert [r.error_kind for r in tool_results(episodes)] == ["timeout"] * 2
    assert all(r.content.endswith("after 1.5 s") for r in tool_results(episodes))


async def wait_dead(pids):
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, f"server processes {pids} still alive after their episodes ended"
        await asyncio.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_each_episode_gets_its_own_server_and_it_stops_when_the_episode_ends():
    toolbox = mcp_tools(FAULTY, isolation="episode", pool_size=2)
    episodes, _ = await rollout(toolbox, "pid", {}, prompts=("a", "b"))
    pids = [int(r.content) for r in tool_results(episodes)]
    assert len(set(pids)) == 4  # 2 prompts x group 2, one server each
    await wait_dead(pids)


async def test_an_episode_past_its_deadline_still_ends_its_tool_state():
    toolbox = mcp_tools(FAULTY, isolation="episode", pool_size=1)
    async with toolbox:
        episodes, compiled = await rollout(toolbox, "hang", {}, tool_timeout_s=60, episode_timeout_s=2)
        assert all("episode exceeded episode_timeout_s=2" in str(ep.error) for ep in episodes)
        assert toolbox._backends[0].episodes == {}  # both episodes' handles were ended


CLOSED = []


class Counter:
    """A counter per episode."""

    def __init__(self):
        self.n = 0

    def bump(self) -> int:
        """Add one."""
        self.n += 1
        return self.n

    def close(self):
        CLOSED.append(self.n)


async def test_python_tool_objects_are_built_per_episode_and_closed_at_its_end():
    CLOSED.clear()
    episodes, _ = await rollout(mcp_tools(PythonTools(Counter)), "bump", {}, prompts=("a", "b"))
    assert [r.content for r in tool_results(episodes)] == ["1"] * 4  # never another episode's counter
    assert CLOSED == [0] + [1] * 4  # the object that listed the tools, then one per episode


async def test_max_tool_output_tokens_bounds_the_tool_turn():
    episodes, _ = await rollout(mcp_tools(FAULTY), "huge", {"size": 100_000}, max_tool_output_tokens=50)
    step = episodes[0].values["rollout"].tool_steps[0]
    result = step.tool_results[0]
    # cut to 64 KiB (Toolbox, then the episode's own byte cap: same size, same marker), then to 50
    # tokens; the byte-level tokenizer has one token per byte
    byte_capped = 65536 + len("\n[... tool output truncated: 65536 of 100000 bytes shown]")
    assert result.content == "x" * 50 + f"\n[... tool output truncated: 50 of {byte_capped} tokens shown]"
    assert result.truncated == {"bytes": 100_000, "kept_bytes": 65536, "tokens": byte_capped, "kept_tokens": 50}
    assert step.metadata["truncated"] == [{"call_id": "call_0", **result.truncated}]
    assert result.content in step.text and len(step.token_ids) < 200


@pytest.mark.parametrize("bad", [0, -1])
def test_max_tool_output_tokens_is_validated(bad):
    with pytest.raises(ml.ConfigError, match="max_tool_output_tokens"):
        CompileOptions.from_kwargs(max_tool_output_tokens=bad)


def test_a_config_builds_its_toolbox_with_the_configured_tool_timeout():
    from materl.runtime.config import validate_config
    from materl.runtime.resolve import resolve_recipe

    cfg = validate_config({"recipe": "grpo_tools", "compile": {"tool_timeout_s": 7.5, "max_tool_output_tokens": 99}})
    recipe = resolve_recipe(cfg.recipe, tools=cfg.tools, tool_timeout_s=cfg.compile_options().tool_timeout_s)
    toolbox = next(n.params["tools"] for n in recipe.nodes if n.op == "call_tools")
    assert toolbox.timeout_s == 7.5 and cfg.compile_options().max_tool_output_tokens == 99
