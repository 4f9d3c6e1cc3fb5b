"""A real OpenAI-compatible judge server for the fault tests: starlette on uvicorn, in a thread
of its own, listening on 127.0.0.1. Each test gives it ``answer(request_number, body)``, which
returns a starlette Response (a scripted answer, an error with ``Retry-After``, a huge or endless
body); the server records every request (arrival time on the wall clock, JSON body) and, for
streamed bodies, how many bytes it sent and whether the stream was closed.

    with JudgeServer(lambda k, body: chat("Score: 0.5")) as server:
        judge = Judge(server.url, "rubric")
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable

import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


def chat(content: str, status: int = 200, headers: dict | None = None) -> Response:
    """An OpenAI chat completion whose message is ``content``."""
    body = {"id": "j", "object": "chat.completion", "created": 0, "model": "judge",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}
    return JSONResponse(body, status_code=status, headers=headers)


def judged_text(body: dict) -> str:
    """The user message a judge request carries (the task and the quoted response)."""
    return body["messages"][-1]["content"]


class Stream:
    """A streamed body: ``chunks`` chunks of ``size`` bytes (None: without end), counted as sent."""

    def __init__(self, size: int = 1 << 16, chunks: int | None = None):
        self.size, self.chunks = size, chunks
        self.sent, self.closed = 0, threading.Event()

    HEAD, TAIL = b'{"choices": [{"message": {"role": "assistant", "content": "', b'"}}]}'

    @property
    def total(self) -> int:
        """The body's length in bytes (a finite stream)."""
        return len(self.HEAD) + self.size * self.chunks + len(self.TAIL)

    async def body(self) -> AsyncIterator[bytes]:
        self.sent += len(self.HEAD)
        yield self.HEAD
        chunk, k = b"a" * self.size, 0
        try:
            while self.chunks is None or k < self.chunks:
                self.sent += len(chunk)
                k += 1
                yield chunk
                await asyncio.sleep(0)  # lets the server's loop see a closed connection
            yield self.TAIL
        finally:
            self.closed.set()

    def response(self, content_length: int | None = None) -> Response:
        headers = {"content-length": str(content_length)} if content_length is not None else None
        return StreamingResponse(self.body(), media_type="application/json", headers=headers)


class JudgeServer:
    def __init__(self, answer: Callable[[int, dict], Response], *, keep_alive_s: float = 5.0):
        self.answer = answer
        self.requests: list[tuple[float, dict]] = []  # (arrival on the wall clock, body)
        self._lock = threading.Lock()
        app = Starlette(routes=[Route("/v1/chat/completions", self._chat, methods=["POST"])])
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}/v1"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=keep_alive_s))

    async def _chat(self, request) -> Response:
        arrived = time.time()
        body = json.loads(await request.body())
        with self._lock:
            k = len(self.requests)
            self.requests.append((arrived, body))
        return self.answer(k, body)

    def __enter__(self) -> JudgeServer:
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            assert time.monotonic() < deadline, "the judge server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
