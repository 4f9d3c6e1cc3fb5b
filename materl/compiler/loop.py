"""A private event loop in a daemon thread, for blocking calls into async code.

    loop = LoopThread()
    future = loop.submit(step.arun, prompts)     # concurrent.futures.Future
    loop.cancel(future)                          # cancels the task; the future is done once it unwound
    loop.close()                                 # also runs when the owner is garbage-collected

``Compiled.run`` is blocking; the step itself is async (episodes, tool calls). Blocking calls
share one loop so that tool servers started by the first step (their connections are tasks of
that loop) serve the next ones. The thread is a daemon and is stopped by a ``weakref.finalize``
that never waits on a loop that cannot answer: an object collected at interpreter shutdown
(or one whose owner forgot ``close()``) cannot hang the process, which a blocking portal's
``__exit__`` called from ``__del__`` did.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable, Coroutine
from concurrent.futures import CancelledError, Future
from typing import Any

STOP_WAIT_S = 5.0


class LoopThread:
    """An asyncio loop running forever in a daemon thread, started on first ``submit``."""

    def __init__(self, name: str = "materl-loop"):
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._finalizer: weakref.finalize | None = None
        self._tasks: dict[Future, asyncio.Task] = {}  # submitted and running (touched in the loop's thread)

    @property
    def running(self) -> bool:
        return self._loop is not None and self._loop.is_running()

    def submit(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any, **kwargs: Any) -> Future:
        """Schedule ``fn(*args, **kwargs)`` as a task of the loop; the returned future holds its
        result, and is done only once the task is (``cancel`` waits for its clean-up to run)."""
        if self._loop is None:
            self._start()
        loop, future = self._loop, Future()

        def start() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                task = loop.create_task(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - e.g. fn is not a coroutine function
                future.set_exception(exc)
                return
            self._tasks[future] = task
            task.add_done_callback(lambda t: self._finished(future, t))

        loop.call_soon_threadsafe(start)
        return future

    def cancel(self, future: Future) -> None:
        """Cancel the task behind ``future`` (from ``submit``); ``future`` is done once the task
        has run its clean-up (``finally`` blocks, closing tool servers) and raises CancelledError
        unless the task ended otherwise meanwhile."""
        if self._loop is None or self._loop.is_closed():
            return

        def cancel() -> None:
            task = self._tasks.get(future)
            if task is not None:
                task.cancel()

        try:
            self._loop.call_soon_threadsafe(cancel)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def _finished(self, future: Future, task: asyncio.Task) -> None:
        self._tasks.pop(future, None)
        if task.cancelled():
            future.set_exception(CancelledError(f"{self.name}: the task was cancelled"))
        elif task.exception() is not None:
            future.set_exception(task.exception())
        else:
            future.set_result(task.result())

    def call(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any, **kwargs: Any) -> Any:
        """``submit`` and wait for the result."""
        return self.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        """Stop the loop and its thread (waits at most ``STOP_WAIT_S``). Idempotent."""
        if self._finalizer is not None:
            self._finalizer()
        self._loop = self._finalizer = None

    def _start(self) -> None:
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()

        thread = threading.Thread(target=run, name=self.name, daemon=True)
        thread.start()
        ready.wait()
        self._loop = loop
        self._finalizer = weakref.finalize(self, _stop, loop, thread)


def _stop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    if loop.is_closed():
        return
    try:
        loop.call_soon_threadsafe(loop.stop)
    except RuntimeError:  # the loop was closed meanwhile
        return
    if thread is not threading.current_thread():
        thread.join(STOP_WAIT_S)
    if not thread.is_alive():
        loop.close()
