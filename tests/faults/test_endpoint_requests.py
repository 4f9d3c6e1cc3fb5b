"""The agent endpoint under malformed, oversized and over-long requests, sent by real HTTP clients
(httpx, the openai client) to the real endpoint: each is refused with a 4xx naming what is wrong,
fails only its own episode (the reason on the session, so the op fails that episode), never
reaches the engine, records nothing and prints nothing; episodes batched with it go on."""

import json
import threading

import anyio
import httpx
import openai
import pytest

import materl as ml
from materl.agent import model_context
from materl.compiler.compiled import Compiled
from materl.compiler.options import CompileOptions
from materl.engines.base import SamplingParams
from materl.rollout.endpoint import AgentEndpoint, AgentSession
from tests.rollout.taught import Recording

USER = [{"role": "user", "content": "hi"}]


def with_messages(**fields):
    return {"model": "policy", "messages": USER, **fields}


def assistant_with(tool_calls):
    return {"model": "policy", "messages": [*USER, {"role": "assistant", "content": "x", "tool_calls": tool_calls},
                                            {"role": "user", "content": "more"}]}


# each: the body and a word the error must name (the field, or what is wrong)
MALFORMED = [
    (with_messages(stop=[1, 2]), "stop"),
    (with_messages(stop={"a": 1}), "stop"),
    (with_messages(temperature="hot"), "temperature"),
    (with_messages(top_p=7), "top_p"),
    (with_messages(max_tokens=0), "max_tokens"),
    (with_messages(stream="yes"), "stream"),
    (with_messages(stream_options="x"), "stream_options"),
    (with_messages(n=2), "n=2"),
    (with_messages(logprobs=True), "logprobs"),
    (with_messages(tools="calculator"), "tools"),
    (with_messages(stop=[str(i) for i in range(40)]), "stop"),
    (assistant_with("x"), "tool_calls"),
    (assistant_with(5), "tool_calls"),
    (assistant_with([None]), "tool_calls"),
    (assistant_with({"function": "x"}), "tool_calls"),
    (assistant_with([{"function": "x"}]), "function"),
    ({"model": "policy", "messages": "hello"}, "messages"),
    ({"model": "policy", "messages": []}, "messages"),
    ({"model": "policy", "messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"model": "policy", "messages": [{"role": "user", "content": 5}]}, "content"),
    ({"model": "policy"}, "messages"),
    ([1, 2], "object"),
]
RAW = [(b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e999}', "max_tokens"),
       (b"{not json", "Invalid JSON"), (b"[" * 100_000 + b"]" * 100_000, "recursion"), (b"", "Invalid JSON")]


async def serve(agent, **endpoint_options):
    endpoint = AgentEndpoint(**endpoint_options)
    await endpoint.start()
    engine = Recording(agent.engine)
    session = AgentSession(engine, agent.tokenizer, lambda k: SamplingParams(max_new_tokens=4, seed=k),
                           context_tokens=model_context(agent))
    return endpoint, engine, session, endpoint.open("episode-0", session)


async def test_malformed_requests_are_refused_before_anything_is_sampled_or_recorded(capfd):
    agent = ml.Agent("tiny-random")
    endpoint, engine, session, key = await serve(agent)
    auth = {"authorization": f"Bearer {key}"}
    try:
        async with httpx.AsyncClient(base_url=endpoint.base_url, headers=auth) as http:
            answers = [await http.post("/chat/completions", json=body) for body, _ in MALFORMED]
            answers += [await http.post("/chat/completions", content=body) for body, _ in RAW]
            fine = await http.post("/chat/completions", json=with_messages(stop=["\n"], max_tokens=3))
    finally:
        await endpoint.aclose()
    cases = MALFORMED + RAW
    for (body, word), answer in zip(cases, answers):
        assert answer.status_code == 400, (body, answer.text)
        assert word in answer.json()["error"]["message"], (word, answer.json())
    assert len(session.errors) == len(cases)  # each fails the episode it came from ...
    assert engine.requests[:-1] == [] and len(engine.requests) == 1  # ... and none reached the engine
    assert fine.status_code == 200 and session.trace.requests == 1  # the endpoint still answers
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "Exception in ASGI" not in out + err


async def test_a_null_tool_calls_field_is_an_absent_one():
    """OpenAI's API reads ``null`` as an absent optional field; so does the endpoint."""
    agent = ml.Agent("tiny-random")
    endpoint, _, session, key = await serve(agent)
    try:
        async with httpx.AsyncClient(base_url=endpoint.base_url, headers={"authorization": f"Bearer {key}"}) as http:
            answer = await http.post("/chat/completions", json=assistant_with(None))
    finally:
        await endpoint.aclose()
    assert answer.status_code == 200 and session.errors == []


async def bad_stop(client, task):
    """Sends ``stop=[1, 2]`` through the real openai client (which does not check types)."""
    stop = [1, 2] if task["prompt"] == "bad" else None
    out = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task["prompt"]}],
                                               stop=stop)
    return out.choices[0].message.content


@ml.recipe
def bad_neighbour(policy, prompts):
    ml.agent_episodes(policy, prompts, agent=bad_stop, name="rollout")


async def test_one_bad_request_fails_only_its_own_episode_not_the_batch_it_would_join(capfd):
    compiled = Compiled(bad_neighbour, {"policy": ml.Agent("tiny-random")},
                        CompileOptions(group_size=1, max_new_tokens=6, max_failed_fraction=1.0), rollout_only=True)
    try:
        episodes = await compiled.rollout(["ok 1", "bad", "ok 2", "ok 3"])
    finally:
        await compiled.aclose()
    by_prompt = {ep.prompt: ep for ep in episodes}
    assert all(by_prompt[p].error is None and by_prompt[p].values["rollout"].num_turns == 1
               for p in ("ok 1", "ok 2", "ok 3"))
    error = by_prompt["bad"].error
    assert (error.node, error.kind) == ("rollout", "EpisodeError")
    assert "stop" in error.message and "got [1, 2]" in error.message
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err


async def test_a_body_over_the_limit_is_a_413_before_it_is_read():
    agent = ml.Agent("tiny-random")
    endpoint, engine, session, key = await serve(agent, max_request_bytes=64 * 1024)
    body = json.dumps(with_messages(messages=[{"role": "user", "content": "x" * 100_000}])).encode()

    async def chunked():  # no Content-Length: the limit applies while it arrives
        for i in range(0, len(body), 8192):
            yield body[i:i + 8192]

    try:
        async with httpx.AsyncClient(base_url=endpoint.base_url, headers={"authorization": f"Bearer {key}"}) as http:
            sized = await http.post("/chat/completions", content=body)
            streamed = await http.post("/chat/completions", content=chunked())
    finally:
        await endpoint.aclose()
    assert sized.status_code == streamed.status_code == 413
    assert f"{len(body):,} bytes" in sized.json()["error"]["message"]
    assert "65,536 bytes" in streamed.json()["error"]["message"]
    assert len(session.errors) == 2 and engine.requests == [] and session.trace.requests == 0


async def test_a_prompt_that_does_not_fit_the_model_is_refused_not_sampled():
    agent = ml.Agent("tiny-random")
    positions = model_context(agent)  # 4096 for the tiny model
    endpoint, engine, session, key = await serve(agent)
    long = " ".join(["word"] * 6000)  # ~6k tokens
    try:
        async with httpx.AsyncClient(base_url=endpoint.base_url, headers={"authorization": f"Bearer {key}"}) as http:
            too_long = await http.post("/chat/completions", json=with_messages(messages=[{"role": "user",
                                                                                          "content": long}]))
            too_much = await http.post("/chat/completions", json=with_messages(max_tokens=positions))
            fits = await http.post("/chat/completions", json=with_messages(max_tokens=2))
    finally:
        await endpoint.aclose()
    assert too_long.status_code == too_much.status_code == 400
    assert f"the model has {positions:,} positions" in too_long.json()["error"]["message"]
    assert f"max_tokens={positions}" in too_much.json()["error"]["message"]
    assert fits.status_code == 200 and len(engine.requests) == 1 and len(engine.requests[0][1].token_ids) <= 2


class ThreadsSeen:
    """The tiny model's tokenizer, noting the thread of every chat-template rendering."""

    def __init__(self, tokenizer):
        self._tok, self.threads = tokenizer, []

    def apply_chat_template(self, messages, *args, **kwargs):
        size = sum(len(str(m.get("content") or "")) for m in messages)
        self.threads.append((threading.current_thread(), size))
        return self._tok.apply_chat_template(messages, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, *args, **kwargs):
        return self._tok(*args, **kwargs)


async def test_a_megabyte_request_is_tokenized_off_the_loop_while_other_episodes_are_answered():
    agent = ml.Agent("tiny-random")
    endpoint = AgentEndpoint()
    await endpoint.start()
    tok = ThreadsSeen(agent.tokenizer)
    sessions = [AgentSession(agent.engine, tok, lambda k: SamplingParams(max_new_tokens=4, seed=k),
                             context_tokens=model_context(agent)) for _ in range(2)]
    keys = [endpoint.open(f"episode-{i}", s) for i, s in enumerate(sessions)]
    finished = []
    big = [{"role": "user", "content": "lorem ipsum dolor " * 60_000}]  # ~1 MB

    async def ask(key, messages, name):
        client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=key, max_retries=0, timeout=120)
        try:
            await client.chat.completions.create(model="policy", messages=messages)
        except openai.BadRequestError:
            pass
        finally:
            await client.close()
        finished.append(name)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ask, keys[0], big, "big")
            await anyio.sleep(0.2)  # the big request is in the endpoint's hands
            tg.start_soon(ask, keys[1], USER, "small")
    finally:
        await endpoint.aclose()
    # the small episode was answered while the big one was still being tokenized (then refused:
    # far more tokens than the model's 4,096 positions)
    assert finished == ["small", "big"]
    assert "positions" in sessions[0].errors[0] and sessions[1].trace.requests == 1
    # the megabyte was rendered and tokenized in a worker thread (small requests stay in the loop)
    big_renders = [t for t, size in tok.threads if size > 100_000]
    assert big_renders and all(t is not threading.main_thread() for t in big_renders)
