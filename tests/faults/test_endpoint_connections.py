"""The agent endpoint against slow, silent and vanishing clients, over raw sockets: a turn whose
answer the client never received is not recorded (its sampling is cancelled), idle and slowloris
connections are closed, a dropped upload prints nothing, and the endpoint keeps answering."""

import asyncio
import json

import httpx
import pytest

import materl as ml
from materl.engines.base import SamplingParams
from materl.rollout.endpoint import AgentEndpoint, AgentSession

USER = [{"role": "user", "content": "hi"}]


class Held:
    """The agent's real engine; ``started`` is set when a request reaches it."""

    def __init__(self, engine):
        self.engine, self.started, self.finished, self.cancelled = engine, asyncio.Event(), 0, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate(self, prompt_ids, params):
        self.started.set()
        try:
            await asyncio.sleep(0.5)  # a turn that takes a while to sample
            gen = await self.engine.generate(prompt_ids, params)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.finished += 1
        return gen


async def serve(engine_of=lambda e: e, **options):
    agent = ml.Agent("tiny-random")
    endpoint = AgentEndpoint(**options)
    await endpoint.start()
    engine = engine_of(agent.engine)
    session = AgentSession(engine, agent.tokenizer, lambda k: SamplingParams(max_new_tokens=4, seed=k))
    return endpoint, engine, session, endpoint.open("episode-0", session)


def request_bytes(key: str, body: dict, port: int) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    """True once the server closed the connection (EOF), reading whatever it sent before."""
    try:
        while await asyncio.wait_for(reader.read(65536), timeout=30):
            pass
    except ConnectionResetError:
        pass
    return True


@pytest.mark.parametrize("stream", [False, True])
async def test_a_turn_the_client_never_received_is_not_recorded(stream):
    endpoint, engine, session, key = await serve(Held)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", endpoint.port)
        writer.write(request_bytes(key, {"model": "policy", "messages": USER, "stream": stream}, endpoint.port))
        await writer.drain()
        await engine.started.wait()  # the turn is being sampled ...
        writer.close()  # ... and the client goes away (a timeout, an abandoned stream)
        await writer.wait_closed()
        for _ in range(200):
            if engine.cancelled or engine.finished:
                break
            await asyncio.sleep(0.05)
        # the agent asks again, as a client that timed out would
        async with httpx.AsyncClient(base_url=endpoint.base_url, headers={"authorization": f"Bearer {key}"}) as http:
            again = await http.post("/chat/completions", json={"model": "policy", "messages": USER})
    finally:
        await endpoint.aclose()
    assert engine.cancelled == 1  # the abandoned turn's sampling was cancelled
    assert again.status_code == 200
    rollout = session.trace.rollout()
    # one request answered, one segment: the abandoned turn left nothing behind
    assert session.trace.requests == 1 and rollout.metadata["num_segments"] == 1 and rollout.num_turns == 1
    assert session.errors == []


async def test_idle_slowloris_and_kept_alive_connections_are_closed(capfd):
    endpoint, _, session, key = await serve(read_timeout_s=0.5, keep_alive_s=0.5)
    try:
        idle = [await asyncio.open_connection("127.0.0.1", endpoint.port) for _ in range(20)]
        slow = [await asyncio.open_connection("127.0.0.1", endpoint.port) for _ in range(20)]
        for _, writer in slow:  # headers that never end, a few bytes at a time
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        for _ in range(3):
            await asyncio.sleep(0.2)
            for _, writer in slow:
                writer.write(b"X-A: b\r\n")
        answered = await asyncio.open_connection("127.0.0.1", endpoint.port)  # kept alive after an answer
        answered[1].write(request_bytes(key, {"model": "policy", "messages": USER}, endpoint.port))
        results = await asyncio.gather(*[closed_by_server(r) for r, _ in idle + slow + [answered]])
        async with httpx.AsyncClient(base_url=endpoint.base_url, headers={"authorization": f"Bearer {key}"}) as http:
            after = await http.post("/chat/completions", json={"model": "policy", "messages": USER})
    finally:
        await endpoint.aclose()
    assert all(results) and len(results) == 41
    assert after.status_code == 200 and session.trace.requests == 2 and session.errors == []
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err


async def test_a_dropped_upload_prints_nothing_and_fails_nothing(capfd):
    endpoint, engine, session, key = await serve()
    try:
        for _ in range(5):
            reader, writer = await asyncio.open_connection("127.0.0.1", endpoint.port)
            whole = request_bytes(key, {"model": "policy", "messages": [{"role": "user", "content": "x" * 5000}]},
                                  endpoint.port)
            writer.write(whole[: len(whole) // 2])  # half the body, then the client vanishes
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.close()
            await writer.wait_closed()
        await asyncio.sleep(0.3)
        async with httpx.AsyncClient(base_url=endpoint.base_url, headers={"authorization": f"Bearer {key}"}) as http:
            after = await http.post("/chat/completions", json={"model": "policy", "messages": USER})
    finally:
        await endpoint.aclose()
    assert after.status_code == 200 and session.trace.requests == 1 and session.errors == []
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "Exception" not in out + err


async def test_an_unknown_path_names_what_is_served():
    endpoint, _, _, key = await serve()
    try:
        async with httpx.AsyncClient(base_url=endpoint.base_url, headers={"authorization": f"Bearer {key}"}) as http:
            legacy = await http.post("/completions", json={"model": "policy", "prompt": "hi"})
            wrong_method = await http.get("/chat/completions")
    finally:
        await endpoint.aclose()
    assert legacy.status_code == 404
    message = legacy.json()["error"]["message"]
    assert "POST /v1/completions is not served" in message
    assert all(r in message for r in ("GET /v1/models", "POST /v1/chat/completions", "POST /v1/responses"))
    assert wrong_method.status_code == 405 and "POST" in wrong_method.json()["error"]["message"]
