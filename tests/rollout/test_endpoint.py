"""The OpenAI-compatible endpoint, driven by the real ``openai`` client: tool calls parsed from
what the model sampled, streaming, one key per episode, exact ids across turns (never
re-tokenized), a rewritten history as a new segment, and malformed requests refused."""

import asyncio
import json

import httpx
import openai
import pytest

import materl as ml
from materl.engines.base import SamplingParams
from materl.rollout.endpoint import AgentEndpoint, AgentSession
from materl.rollout.multiturn import EpisodeState, encode
from tests.rollout.taught import Recording, teach

CALC = {"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
QUESTION = [{"role": "user", "content": "What is 2+3?"}]
CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2+3"}}\n</tool_call>'


@pytest.fixture(scope="module")
def caller():
    """A tiny model taught to answer QUESTION (with the calculator's schema) with CALL."""
    agent = ml.Agent("tiny-random")
    teach(agent, [(EpisodeState.start(agent.tokenizer, QUESTION, tools=[CALC]).ids, CALL)])
    return agent


def greedy(k: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=96, greedy=True, seed=k)


async def serve(agent, sampling=greedy):
    endpoint = AgentEndpoint()
    await endpoint.start()
    engine = Recording(agent.engine)
    session = AgentSession(engine, agent.tokenizer, sampling)
    key = endpoint.open("episode-0", session)
    return endpoint, engine, session, openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=key, max_retries=0)


async def tool_loop(client, *, stream: bool) -> list:
    """An agent's usual loop: ask, run the tools the model called, send their results, ask again."""
    messages, replies = list(QUESTION), []
    for _ in range(2):
        if stream:
            message, finish = await streamed(client, messages)
        else:
            out = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
            message, finish = out.choices[0].message.model_dump(exclude_none=True), out.choices[0].finish_reason
        replies.append((message, finish))
        messages.append(message)
        for call in message.get("tool_calls", []):
            args = json.loads(call["function"]["arguments"])
            result = str(sum(int(x) for x in args["expression"].split("+")))  # the "tool": 2+3 -> 5
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        if not message.get("tool_calls"):
            break
    return replies


async def streamed(client, messages):
    """Assemble a streamed answer from its chunks, as OpenAI's docs show."""
    content, calls, finish = "", {}, None
    stream = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC], stream=True)
    async for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            slot["id"] += tc.id or ""
            slot["function"]["name"] += tc.function.name or ""
            slot["function"]["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    message = {"role": "assistant", "content": content or None, "tool_calls": [calls[i] for i in sorted(calls)]}
    return {k: v for k, v in message.items() if v}, finish


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tool_loop_over_the_openai_client_trains_on_the_sampled_ids(caller, stream):
    endpoint, engine, session, client = await serve(caller)
    try:
        replies = await tool_loop(client, stream=stream)
    finally:
        await client.close()
        await endpoint.aclose()
    (first, finish), second = replies[0], replies[1]
    # the answer's tool call is parsed from the sampled text by materl's hermes parser
    assert finish == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in first["tool_calls"]] == [
        ("calculate", {"expression": "2+3"})]
    rollout = session.trace.rollout()
    assert [s.kind for s in rollout.steps] == ["generate", "tool", "generate"]
    (p1, g1), (p2, g2) = engine.requests
    gen1, tool, gen2 = rollout.steps
    # every generate step holds exactly the engine's ids and log-probs; prompts and tool glue untrained
    assert (gen1.token_ids, gen1.logprobs, gen2.token_ids, gen2.logprobs) == (g1.token_ids, g1.logprobs,
                                                                              g2.token_ids, g2.logprobs)
    assert rollout.prompt_ids == p1
    # request 2 continued request 1's ids: prompt + sampled + only the tool turn's template text
    assert p2 == p1 + g1.token_ids + tool.token_ids
    assert rollout.loss_mask == [1] * len(g1.token_ids) + [0] * len(tool.token_ids) + [1] * len(g2.token_ids)
    tok = caller.tokenizer
    # parallel tool calls (OpenAI's default): the turn ran past "</tool_call>" to the model's own
    # end of turn, which is trained; the glue starts after it
    assert tok.decode(g1.token_ids).endswith("</tool_call><|im_end|>")
    assert tok.decode(tool.token_ids) == ("\n<|im_start|>tool\n<tool_response>\n5\n</tool_response>"
                                          "<|im_end|>\n<|im_start|>assistant\n")
    assert [(r.name, r.content, r.call_id) for r in tool.tool_results] == [("calculate", "5", first["tool_calls"][0]["id"])]
    assert rollout.metadata["num_segments"] == 1 and rollout.metadata["requests"] == 2
    assert second[1] in ("stop", "length", "tool_calls")


async def test_exact_ids_where_re_tokenizing_the_text_would_change_them():
    """The random model samples bytes that are not valid UTF-8: its text decodes with U+FFFD, so
    tokenizing the returned text again gives other ids. The episode keeps the sampled ones."""
    agent = ml.Agent("tiny-random")
    endpoint, engine, session, client = await serve(agent, lambda k: SamplingParams(max_new_tokens=24, seed=7 + k))
    try:
        messages = [{"role": "user", "content": "hello"}]
        for _ in range(3):
            out = await client.chat.completions.create(model="policy", messages=messages)
            messages += [out.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    finally:
        await client.close()
        await endpoint.aclose()
    rollout = session.trace.rollout()
    sampled = [gen.token_ids for _, gen in engine.requests]
    assert [s.token_ids for s in rollout.generate_steps] == sampled
    tok = agent.tokenizer
    assert any(encode(tok, tok.decode(ids, skip_special_tokens=True)) != ids for ids in sampled)  # drift was possible
    assert rollout.metadata["num_segments"] == 1
    # the last request's prompt is the whole episode so far, exactly
    assert engine.requests[-1][0] == rollout.prompt_ids + rollout.completion_ids[:-len(sampled[-1])]


async def test_a_rewritten_history_starts_a_new_segment():
    agent = ml.Agent("tiny-random")
    endpoint, engine, session, client = await serve(agent, lambda k: SamplingParams(max_new_tokens=5, seed=k))
    try:
        first = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "a"}])
        reply = first.choices[0].message.model_dump(exclude_none=True)
        # continues: the same history plus a new user turn
        await client.chat.completions.create(model="policy", messages=[
            {"role": "user", "content": "a"}, reply, {"role": "user", "content": "b"}])
        # rewritten: the agent edited its first message (e.g. summarised its context)
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "a, shorter"}])
    finally:
        await client.close()
        await endpoint.aclose()
    rollout = session.trace.rollout()
    assert rollout.metadata["num_segments"] == 2 and rollout.metadata["requests"] == 3
    first_segment, second_segment = rollout.metadata["segments"]
    assert [s.kind for s in first_segment.steps] == ["generate", "tool", "generate"]
    assert second_segment is rollout and [s.kind for s in rollout.steps] == ["generate"]
    assert rollout.prompt_ids == engine.requests[2][0]
    assert rollout.prompt_ids == EpisodeState.start(agent.tokenizer, [{"role": "user", "content": "a, shorter"}]).ids


async def test_each_episode_has_its_own_key_and_an_unknown_key_is_refused():
    agent = ml.Agent("tiny-random")
    endpoint = AgentEndpoint()
    await endpoint.start()
    sessions = [AgentSession(agent.engine, agent.tokenizer, lambda k: SamplingParams(max_new_tokens=4, seed=k))
                for _ in range(2)]
    keys = [endpoint.open(f"ep-{i}", s) for i, s in enumerate(sessions)]
    clients = [openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=k, max_retries=0) for k in keys]
    try:
        await asyncio.gather(*[c.chat.completions.create(model="p", messages=[{"role": "user", "content": w}])
                               for c, w in zip(clients, ["left", "right"])])
        assert [s.trace.state.messages[0]["content"] for s in sessions] == ["left", "right"]
        assert [s.trace.requests for s in sessions] == [1, 1]
        models = await clients[0].models.list()
        assert [m.id for m in models.data] == ["policy"]
        stranger = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key="materl-guessed", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await stranger.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
        await stranger.close()
        await endpoint.end_episode("ep-0")  # an ended episode's key stops working
        with pytest.raises(openai.AuthenticationError):
            await clients[0].chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
    finally:
        for c in clients:
            await c.close()
        await endpoint.aclose()
    assert endpoint.port is not None and not endpoint.started


async def test_malformed_requests_are_refused_and_kept_on_the_session():
    agent = ml.Agent("tiny-random")
    endpoint, _, session, client = await serve(agent)
    key = client.api_key
    try:
        async with httpx.AsyncClient() as http:
            url, auth = endpoint.base_url + "/chat/completions", {"authorization": f"Bearer {key}"}
            bad_json = await http.post(url, content=b"{not json", headers=auth)
            no_list = await http.post(url, json={"model": "p", "messages": "hello"}, headers=auth)
            two = await http.post(url, json={"model": "p", "n": 2, "messages": QUESTION}, headers=auth)
            role = await http.post(url, json={"model": "p", "messages": [{"role": "wizard", "content": "x"}]},
                                   headers=auth)
    finally:
        await client.close()
        await endpoint.aclose()
    assert [r.status_code for r in (bad_json, no_list, two, role)] == [400] * 4
    assert "n=2" in two.json()["error"]["message"]
    assert len(session.errors) == 4 and "'wizard'" in session.errors[3]
    assert session.trace.requests == 0  # nothing was sampled for them


async def test_the_responses_api_continues_the_same_exact_token_record(caller):
    """``client.responses.create`` (the Responses API): the function call parsed from the sampled
    text comes back as a ``function_call`` item, and a request that sends it back with its
    ``function_call_output`` continues the same ids, as chat completions do."""
    endpoint, engine, session, client = await serve(caller)
    tools = [{"type": "function", "name": "calculate", "description": CALC["function"]["description"],
              "parameters": CALC["function"]["parameters"]}]
    try:
        first = await client.responses.create(model="policy", input=QUESTION, tools=tools)
        (call,) = [item for item in first.output if item.type == "function_call"]
        follow_up = QUESTION + [{"type": "function_call", "call_id": call.call_id, "name": call.name,
                                 "arguments": call.arguments},
                                {"type": "function_call_output", "call_id": call.call_id, "output": "5"}]
        second = await client.responses.create(model="policy", input=follow_up, tools=tools,
                                               parallel_tool_calls=False, tool_choice="required")
    finally:
        await client.close()
        await endpoint.aclose()
    assert (call.name, json.loads(call.arguments)) == ("calculate", {"expression": "2+3"})
    assert first.usage.output_tokens == len(engine.requests[0][1].token_ids)
    assert second.output and second.status == "completed"
    assert (first.parallel_tool_calls, first.tool_choice) == (True, "auto")  # the request's settings, echoed
    assert (second.parallel_tool_calls, second.tool_choice) == (False, "required")
    assert [(t.name, t.parameters) for t in second.tools] == [("calculate", CALC["function"]["parameters"])]
    rollout = session.trace.rollout()
    (p1, g1), (p2, g2) = engine.requests
    assert [s.kind for s in rollout.steps] == ["generate", "tool", "generate"]
    assert p2 == p1 + g1.token_ids + rollout.steps[1].token_ids  # continued, never re-tokenized
    assert [(r.name, r.content) for r in rollout.steps[1].tool_results] == [("calculate", "5")]
    assert rollout.metadata["num_segments"] == 1
