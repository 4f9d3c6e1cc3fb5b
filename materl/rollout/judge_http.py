"""One chat completion from an OpenAI-compatible judge URL, read with a byte cap, and the retry
schedule of a judge's calls (``materl.rollout.judge``).

    text = await chat_completion(client, url, headers=..., body=..., max_bytes=1 << 20)
    wait = retry_wait(attempt, after=failure.after, base_s=1.0, max_s=60.0, rng=rng)

The answer is streamed and counted as it arrives: a body whose ``Content-Length`` says it is
larger than ``max_bytes`` is refused before any of it is read, and one that grows past it (a huge
answer, a stream that never ends) is cut off there, its connection closed. Compressed bodies are
not asked for (``accept-encoding: identity``), so the bytes counted are the bytes held.

A failed attempt is an ``AttemptFailed`` that says whether trying again can help (``retry``) and
how long the server asked to wait (``after``, from ``Retry-After``: delta-seconds or an
HTTP-date). Transient failures are retried: connection errors, timeouts, HTTP 408, 425, 429 and
5xx, a malformed body. A refusal that will not change is not: another 4xx (a wrong key, URL or
model name), an answer over the byte cap. Between attempts ``retry_wait`` gives exponential
backoff with jitter (``base_s * 2**(k-1)``, capped at ``max_s``, times a uniform factor in
[0.5, 1]: concurrent episodes that failed together do not retry together), or the server's
``Retry-After`` when it sent one, which is honoured up to ``max_s`` (beyond that the call fails
at once, naming the delay asked). (The openai client: 2 retries, 0.5-8 s jittered backoff,
``Retry-After`` up to 60 s; AWS's "exponential backoff and jitter".)
"""

from __future__ import annotations

import email.utils
import json
import random
import re
import time
from datetime import timezone
from typing import Any

DEFAULT_MAX_ANSWER_BYTES = 1 << 20  # 1 MiB: a 256-token answer is ~2 KB of JSON
RETRIED_STATUS = frozenset({408, 425, 429})  # and every 5xx
_ERROR_BODY_BYTES = 2048  # how much of an error response is read, for its message


class AttemptFailed(Exception):
    """One judge request failed: ``retry`` says whether another attempt can help, ``after`` is
    the delay the server asked for (``Retry-After``, in seconds) or None."""

    def __init__(self, message: str, *, retry: bool, after: float | None = None):
        super().__init__(message)
        self.retry, self.after = retry, after


async def chat_completion(client: Any, url: str, *, headers: dict[str, str], body: dict,
                          max_bytes: int = DEFAULT_MAX_ANSWER_BYTES) -> str:
    """POST ``body`` to ``url`` (an httpx.AsyncClient) and return the answer's message content,
    reading at most ``max_bytes`` of the response; AttemptFailed otherwise."""
    async with client.stream("POST", url, headers={**headers, "accept-encoding": "identity"}, json=body) as response:
        if not 200 <= response.status_code < 300:
            detail = await _head(response)
            status = response.status_code
            retry = status in RETRIED_STATUS or status >= 500
            after = retry_after_s(response.headers.get("retry-after"))
            asked = f", Retry-After {response.headers.get('retry-after')!r}" if after is not None else ""
            raise AttemptFailed(f"HTTP {status} {response.reason_phrase}{asked}: {detail!r}"
                                + ("" if retry else " (not retried: another attempt would get the same answer)"),
                                retry=retry, after=after)
        data = await read_capped(response, max_bytes)
    return answer_text(data)


async def read_capped(response: Any, max_bytes: int) -> bytes:
    """The response body, or AttemptFailed (not retried) once it is past ``max_bytes``."""
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise AttemptFailed(f"the answer is {int(declared)} bytes (Content-Length), more than "
                            f"max_answer_bytes={max_bytes}; not read", retry=False)
    data = bytearray()
    async for chunk in response.aiter_bytes():
        data += chunk
        if len(data) > max_bytes:
            raise AttemptFailed(f"the answer went past max_answer_bytes={max_bytes} (a huge answer or a stream "
                                f"that does not end); the connection was closed after {len(data)} bytes", retry=False)
    return bytes(data)


async def _head(response: Any) -> str:
    """The first bytes of an error response, as text (for the error message)."""
    data = bytearray()
    async for chunk in response.aiter_bytes():
        data += chunk
        if len(data) >= _ERROR_BODY_BYTES:
            break
    return data[:_ERROR_BODY_BYTES].decode("utf-8", "replace")


def answer_text(data: bytes) -> str:
    """The message content of an OpenAI chat-completion body; AttemptFailed (retried) if the
    body is not one."""
    try:
        payload = json.loads(data)
        message = payload["choices"][0]["message"]
        content = message.get("content")
    except (ValueError, RecursionError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise AttemptFailed(f"the answer is not an OpenAI chat completion ({type(exc).__name__}: {exc}): "
                            f"{bytes(data[:300])!r}", retry=True) from None
    if content is not None and not isinstance(content, str):
        raise AttemptFailed(f"the answer's message content is {type(content).__name__}, not text: {content!r:.300}",
                            retry=True)
    return content or ""


_SECONDS = re.compile(r"\d+(?:\.\d+)?")


def retry_after_s(value: str | None, *, now: float | None = None) -> float | None:
    """A ``Retry-After`` header in seconds from ``now`` (default: the wall clock): delta-seconds
    (``"30"``) or an HTTP-date (``"Wed, 21 Oct 2026 07:28:00 GMT"``; a past date is 0). None
    without a header or for one that is neither."""
    if value is None:
        return None
    value = value.strip()
    if _SECONDS.fullmatch(value):
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def retry_wait(attempt: int, *, after: float | None, base_s: float, max_s: float, rng: random.Random) -> float | None:
    """Seconds to wait after failed attempt ``attempt`` (1, 2, ...): the server's ``after`` when it
    asked (None if that is more than ``max_s``: give up), else ``base_s * 2**(attempt-1)`` capped
    at ``max_s``, times a uniform jitter in [0.5, 1]."""
    if after is not None:
        return after if after <= max_s else None
    return min(base_s * 2 ** (attempt - 1), max_s) * rng.uniform(0.5, 1.0)
