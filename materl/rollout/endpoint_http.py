"""The agent endpoint's HTTP plumbing (``materl.rollout.endpoint``): bounded connections, a
bounded request body, and responses whose delivery is known.

Connections. uvicorn's h11 protocol closes a connection left idle ``keep_alive_s`` after a
response, but arms no timer before a connection's first request, nor while a request arrives: a
client that connects and sends nothing, or sends its headers a byte at a time (slowloris), holds
the connection for ever. ``bounded_h11`` arms the idle timer on connect too, and gives every
request ``read_timeout_s`` from its first byte to its last; past it the connection is closed.
Headers are bounded by h11's incomplete-event limit (16 KiB).

Bodies. ``read_body`` refuses a body over ``max_bytes`` (413) from its ``Content-Length`` before
reading, or as soon as a chunked body passes the limit; the rest of the body is read and dropped
(uvicorn discards it) so the client can read the answer. A client that goes away while uploading
raises ``Disconnected``, which the endpoint answers with nothing (there is nobody to answer).

Delivery. ``Watch`` listens for the client's disconnect while a request is sampled and its
answer sent: ``gone`` is set once the client went away, so an answer it never received is not
recorded.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

READ_TIMEOUT_S = 30.0  # from a request's first byte to its last
KEEP_ALIVE_S = 60.0  # an idle connection; above httpx's 5 s keep-alive expiry, so a pooled
# connection is dropped by the client before the server closes it under a request


def bounded_h11(read_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the timers of the module docstring."""

    class BoundedH11(H11Protocol):
        _read_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            reading = self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing()
            if reading and self._read_timer is None:
                self._read_timer = self.loop.call_later(read_timeout_s, self._read_timed_out)
            elif not reading:
                self._stop_read_timer()

        def connection_lost(self, exc) -> None:
            self._stop_read_timer()
            super().connection_lost(exc)

        def _stop_read_timer(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _read_timed_out(self) -> None:
            self._read_timer = None
            if not self.transport.is_closing():
                self.transport.close()  # a request being handled sees the disconnect

    return BoundedH11


class Disconnected(Exception):
    """The client went away before its request was read or answered."""


class TooLarge(Exception):
    def __init__(self, size: int | None, limit: int):
        super().__init__(f"the request body is {'larger than' if size is None else f'{size:,} bytes,'} over the "
                         f"endpoint's limit of {limit:,} bytes (max_request_bytes)")


async def read_body(scope, receive, max_bytes: int) -> bytes:
    """The request body, at most ``max_bytes`` (module docstring)."""
    length = dict(scope["headers"]).get(b"content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise TooLarge(int(length), max_bytes)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise TooLarge(None, max_bytes)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class Watch:
    """Listens for the client's disconnect (``gone``) once its request body is read."""

    def __init__(self, receive):
        self.gone = asyncio.Event()
        self._scopes: list = []
        self._task = asyncio.get_running_loop().create_task(self._listen(receive))

    def cancels(self, scope) -> None:
        """Cancel ``scope`` (an anyio CancelScope) when the client goes away."""
        self._scopes.append(scope)

    async def _listen(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone.set()
        for scope in self._scopes:
            scope.cancel()

    def stop(self) -> None:
        self._task.cancel()


class Sent:
    """``send``, noting whether a response has started (then no other can be sent)."""

    def __init__(self, send):
        self.send, self.started = send, False

    async def __call__(self, message: dict) -> None:
        self.started = self.started or message["type"] == "http.response.start"
        await self.send(message)


async def send_json(send, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_events(send, events: Iterable[str]) -> None:
    """Server-Sent Events, one body chunk each, then the end of the body."""
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
    for event in events:
        await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
    await send({"type": "http.response.body", "body": b""})
