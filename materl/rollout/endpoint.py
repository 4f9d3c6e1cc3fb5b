"""An OpenAI-compatible chat endpoint served by the policy's engine, for agent code that talks to
a model through the OpenAI API (``ml.agent_episodes``).

    endpoint = AgentEndpoint()
    await endpoint.start()                                   # 127.0.0.1, an ephemeral port
    session = AgentSession(engine, tokenizer, sampling_of_request)
    key = endpoint.open(episode_uid, session)
    client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=key)
    ...                                                      # the agent runs
    endpoint.close(key)
    rollout = session.trace.rollout()

Routes: ``GET /v1/models`` and ``POST /v1/chat/completions`` (``tools=`` rendered by the model's
chat template; ``tool_calls`` parsed from the sampled text by materl's parser for the model's
format, every call of the turn in the order the model wrote them (``parallel_tool_calls=false``:
the turn stops after its first call, see ``episode.model_turn``); ``stream=True`` answers with Server-Sent Events in OpenAI's chunk format, sent once the
turn is sampled). Every episode has its own bearer key, so concurrent episodes never share a
token record; a missing or unknown key is a 401. A malformed request is a 400, and the error is
also kept on the session so the op fails that episode (``AgentSession.errors``).

Sampling settings are the recipe's (temperature, top-p/k, the per-request seed): the learner's
importance ratios assume the distribution the tokens were sampled from, so a request's
``temperature``/``top_p``/``seed`` do not change them. ``max_tokens``/``max_completion_tokens`` cap the
turn below the recipe's ``max_new_tokens`` and ``stop`` adds stop strings. ``n`` other than 1
and ``logprobs`` requests are refused (400). Fields that constrain decoding (``tool_choice``,
``response_format``, ``logit_bias``) are not enforced: the answer is what the policy samples.
The server binds 127.0.0.1 only.
(AReaL's proxy server, prime-rl's interception server and ART's client play this part.)
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import anyio

from materl.engines.base import SamplingParams
from materl.errors import EpisodeError, MaterlError
from materl.rollout.agent_trace import AgentTrace
from materl.rollout.episode import model_turn
from materl.rollout.http_pools import Pools

HOST = "127.0.0.1"


@dataclass
class AgentSession:
    """One episode's view of the endpoint: the engine and tokenizer it samples with, the
    sampling settings of its k-th request, and its token record."""

    engine: Any
    tokenizer: Any
    sampling: Callable[[int], SamplingParams]
    parser: str = "auto"
    model: str = "policy"
    trace: AgentTrace = None  # type: ignore[assignment]
    errors: list[str] = field(default_factory=list)
    lock: anyio.Lock = field(default_factory=anyio.Lock)

    def __post_init__(self):
        if self.trace is None:
            self.trace = AgentTrace(self.tokenizer)


class BadRequest(EpisodeError):
    """A chat request the endpoint cannot answer (HTTP 400)."""


class AgentEndpoint:
    """The HTTP server (Starlette on uvicorn) in the event loop of the rollout; see the module
    docstring. ``start``/``aclose``/``end_episode``/``started`` are the service methods the
    compiled step calls on it, as on a Toolbox."""

    def __init__(self):
        self.sessions: dict[str, AgentSession] = {}
        self._by_episode: dict[str, list[str]] = {}
        self._server = None
        self._task: asyncio.Task | None = None
        self._http: Pools | None = None  # the episodes' clients' shared connection pools
        self.port: int | None = None

    def __getstate__(self):  # a worker process starts its own server
        return {}

    def __setstate__(self, state):
        self.__init__()

    def __repr__(self) -> str:
        return f"AgentEndpoint({self.base_url if self.started else 'not started'})"

    @property
    def started(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}/v1"

    async def start(self) -> None:
        import uvicorn

        if self.started:
            return
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # accepted connections inherit it: without, a response's body waits ~40 ms behind its headers
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((HOST, 0))
        self.port = sock.getsockname()[1]
        # idle keep-alive connections stay open: the episodes' shared pool reuses them, and a
        # server closing one as a client sends on it is a failed request (clients do not retry)
        config = uvicorn.Config(self.app(), lifespan="off", log_level="warning", access_log=False,
                                timeout_graceful_shutdown=1, timeout_keep_alive=3600)
        self._server = uvicorn.Server(config)
        self._task = asyncio.get_running_loop().create_task(self._serve(sock))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the start-up error
            await asyncio.sleep(0.005)

    async def _serve(self, sock: socket.socket) -> None:
        """uvicorn's ``Server.serve`` without its signal capture (the loop may be a thread's)."""
        server, config = self._server, self._server.config
        config.load()
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[sock])
        if not server.should_exit:
            await server.main_loop()
        if server.started:
            await server.shutdown(sockets=[sock])
        sock.close()

    async def aclose(self) -> None:
        if self._task is not None:
            self._server.should_exit = True
            await self._task
            self._task = None
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    def client(self, key: str, *, timeout_s: float):
        """An ``openai.AsyncOpenAI`` for one episode's key. The episodes take turns on a few shared
        connection pools (``materl.rollout.http_pools``), which the agent's ``client.close()``
        leaves open (building a client's own pool costs ~0.1 s of CPU, more than a tiny model's turn)."""
        import openai

        if self._http is None:
            self._http = Pools(_shared_pool(openai.DefaultAsyncHttpxClient))
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=timeout_s,
                                  http_client=self._http.next())

    def open(self, episode_uid: str, session: AgentSession) -> str:
        """A fresh bearer key for ``session`` (one per episode)."""
        key = "materl-" + secrets.token_urlsafe(24)
        self.sessions[key] = session
        self._by_episode.setdefault(episode_uid, []).append(key)
        return key

    def close(self, key: str) -> None:
        self.sessions.pop(key, None)

    async def end_episode(self, episode_uid: str) -> None:
        """The episode ended (finished, failed or timed out): its keys stop working."""
        for key in self._by_episode.pop(episode_uid, []):
            self.sessions.pop(key, None)

    # -- HTTP ----------------------------------------------------------------------------------

    def app(self):
        from starlette.applications import Starlette
        from starlette.routing import Route

        return Starlette(routes=[Route("/v1/models", self._models, methods=["GET"]),
                                 Route("/v1/chat/completions", self._chat, methods=["POST"])])

    def _session(self, request) -> AgentSession | None:
        auth = request.headers.get("authorization", "")
        key = auth[len("Bearer "):] if auth.startswith("Bearer ") else ""
        return self.sessions.get(key)

    async def _models(self, request):
        session = self._session(request)
        if session is None:
            return _error(401, "invalid_api_key", "unknown or missing API key (each episode has its own)")
        return _json({"object": "list", "data": [{"id": session.model, "object": "model", "created": 0,
                                                  "owned_by": "materl"}]})

    async def _chat(self, request):
        session = self._session(request)
        if session is None:
            return _error(401, "invalid_api_key", "unknown or missing API key (each episode has its own)")
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict):
                raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
            async with session.lock:  # one episode's requests are one sequence
                reply, usage, finish = await self._answer(session, body)
        except (EpisodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            return _failed(session, 400, exc)
        except MaterlError as exc:  # the engine or the chat template failed: not the request's fault
            return _failed(session, 500, exc)
        out_id = f"chatcmpl-{secrets.token_hex(8)}"
        if body.get("stream"):
            return _stream(out_id, session.model, reply, finish, usage, body)
        return _json({"id": out_id, "object": "chat.completion", "created": int(time.time()), "model": session.model,
                      "choices": [{"index": 0, "message": reply, "finish_reason": finish, "logprobs": None}],
                      "usage": usage})

    async def _answer(self, session: AgentSession, body: dict) -> tuple[dict, dict, str]:
        messages, tools = body.get("messages"), body.get("tools")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise BadRequest(f"'messages' must be a list of message objects, got {messages!r:.200}")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise BadRequest(f"'tools' must be a list of tool objects, got {tools!r:.200}")
        if body.get("n", 1) not in (1, None) or body.get("logprobs"):
            raise BadRequest(f"n={body.get('n')!r}, logprobs={body.get('logprobs')!r}: the endpoint answers n=1 "
                             f"without logprobs")
        params = session.sampling(session.trace.requests)
        cap = body.get("max_completion_tokens") or body.get("max_tokens")
        stop = body.get("stop") or ()
        params = replace(params, max_new_tokens=min(params.max_new_tokens, int(cap)) if cap else params.max_new_tokens,
                         stop_strings=tuple(params.stop_strings) + ((stop,) if isinstance(stop, str) else tuple(stop)))
        parallel = body.get("parallel_tool_calls", True)
        if not isinstance(parallel, bool):
            raise BadRequest(f"'parallel_tool_calls' must be true or false, got {parallel!r:.200}")
        state = session.trace.context(messages, tools)
        result = await model_turn(session.engine, session.tokenizer, state, params, parser=session.parser,
                                  parallel_tool_calls=parallel)
        reply = session.trace.record(result, messages)
        n_out = len(result.step.token_ids)
        usage = {"prompt_tokens": len(state.ids), "completion_tokens": n_out, "total_tokens": len(state.ids) + n_out}
        finish = "tool_calls" if reply.get("tool_calls") else "length" if n_out >= params.max_new_tokens else "stop"
        return reply, usage, finish


def _shared_pool(base: type) -> type:
    """The openai package's httpx client class, with ``aclose`` left to its owner (``close_pool``)."""

    class SharedPool(base):
        async def aclose(self) -> None:  # an episode's client.close(): the pool stays open
            return None

        async def close_pool(self) -> None:
            await base.aclose(self)

    return SharedPool


def _json(payload: dict, status: int = 200):
    from starlette.responses import JSONResponse

    return JSONResponse(payload, status_code=status)


def _failed(session: AgentSession, status: int, exc: Exception):
    """Answer an error and keep it on the session, so the episode fails with it."""
    message = f"{type(exc).__name__}: {exc}"
    session.errors.append(message)
    return _error(status, "invalid_request_error" if status == 400 else "server_error", message)


def _error(status: int, code: str, message: str):
    return _json({"error": {"message": message, "type": "invalid_request_error", "code": code}}, status)


def _stream(out_id: str, model: str, reply: dict, finish: str, usage: dict, body: dict):
    """The answer as OpenAI ``chat.completion.chunk`` events: role, content, each tool call, the
    finish reason (and usage when ``stream_options.include_usage``), then ``[DONE]``."""
    from starlette.responses import StreamingResponse

    base = {"id": out_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}

    def chunk(delta: dict, finish_reason: str | None = None) -> str:
        return "data: " + json.dumps({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                                                           "logprobs": None}]}) + "\n\n"

    events = [chunk({"role": "assistant", "content": ""})]
    if reply.get("content"):
        events.append(chunk({"content": reply["content"]}))
    for i, call in enumerate(reply.get("tool_calls") or []):
        events.append(chunk({"tool_calls": [{"index": i, **call}]}))
    events.append(chunk({}, finish))
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append("data: " + json.dumps({**base, "choices": [], "usage": usage}) + "\n\n")
    events.append("data: [DONE]\n\n")

    async def gen():
        for event in events:
            yield event

    return StreamingResponse(gen(), media_type="text/event-stream")
