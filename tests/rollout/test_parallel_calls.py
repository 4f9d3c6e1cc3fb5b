"""Parallel tool calls: a turn holds every call the model writes (the hermes format no longer
stops at the first ``</tool_call>``), the calls run concurrently on a real MCP server, and their
results come back to the model in call order; ``parallel_tool_calls=False`` keeps one call per
turn. The tiny model is taught (``tests.rollout.taught``) to write two calls."""

import json
import sys
from pathlib import Path

import anyio
import openai
import pytest
import pytest_asyncio

import materl as ml
from materl.compiler.compiled import Compiled
from materl.compiler.options import CompileOptions
from materl.engines.base import SamplingParams
from materl.errors import RecipeError
from materl.rollout.endpoint import AgentEndpoint, AgentSession
from materl.rollout.multiturn import EpisodeState, in_call_order
from materl.rollout.mcp import MCPServer, mcp_tools
from materl.rollout.parsers import NOT_RUN_SERIAL, TOOL_PARSERS, error_result, one_call_per_turn
from materl.rollout.types import ToolCall, ToolResult
from tests.rollout.taught import Recording, teach

ROOT = Path(__file__).resolve().parents[2]
FLAKY = [sys.executable, str(ROOT / "tests/tools/flaky_server.py")]
ADD = [{"role": "user", "content": "What are 2+3 and 4*5?"}]
SLEEP = [{"role": "user", "content": "Sleep twice."}]


def call(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


TWO_SUMS = call("calculate", {"expression": "2+3"}) + "\n" + call("calculate", {"expression": "4*5"})
TWO_SLEEPS = call("slow", {"seconds": 1}) + "\n" + call("slow", {"seconds": 1})
module_loop = pytest.mark.asyncio(loop_scope="module")


SERVERS = ("python -m materl.tools.calculator", MCPServer(name="flaky", command=FLAKY, max_concurrency=4))


@pytest.fixture(scope="module")
def specs() -> dict[str, list[dict]]:
    """Each server's tools as the model sees them (OpenAI function specs)."""

    async def read():
        out = {}
        for name, server in zip(("calculator", "flaky"), SERVERS):
            async with mcp_tools(server, timeout_s=30) as tb:
                out[name] = tb.tools
        return out

    return anyio.run(read)


@pytest.fixture(scope="module")
def caller(specs):
    """The tiny model taught to answer each question (shown its server's tools) with two calls;
    taught outside any event loop (it blocks for a while)."""
    agent = ml.Agent("tiny-random")
    tok = agent.tokenizer
    teach(agent, [(EpisodeState.start(tok, ADD, tools=specs["calculator"]).ids, TWO_SUMS),
                  (EpisodeState.start(tok, SLEEP, tools=specs["flaky"]).ids, TWO_SLEEPS)])
    return agent


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def toolbox():
    async with mcp_tools(*SERVERS, timeout_s=30) as tb:
        yield tb


def two_turns(toolbox, shown: list[dict], *, parallel: bool = True):
    @ml.recipe
    def recipe(policy, prompts):
        first = ml.generate_step(policy, prompts, tools=shown, name="turn_1", parallel_tool_calls=parallel)
        results = ml.call_tools(first, tools=toolbox, name="tools_1")
        second = ml.generate_step(policy, first.history, results, tools=shown, name="turn_2",
                                  parallel_tool_calls=parallel)
        ml.structure_rollout(second, name="rollout")

    return recipe


async def rollout(agent, recipe, prompt):
    compiled = Compiled(recipe, {"policy": agent}, CompileOptions(max_new_tokens=200, group_size=1),
                        rollout_only=True)
    try:
        (episode,) = await compiled.rollout([prompt], greedy=True)
    finally:
        await compiled.aclose()
    assert episode.error is None, episode.error
    return episode


@module_loop
async def test_two_calls_in_one_turn_run_on_the_calculator_and_answer_in_order(caller, toolbox, specs):
    ep = await rollout(caller, two_turns(toolbox, specs["calculator"]), ADD)
    first, tool_step = ep.values["rollout"].steps[:2]
    # the turn ran past the first </tool_call> to the model's end of turn: both calls, in order
    assert [(c.name, c.arguments) for c in ep.values["turn_1"].tool_requests] == [
        ("calculate", {"expression": "2+3"}), ("calculate", {"expression": "4*5"})]
    assert caller.tokenizer.decode(first.token_ids, skip_special_tokens=True) == TWO_SUMS
    # the real calculator answered both; the tool turn carries the answers in call order
    assert [(r.content, r.call_id) for r in tool_step.tool_results] == [("5", "call_0"), ("20", "call_1")]
    glue = caller.tokenizer.decode(tool_step.token_ids)
    assert glue.index("<tool_response>\n5\n</tool_response>") < glue.index("<tool_response>\n20\n</tool_response>")
    assert not tool_step.trainable


@module_loop
async def test_the_calls_of_a_turn_run_concurrently(caller, toolbox, specs):
    await toolbox.call("reset_peak", {})
    ep = await rollout(caller, two_turns(toolbox, specs["flaky"]), SLEEP)
    answers = [r.content for r in ep.values["tools_1"]]
    # each answer reports the most calls in flight at once on the server: both were
    assert len(answers) == 2 and all(a.endswith("peak in flight 2") for a in answers), answers


@module_loop
async def test_parallel_tool_calls_false_keeps_one_call_per_turn(caller, toolbox, specs):
    ep = await rollout(caller, two_turns(toolbox, specs["calculator"], parallel=False), ADD)
    first = ep.values["rollout"].steps[0]
    # the turn stopped at the hermes stop string: the first call only, which ran
    assert caller.tokenizer.decode(first.token_ids, skip_special_tokens=True) == call(
        "calculate", {"expression": "2+3"})
    assert [c.arguments for c in ep.values["turn_1"].tool_requests] == [{"expression": "2+3"}]
    assert [r.content for r in ep.values["rollout"].steps[1].tool_results] == ["5"]


def test_parallel_tool_calls_must_be_a_bool():
    with pytest.raises(RecipeError, match="parallel_tool_calls must be True or False, got 'yes'"):
        @ml.recipe
        def bad(policy, prompts):
            ml.generate_step(policy, prompts, parallel_tool_calls="yes")


def test_each_format_stops_after_one_call_only_when_parallel_calls_are_off():
    stops = {name: (TOOL_PARSERS.get(name).turn_stop_strings(parallel_tool_calls=True),
                    TOOL_PARSERS.get(name).turn_stop_strings(parallel_tool_calls=False))
             for name in TOOL_PARSERS.names()}
    assert stops["hermes"] == ((), ("</tool_call>",))
    assert stops["qwen3_coder"] == ((), ("</tool_call>",))
    assert stops["json"] == stops["llama3_json"] == stops["mistral"] == ((), ())
    # gpt-oss harmony ends a message at each call: one call per turn either way
    assert stops["harmony"] == (("<|call|>",), ("<|call|>",))


def test_formats_without_a_stop_string_keep_only_the_first_call_when_parallel_calls_are_off():
    text = '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": 2}}'
    calls = TOOL_PARSERS.get("llama3_json")(text).calls
    assert [(c.name, c.error) for c in calls] == [("a", None), ("b", None)]
    one = one_call_per_turn(calls)
    assert [(c.name, c.arguments, c.error) for c in one] == [("a", {"x": 1}, None), ("b", {"y": 2}, NOT_RUN_SERIAL)]
    # a malformed call first does not count as the one that runs
    bad = ToolCall("", {}, id="call_0", raw="{", error="not JSON")
    assert [c.error for c in one_call_per_turn([bad, *calls])] == ["not JSON", None, NOT_RUN_SERIAL]
    answer = error_result(one[1])
    assert answer.is_error and answer.call_id == one[1].id and "was not run" in answer.content
    assert "only one tool call per turn" in answer.content


def test_results_follow_the_order_of_the_calls_with_malformed_ones_in_place():
    good_a, good_b = ToolCall("a", {}, id="call_0"), ToolCall("b", {}, id="call_2")
    bad = ToolCall("", {}, id="call_1", raw="{", error="not JSON")
    answers = [ToolResult("a", "A", call_id="call_0"), ToolResult("b", "B", call_id="call_2")]
    ordered = in_call_order([good_a, bad, good_b], answers)
    assert [(r.call_id, r.is_error) for r in ordered] == [("call_0", False), ("call_1", True), ("call_2", False)]


# -- the OpenAI-compatible endpoint, through the real openai client ---------------------------

async def serve(agent):
    endpoint = AgentEndpoint()
    await endpoint.start()
    engine = Recording(agent.engine)
    session = AgentSession(engine, agent.tokenizer, lambda k: SamplingParams(max_new_tokens=200, greedy=True, seed=k))
    key = endpoint.open("episode-0", session)
    return endpoint, engine, session, openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=key, max_retries=0)


async def test_the_endpoint_returns_every_call_of_the_turn(caller, specs):
    calc = specs["calculator"]
    endpoint, engine, session, client = await serve(caller)
    try:
        out = await client.chat.completions.create(model="policy", messages=ADD, tools=calc)
        message = out.choices[0].message
        streamed = await client.chat.completions.create(model="policy", messages=ADD, tools=calc, stream=True)
        deltas = [tc async for chunk in streamed for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices]
        messages = ADD + [message.model_dump(exclude_none=True)] + [
            {"role": "tool", "tool_call_id": c.id, "content": str(eval_sum(c))} for c in message.tool_calls]
        await client.chat.completions.create(model="policy", messages=messages, tools=calc)
    finally:
        await client.close()
        await endpoint.aclose()
    assert out.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("calculate", {"expression": "2+3"}), ("calculate", {"expression": "4*5"})]
    assert len({c.id for c in message.tool_calls}) == 2
    # streamed: one tool-call delta per call, indexed in order
    assert [(d.index, json.loads(d.function.arguments)["expression"]) for d in deltas] == [(0, "2+3"), (1, "4*5")]
    # the third request continued the first's ids: both results in the one tool turn, in order
    rollout = session.trace.rollout()
    gen1, tool = rollout.steps[0], rollout.steps[1]
    assert [r.content for r in tool.tool_results] == ["5", "20"]
    assert [r.call_id for r in tool.tool_results] == [c.id for c in message.tool_calls]
    (p1, g1), _, (p3, _) = engine.requests
    assert p3 == p1 + g1.token_ids + tool.token_ids


async def test_the_endpoint_honours_parallel_tool_calls_false(caller, specs):
    calc = specs["calculator"]
    endpoint, engine, session, client = await serve(caller)
    try:
        out = await client.chat.completions.create(model="policy", messages=ADD, tools=calc,
                                                   parallel_tool_calls=False)
        with pytest.raises(openai.BadRequestError, match=r"parallel_tool_calls: .*\(got 'no'\)"):
            await client.chat.completions.create(model="policy", messages=ADD, tools=calc,
                                                 extra_body={"parallel_tool_calls": "no"})
    finally:
        await client.close()
        await endpoint.aclose()
    calls = out.choices[0].message.tool_calls
    assert [json.loads(c.function.arguments) for c in calls] == [{"expression": "2+3"}]
    assert out.choices[0].finish_reason == "tool_calls"
    (_, g1), *_ = engine.requests
    assert caller.tokenizer.decode(g1.token_ids).endswith("</tool_call>")


def eval_sum(c) -> int:
    """The 'tool' of the endpoint test: 2+3 or 4*5."""
    a, op, b = json.loads(c.function.arguments)["expression"]
    return int(a) + int(b) if op == "+" else int(a) * int(b)
