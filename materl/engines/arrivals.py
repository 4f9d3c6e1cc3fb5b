"""Requests arriving from many episodes, and the one loop that drives an engine through them.

    await settle(lambda: len(pending))                 # "what arrives in one tick"
    queue = Arrivals(RequestLimits.of(model))            # in an engine (what its prompts may hold)
    gen = await queue.serve(request, drive)              # in its ``generate``

"One tick": the first arrival waits until a whole pass of the event loop's ready tasks brings no
new one (``settle``), so which requests share a batch does not depend on wall-clock time. The
scheduler batches row-local nodes with it and the in-process engines batch requests with it.

``Arrivals.serve`` is the ``generate`` side every in-process engine shares: the request waits in
``waiting``; if no request is driving the engine it becomes the driver and calls ``drive(req)``
(which runs batches or decode rounds until ``req`` has its result and wakes the requests it
finished); when it is done it hands the driver role to another request still waiting. A request
cancelled before its result is marked (``cancelled``) and dropped from ``waiting``; requests made
on an event loop that is gone (an earlier ``asyncio.run``) are forgotten. (vLLM's
``AsyncLLMEngine`` runs a background loop task for the same purpose; here the loop lives in the
awaiting requests, so an engine needs no task of its own and nothing outlives a ``run``.)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import anyio.lowlevel

from materl.engines.base import Generation, SamplingParams
from materl.engines.sampling import RequestLimits, check_request, request_seed
from materl.errors import EngineError

SETTLE_PASSES = 2  # loop passes without a new arrival before a tick's batch is closed


async def settle(count: Callable[[], int]) -> None:
    """Yield until a whole pass of the event loop's ready tasks changes ``count()`` no more."""
    seen = -1
    while count() != seen:
        seen = count()
        for _ in range(SETTLE_PASSES):
            await anyio.lowlevel.checkpoint()


@dataclass(eq=False)
class Request:
    """One ``generate`` call waiting for (or holding) its result."""

    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    token: object  # the event loop it was made on
    wake: anyio.Event = field(default_factory=anyio.Event)
    result: Generation | None = None
    error: BaseException | None = None
    cancelled: bool = False

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None

    def empty(self) -> Generation | None:
        """The result of a request for no new tokens (nothing to decode), else None."""
        if self.params.max_new_tokens:
            return None
        return Generation([], [], "length", prompt_len=len(self.prompt_ids), metadata={"text": ""})


class Arrivals:
    """The waiting requests of one engine and who drives it (module docstring)."""

    def __init__(self, limits: RequestLimits = RequestLimits()):
        self.limits = limits  # checked per request as it enters (check_request)
        self.waiting: list[Request] = []
        self.driver: Request | None = None

    def new(self, prompt_ids, params: SamplingParams | None) -> Request:
        """A checked request (``check_request``; default params; its seed, ``request_seed``) on
        the running event loop; forgets the requests of an event loop that is gone."""
        params = params or SamplingParams()
        prompt_ids = check_request(prompt_ids, params, limits=self.limits)
        token = anyio.lowlevel.current_token()
        if self.driver is not None and self.driver.token != token:
            self.driver = None
        self.waiting = [r for r in self.waiting if r.token == token]
        return Request(prompt_ids, params, request_seed(params), token)

    async def serve(self, req: Request, drive: Callable[[Request], Awaitable[None]],
                    others: Callable[[], list[Request]] = list) -> Generation:
        """Queue ``req`` and wait for its result, driving the engine while nobody else does.
        ``others``: requests the engine holds beyond ``waiting`` (running ones), which may take
        over the driver role."""
        self.waiting.append(req)
        try:
            while not req.done:
                if self.driver is None:
                    self.driver = req
                    try:
                        await drive(req)
                    finally:
                        self.driver = None
                        self._wake_one(besides=req, others=others())
                else:
                    await req.wake.wait()
                    req.wake = anyio.Event()
        finally:
            if not req.done:  # cancelled: dropped from the queue (a running engine drops it next step)
                req.cancelled = True
                if req in self.waiting:
                    self.waiting.remove(req)
        if req.error is not None:
            raise EngineError(f"generation failed for a batch containing this request: {req.error!r}") from req.error
        return req.result

    async def tick(self, window_s: float = 0.0) -> None:
        """Wait ``window_s`` (if > 0: stragglers close in time join, at the price of
        clock-dependent batches), then until a whole loop pass brings no new request."""
        if window_s > 0:
            await anyio.sleep(window_s)
        await settle(lambda: len(self.waiting))

    def take(self, n: int) -> list[Request]:
        """The ``n`` oldest waiting requests, removed from the queue."""
        batch = self.waiting[:n]
        del self.waiting[: len(batch)]
        return batch

    def _wake_one(self, *, besides: Request, others: list[Request]) -> None:
        for r in self.waiting + others:
            if r is not besides and not r.done and not r.cancelled:
                r.wake.set()
                return


def finish(requests: list[Request], results: list[Generation] | None = None,
           error: BaseException | None = None) -> None:
    """Hand each request its result (or ``error``) and wake it."""
    for i, r in enumerate(requests):
        if error is not None:
            r.error = error
        elif results is not None:
            r.result = results[i]
        r.wake.set()
