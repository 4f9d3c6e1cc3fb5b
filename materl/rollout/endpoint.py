"""An OpenAI-compatible endpoint served by the policy's engine, for agent code that talks to a
model through the OpenAI API (``ml.agent_episodes``).

    endpoint = AgentEndpoint()
    await endpoint.start()                                   # 127.0.0.1, an ephemeral port
    session = AgentSession(engine, tokenizer, sampling_of_request)
    key = endpoint.open(episode_uid, session)
    client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=key)
    ...                                                      # the agent runs
    endpoint.close(key)
    rollout = session.trace.rollout()

Routes: ``GET /v1/models``, ``POST /v1/chat/completions`` (``tools=`` rendered by the model's
chat template; ``tool_calls`` parsed from the sampled text by materl's parser for the model's
format, every call of the turn in the order the model wrote them (``parallel_tool_calls=false``:
the turn stops after its first call, see ``episode.model_turn``); ``stream=True`` answers with Server-Sent Events in OpenAI's chunk format, sent once the
turn is sampled) and ``POST /v1/responses`` (the Responses API, which the OpenAI Agents SDK and
newer OpenAI code default to: text and function-call items, not streamed; it continues the same
exact-token record). Any other path is a 404 naming these. Every episode has its own bearer key,
so concurrent episodes never share a token record; a missing or unknown key is a 401.

Bad requests fail their own episode and nothing else. A request is validated against OpenAI's
schema before anything is tokenized, sampled or recorded (``materl.rollout.endpoint_schema``):
a wrong type, an unknown role, ``n`` other than 1, ``logprobs``, a prompt that with
``max_tokens`` does not fit the model's positions is a 400; a body over ``max_request_bytes`` a
413. The error is answered and kept on the session, so the op fails that episode with it
(``AgentSession.errors``); the terminal shows nothing. A large request (over 64 KiB) is
parsed and tokenized in a worker thread, so it does not hold up the other episodes. A turn is
recorded only once its answer was sent: a client that went away while its turn was sampled (a
timeout, an abandoned stream) leaves no turn behind, and its sampling is cancelled. Connections are bounded
(``materl.rollout.endpoint_http``): idle ones close after ``keep_alive_s``, a request must arrive
within ``read_timeout_s`` of its first byte.

Sampling settings are the recipe's (temperature, top-p/k, the per-request seed): the learner's
importance ratios assume the distribution the tokens were sampled from, so a request's
``temperature``/``top_p``/``seed`` do not change them. ``max_tokens``/``max_completion_tokens``
(``max_output_tokens``) cap the turn below the recipe's ``max_new_tokens`` and ``stop`` adds stop
strings. Fields that constrain decoding (``tool_choice``, ``response_format``, ``logit_bias``) are
not enforced: the answer is what the policy samples. The server binds 127.0.0.1 only.
(AReaL's proxy server, prime-rl's interception server and ART's client play this part.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

import anyio

from materl.engines.base import SamplingParams
from materl.errors import EpisodeError, MaterlError
from materl.rollout import endpoint_http as http
from materl.rollout.agent_trace import AgentTrace, Turn
from materl.rollout.endpoint_schema import BadRequest, ChatRequest, ResponsesRequest, parse, responses_to_chat
from materl.rollout.multiturn import model_turn
from materl.rollout.http_pools import Pools
from materl.rollout.loop_watch import BLOCKED_AFTER_S, LoopWatch

HOST = "127.0.0.1"
MAX_REQUEST_BYTES = 8 * 2**20
INLINE_BYTES = 64 * 2**10  # smaller requests parse and tokenize in about a millisecond: not worth a thread
ROUTES = {"/v1/models": "GET", "/v1/chat/completions": "POST", "/v1/responses": "POST"}
log = logging.getLogger("materl")

__all__ = ["AgentEndpoint", "AgentSession", "BadRequest", "EndpointSpec"]


@dataclass
class AgentSession:
    """One episode's view of the endpoint: the engine and tokenizer it samples with, the
    sampling settings of its k-th request, its token record, and the model's positions
    (``context_tokens``: a prompt that with its ``max_tokens`` does not fit is refused)."""

    engine: Any
    tokenizer: Any
    sampling: Callable[[int], SamplingParams]
    parser: str = "auto"
    model: str = "policy"
    trace: AgentTrace = None  # type: ignore[assignment]
    errors: list[str] = field(default_factory=list)
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    context_tokens: int | None = None

    def __post_init__(self):
        if self.trace is None:
            self.trace = AgentTrace(self.tokenizer)


@dataclass(frozen=True)
class _Answer:
    turn: Turn
    usage: dict
    finish: str


@dataclass(frozen=True)
class EndpointSpec:
    """What ``ml.agent_episodes`` puts in its node: the endpoint's settings. ``build()`` makes
    the ``AgentEndpoint`` (a ``materl.rollout.services.ServiceSpec``); each compiled step and
    rollout worker builds its own, starts it with its services and closes it."""

    max_request_bytes: int = MAX_REQUEST_BYTES
    read_timeout_s: float = http.READ_TIMEOUT_S
    keep_alive_s: float = http.KEEP_ALIVE_S
    blocked_after_s: float = BLOCKED_AFTER_S

    def build(self) -> AgentEndpoint:
        return AgentEndpoint(max_request_bytes=self.max_request_bytes, read_timeout_s=self.read_timeout_s,
                             keep_alive_s=self.keep_alive_s, blocked_after_s=self.blocked_after_s)

    def __repr__(self) -> str:
        changed = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if getattr(self, f.name) != f.default]
        return f"AgentEndpoint({', '.join(changed)})"


class AgentEndpoint:
    """The HTTP server (uvicorn, a small ASGI app) in the event loop of the rollout; see the module
    docstring. An ``EpisodeService`` (``materl.rollout.services``): ``start``/``aclose``/
    ``end_episode``/``started`` are what the compiled step calls on it, as on a Toolbox."""

    def __init__(self, *, max_request_bytes: int = MAX_REQUEST_BYTES, read_timeout_s: float = http.READ_TIMEOUT_S,
                 keep_alive_s: float = http.KEEP_ALIVE_S, blocked_after_s: float = BLOCKED_AFTER_S):
        self.max_request_bytes, self.read_timeout_s, self.keep_alive_s = max_request_bytes, read_timeout_s, keep_alive_s
        self.watch = LoopWatch(after_s=blocked_after_s)  # an async agent holding the loop is reported
        self._sync_http = None  # the plain-def agents' clients' shared connection pool
        self.sessions: dict[str, AgentSession] = {}
        self._by_episode: dict[str, list[str]] = {}
        self._server = None
        self._task: asyncio.Task | None = None
        self._http: Pools | None = None  # the episodes' clients' shared connection pools
        self.port: int | None = None

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
        config = uvicorn.Config(self._app, lifespan="off", log_level="error", interface="asgi3", access_log=False,
                                http=http.bounded_h11(self.read_timeout_s), timeout_graceful_shutdown=1,
                                timeout_keep_alive=self.keep_alive_s)
        self._server = uvicorn.Server(config)
        self._task = asyncio.get_running_loop().create_task(self._serve(sock))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the start-up error
            await asyncio.sleep(0.005)
        self.watch.start()

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
        self.watch.stop()
        if self._task is not None:
            self._server.should_exit = True
            await self._task
            self._task = None
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if self._sync_http is not None:
            self._sync_http.close_pool()
            self._sync_http = None

    def client(self, key: str, *, timeout_s: float):
        """An ``openai.AsyncOpenAI`` for one episode's key. The episodes take turns on a few shared
        connection pools (``materl.rollout.http_pools``), which the agent's ``client.close()``
        leaves open (building a client's own pool costs ~0.1 s of CPU, more than a tiny model's turn)."""
        import openai

        if self._http is None:
            self._http = Pools(_shared_pool(openai.DefaultAsyncHttpxClient))
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=timeout_s,
                                  http_client=self._http.next())

    def sync_client(self, key: str, *, timeout_s: float):
        """An ``openai.OpenAI`` for one episode's key (a plain ``def`` agent, in a thread), on one
        connection pool that all of them share (httpx's is thread-safe)."""
        import openai

        if self._sync_http is None:
            base = openai.DefaultHttpxClient

            class SharedSyncPool(base):
                def close(self) -> None:  # an episode's client.close(): the pool stays open
                    return None

                def close_pool(self) -> None:
                    base.close(self)

            self._sync_http = SharedSyncPool()
        return openai.OpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=timeout_s,
                             http_client=self._sync_http)

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

    async def _app(self, scope, receive, send) -> None:
        """The ASGI app: route, authenticate, answer."""
        if scope["type"] != "http":
            return
        path, method = scope["path"].rstrip("/"), scope["method"]
        if path not in ROUTES:
            served = ", ".join(f"{m} {p}" for p, m in ROUTES.items())
            return await http.send_json(send, 404, _error_body(
                "not_found", f"{method} {scope['path']} is not served; this materl endpoint serves {served}"))
        if method != ROUTES[path]:
            return await http.send_json(send, 405, _error_body("method_not_allowed", f"{path} takes {ROUTES[path]}"))
        session = self._session(scope)
        if session is None:
            return await http.send_json(send, 401, _error_body(
                "invalid_api_key", "unknown or missing API key (each episode has its own)"))
        if path == "/v1/models":
            return await http.send_json(send, 200, {"object": "list", "data": [
                {"id": session.model, "object": "model", "created": 0, "owned_by": "materl"}]})
        try:
            body = await http.read_body(scope, receive, self.max_request_bytes)
        except http.Disconnected:
            return  # the client went away while uploading: nobody to answer
        except http.TooLarge as exc:
            return await _refuse(send, session, 413, exc)  # the rest of the body is read and dropped
        watch = http.Watch(receive)
        try:
            await self._answer(session, body, path == "/v1/responses", watch, send)
        finally:
            watch.stop()

    def _session(self, scope) -> AgentSession | None:
        auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        key = auth[len("Bearer "):] if auth.startswith("Bearer ") else ""
        return self.sessions.get(key)

    async def _answer(self, session: AgentSession, body: bytes, responses: bool, watch: http.Watch, send) -> None:
        """Validate, sample, send, and keep the turn once sent (module docstring)."""
        sent = http.Sent(send)
        try:
            off_loop = len(body) > INLINE_BYTES  # a large request is parsed and tokenized in a thread
            request = await _call(off_loop, _parse, body, responses)
            async with session.lock:  # one episode's requests are one sequence
                answer = await self._sample(session, request, watch, off_loop=off_loop)
                if answer is None:
                    return  # the client went away while its turn was sampled
                await _send_answer(sent, session, request, answer, responses)
                if not watch.gone.is_set():
                    session.trace.keep(answer.turn)
        except (EpisodeError, KeyError, TypeError, ValueError) as exc:  # the request's fault
            await _refuse(sent, session, getattr(exc, "status", 400), exc)
        except MaterlError as exc:  # the engine or the chat template failed: not the request's fault
            await _refuse(sent, session, 500, exc)
        except Exception as exc:  # noqa: BLE001 - fails the episode with it; one line on the log
            log.warning("agent endpoint: %s answering a request: %s", type(exc).__name__, exc)
            await _refuse(sent, session, 500, exc)

    async def _sample(self, session: AgentSession, request: ChatRequest, watch: http.Watch, *,
                      off_loop: bool) -> _Answer | None:
        if (request.n or 1) != 1 or request.logprobs:
            raise BadRequest(f"n={request.n!r}, logprobs={request.logprobs!r}: the endpoint answers n=1 "
                             f"without logprobs")
        params = session.sampling(session.trace.requests)
        params = replace(params, stop_strings=tuple(params.stop_strings) + request.stop_strings())
        messages, tools = request.message_dicts(), request.tool_dicts()
        state = await _call(off_loop, session.trace.context, messages, tools)
        params = replace(params, max_new_tokens=_room(session, len(state.ids), request.cap(), params.max_new_tokens))
        result = None
        with anyio.CancelScope() as scope:  # cancelled when the client goes away: the engine drops the request
            watch.cancels(scope)
            result = await model_turn(session.engine, session.tokenizer, state, params, parser=session.parser,
                                      parallel_tool_calls=request.parallel_tool_calls is not False)
        if result is None or watch.gone.is_set():
            return None
        turn = session.trace.answer(result, messages)
        n_out = len(result.step.token_ids)
        usage = {"prompt_tokens": len(state.ids), "completion_tokens": n_out, "total_tokens": len(state.ids) + n_out}
        finish = ("tool_calls" if turn.reply.get("tool_calls") else "length" if n_out >= params.max_new_tokens
                  else "stop")
        return _Answer(turn, usage, finish)


async def _call(off_loop: bool, fn, *args):
    return await anyio.to_thread.run_sync(fn, *args) if off_loop else fn(*args)


def _parse(body: bytes, responses: bool) -> ChatRequest:
    """The request as a chat request (a Responses request converted), validated."""
    return responses_to_chat(parse(ResponsesRequest, body)) if responses else parse(ChatRequest, body)


def _room(session: AgentSession, prompt: int, cap: int | None, max_new: int) -> int:
    """The turn's token limit: the recipe's, capped by the request's ``max_tokens``, refused when
    the prompt and that cap do not fit the model's positions."""
    limit = session.context_tokens
    if limit is not None and prompt + (cap or 1) > limit:
        asked = f" and max_tokens={cap}" if cap else ""
        raise BadRequest(f"the prompt is {prompt:,} tokens{asked}; the model has {limit:,} positions: shorten the "
                         f"messages{' or lower max_tokens' if cap else ''}")
    max_new = min(max_new, cap) if cap else max_new
    return min(max_new, limit - prompt) if limit is not None else max_new


def _shared_pool(base: type) -> type:
    """The openai package's httpx client class, with ``aclose`` left to its owner (``close_pool``)."""

    class SharedPool(base):
        async def aclose(self) -> None:  # an episode's client.close(): the pool stays open
            return None

        async def close_pool(self) -> None:
            await base.aclose(self)

    return SharedPool


async def _refuse(send, session: AgentSession, status: int, exc: Exception) -> None:
    """Answer an error (unless an answer already started) and keep it on the session, so the
    episode fails with it."""
    message = f"{type(exc).__name__}: {exc}"
    session.errors.append(message)
    if getattr(send, "started", False):
        return
    code = "invalid_request_error" if status < 500 else "server_error"
    await http.send_json(send, status, _error_body(code, message))


def _error_body(code: str, message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "code": code}}


async def _send_answer(send, session: AgentSession, request: ChatRequest, answer: _Answer, responses: bool) -> None:
    reply, created = answer.turn.reply, int(time.time())
    if responses:
        return await http.send_json(send, 200, _response_object(session.model, reply, answer.usage, created, request))
    out_id = f"chatcmpl-{secrets.token_hex(8)}"
    if request.stream:
        usage = answer.usage if request.stream_options and request.stream_options.include_usage else None
        return await http.send_events(send, _chunks(out_id, session.model, reply, answer.finish, usage, created))
    await http.send_json(send, 200, {
        "id": out_id, "object": "chat.completion", "created": created, "model": session.model,
        "choices": [{"index": 0, "message": reply, "finish_reason": answer.finish, "logprobs": None}],
        "usage": answer.usage})


def _chunks(out_id: str, model: str, reply: dict, finish: str, usage: dict | None, created: int) -> list[str]:
    """The answer as OpenAI ``chat.completion.chunk`` events: role, content, each tool call, the
    finish reason (and usage when ``stream_options.include_usage``), then ``[DONE]``."""
    base = {"id": out_id, "object": "chat.completion.chunk", "created": created, "model": model}

    def chunk(delta: dict, finish_reason: str | None = None) -> str:
        return "data: " + json.dumps({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                                                           "logprobs": None}]}) + "\n\n"

    events = [chunk({"role": "assistant", "content": ""})]
    if reply.get("content"):
        events.append(chunk({"content": reply["content"]}))
    for i, call in enumerate(reply.get("tool_calls") or []):
        events.append(chunk({"tool_calls": [{"index": i, **call}]}))
    events.append(chunk({}, finish))
    if usage is not None:
        events.append("data: " + json.dumps({**base, "choices": [], "usage": usage}) + "\n\n")
    return events + ["data: [DONE]\n\n"]


def _response_object(model: str, reply: dict, usage: dict, created: int, request: ChatRequest) -> dict:
    """The answer as a Responses API ``response``: a message item with its text (when it has
    any), then a ``function_call`` item per tool call; the request's tool settings echoed."""
    output: list[dict] = []
    if reply.get("content") or not reply.get("tool_calls"):
        output.append({"type": "message", "id": f"msg_{secrets.token_hex(8)}", "role": "assistant",
                       "status": "completed",
                       "content": [{"type": "output_text", "text": reply["content"] or "", "annotations": []}]})
    for call in reply.get("tool_calls") or []:
        output.append({"type": "function_call", "id": f"fc_{secrets.token_hex(8)}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    return {"id": f"resp_{secrets.token_hex(8)}", "object": "response", "created_at": created, "model": model,
            "status": "completed", "output": output,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "tool_choice": request.tool_choice if request.tool_choice is not None else "auto",
            "tools": [{"type": "function", **t.function.model_dump(exclude_none=True)} for t in request.tools or []],
            "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                      "total_tokens": usage["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}
