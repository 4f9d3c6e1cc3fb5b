"""An agent written with a framework from the registry, the OpenAI Agents SDK
(``openai-agents``), trains through ``ml.agent_episodes`` unchanged but for its client: it runs
with its own MCP tool (materl's calculator over stdio, started by the SDK), and its episodes
come back as exact-token Rollouts with the tool turn untrained."""

import sys

import pytest

import materl as ml
from materl.compiler.compiled import Compiled
from materl.compiler.options import CompileOptions
from tests.rollout.taught import teach

agents = pytest.importorskip("agents")
from agents.mcp import MCPServerStdio  # noqa: E402

CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2+3"}}\n</tool_call>'


async def sdk_agent(client, task):
    """Written as the SDK's docs show; materl only supplies ``client``."""
    agents.set_tracing_disabled(True)  # no trace upload (the SDK would send them to OpenAI)
    model = agents.OpenAIChatCompletionsModel(model="policy", openai_client=client)
    async with MCPServerStdio(params={"command": sys.executable, "args": ["-m", "materl.tools.calculator"]},
                              client_session_timeout_seconds=30) as calculator:
        agent = agents.Agent(name="math", instructions="Use the calculate tool.", mcp_servers=[calculator], model=model)
        result = await agents.Runner.run(agent, task["prompt"], max_turns=4)
    return result.final_output


@ml.recipe
def sdk_episodes(policy, prompts):
    ml.agent_episodes(policy, prompts, agent=sdk_agent, greedy=True, max_new_tokens=96, name="rollout")


async def run(policy):
    compiled = Compiled(sdk_episodes, {"policy": policy}, CompileOptions(group_size=1, episode_timeout_s=120),
                        rollout_only=True)
    try:
        (episode,) = await compiled.rollout(["What is 2+3?"])
    finally:
        await compiled.aclose()
    assert episode.error is None, episode.error
    return episode.values["rollout"]


async def test_an_openai_agents_sdk_agent_with_its_own_mcp_tool_trains_on_exact_ids():
    policy = ml.Agent("tiny-random")
    # 1. the SDK's first request, as it sends it (its instructions, the MCP tool's schema)
    first = await run(policy)
    assert first.num_turns == 1 and first.metadata["result"] == first.text
    # 2. teach the tiny model to answer exactly that context with a calculator call
    teach(policy, [(first.prompt_ids, CALL)])
    rollout = await run(policy)
    assert rollout.prompt_ids == first.prompt_ids
    kinds = [s.kind for s in rollout.steps]
    assert kinds[:3] == ["generate", "tool", "generate"]
    call = rollout.steps[0].tool_calls[0]
    assert (call.name, call.arguments) == ("calculate", {"expression": "2+3"})
    # the SDK ran the call on its own MCP server and sent the result back as a tool message
    assert [r.name for r in rollout.steps[1].tool_results] == ["calculate"]
    assert "5" in rollout.steps[1].tool_results[0].content
    assert rollout.loss_mask[:len(rollout.steps[0].token_ids)] == [1] * len(rollout.steps[0].token_ids)
    assert rollout.steps[1].token_ids and not rollout.steps[1].trainable
    assert rollout.metadata["num_segments"] == 1
