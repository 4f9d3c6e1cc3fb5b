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


# -- the Responses API (the SDK's default model) and model mistakes -----------------------------------

ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@agents.function_tool
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression of additions."""
    return str(sum(int(x) for x in expression.split("+")))


async def responses_agent(client, task):
    """The SDK's default model kind, the Responses API (``OpenAIResponsesModel``), with a Python tool."""
    agents.set_tracing_disabled(True)
    model = agents.OpenAIResponsesModel(model="policy", openai_client=client)
    agent = agents.Agent(name="math", instructions="Use the calculate tool.", tools=[calculate], model=model)
    result = await agents.Runner.run(agent, task["prompt"], max_turns=3)
    return result.final_output


def responses_recipe(**options):
    @ml.recipe
    def sdk_responses(policy, prompts):
        ml.agent_episodes(policy, prompts, agent=responses_agent, greedy=True, max_new_tokens=96, name="rollout",
                          **options)
    return sdk_responses


async def rollout_of(recipe, policy):
    compiled = Compiled(recipe, {"policy": policy}, CompileOptions(group_size=1, episode_timeout_s=120,
                                                                   max_failed_fraction=1.0), rollout_only=True)
    try:
        (episode,) = await compiled.rollout(["What is 2+3?"])
    finally:
        await compiled.aclose()
    return episode


async def test_the_sdk_s_responses_model_trains_on_exact_ids_and_an_invented_tool_is_scored():
    """1. The SDK's default model kind (the Responses API) through ``/v1/responses``: exact ids, the
    tool turn untrained. 2. The SDK raises ``ModelBehaviorError: Tool add not found`` when the
    model calls a tool the agent does not have: by default that episode is kept and scored (no
    result), with the error on its last turn; ``model_errors=()`` fails it as before."""
    policy = ml.Agent("tiny-random")
    first = (await rollout_of(responses_recipe(), policy)).values["rollout"]
    teach(policy, [(first.prompt_ids, CALL)])
    episode = await rollout_of(responses_recipe(), policy)
    assert episode.error is None, episode.error
    rollout = episode.values["rollout"]
    assert rollout.prompt_ids == first.prompt_ids
    assert [s.kind for s in rollout.steps][:3] == ["generate", "tool", "generate"]
    assert (rollout.steps[0].tool_calls[0].name, rollout.steps[0].tool_calls[0].arguments) == (
        "calculate", {"expression": "2+3"})
    # the SDK ran its tool and sent the result back as a function_call_output item
    assert [(r.name, r.content) for r in rollout.steps[1].tool_results] == [("calculate", "5")]
    assert not rollout.steps[1].trainable and rollout.metadata["num_segments"] == 1

    teach(policy, [(first.prompt_ids, ADD)])  # now the model invents a tool
    scored = await rollout_of(responses_recipe(), policy)
    assert scored.error is None, scored.error
    rollout = scored.values["rollout"]
    assert rollout.metadata["result"] is None
    assert rollout.metadata["model_error"].startswith("ModelBehaviorError: Tool add not found")
    assert rollout.num_turns == 1 and rollout.steps[0].tool_calls[0].name == "add"
    assert "ModelBehaviorError" in rollout.steps[0].error and scored.metrics["agent/model_errors"] == 1.0
    assert rollout.loss_mask == [1] * len(rollout.steps[0].token_ids)  # its tokens are trained on
    dropped = await rollout_of(responses_recipe(model_errors=()), policy)
    assert (dropped.error.node, dropped.error.kind) == ("rollout", "ModelBehaviorError")
