"""One OS thread for torch's heavy work (decoding, the learner, loading models).

    value = compute.call(fn, *args)             # blocking: in the serving thread, else here
    value = await compute.acall(fn, *args)      # from an event loop, which keeps running
    with compute.serving() as here:             # this thread does the compute work ...
        value = here.until(future)              # ... until ``future`` (e.g. a portal task) is done

Why one thread. torch's CPU kernels parallelise with OpenMP (libgomp in the PyPI wheels), and
every OS thread that has run a parallel region keeps a pool of worker threads for the rest of its
life. Once the process holds more pooled threads than it has CPUs, libgomp stops spin-waiting
between parallel regions (its "throttled" spin count: 1,000 spins instead of 300,000) and every
region pays a futex wake-up. A decode step is hundreds of small regions, so this is not small:
on 2 cores, SmolLM2-135M decoding 8 rows x 32 tokens took 2.2 s with one pool and 3.4 s once a
second thread had run one matmul and stayed alive; a learner forward/backward went 1.6 -> 1.9 s.
The in-process engine used to decode in anyio worker threads while the learner ran in the event
loop's thread: both paid it on every step.

Memory. The same two threads of work also churn memory: every step frees the decode copies and
the learner's activations, hundreds of MB, and glibc handed them back to the OS, so the next
phase faulted them in again (300,000 minor faults and 0.6 s of system time per SmolLM2 step).
``tune_allocator`` (run once, when compute work is first served) keeps freed memory for reuse.
It installs ``materl.cpu_allocator``: the tensors of compute work items come from a range of
their own, so autograd's small objects do not cut up the freed activations and the gradients
reuse them; other code's tensors keep glibc. And it sets glibc, which serves everything else, to
keep freed memory in its heap: allocations up to 32 MB come from the heap (``M_MMAP_THRESHOLD``)
and free memory is returned only past 1 GB (``M_TRIM_THRESHOLD``). ``MATERL_MALLOC=glibc`` skips
the first, ``MATERL_MALLOC=default`` both.

Which thread. ``Compiled.run`` (blocking) makes its calling thread the compute thread while the
step runs in the background event loop (``serving``), and a blocking ``call`` with nobody serving
runs in its caller, so a script that loads a model, trains and evaluates from its main thread
keeps one pool (and shares it with other torch code in that thread, e.g. TRL in
benchmarks/vs_trl.py). ``acall`` with nobody serving (``await compiled.arun(...)`` in a user's
event loop) cannot run in the loop's thread: it uses one daemon thread, started on first use
with the starting thread's torch thread count. Work called from the compute thread itself runs
inline, so nesting cannot deadlock.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, TypeVar

import anyio

from materl import cpu_allocator
from materl.errors import WorkInterrupted

T = TypeVar("T")

_Item = tuple[Future, Callable[..., Any], tuple, dict]


class _Server:
    """A thread that runs submitted work items, in order, one at a time."""

    def __init__(self, thread: threading.Thread):
        self.thread = thread
        self.items: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()

    def submit(self, fn: Callable[..., T], args: tuple, kwargs: dict) -> Future:
        future: Future = Future()
        self.items.put((future, fn, args, kwargs))
        return future

    def run_one(self, item: _Item) -> None:
        """Run one item. A KeyboardInterrupt (or SystemExit) raised in it is this thread's own:
        the item's caller gets ``WorkInterrupted`` and the interrupt goes on up this thread. Handing
        the interrupt itself to a caller awaiting in an event loop would make asyncio re-raise it
        out of ``run_forever()`` and kill the loop's thread, which the serving thread then waits
        on for ever."""
        future, fn, args, kwargs = item
        if not future.set_running_or_notify_cancel():
            return
        try:
            with cpu_allocator.scope():
                result = fn(*args, **kwargs)
        except (KeyboardInterrupt, SystemExit) as exc:
            if not future.done():
                future.set_exception(WorkInterrupted(f"compute work {_name(fn)} was interrupted "
                                                     f"({type(exc).__name__})"))
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            future.set_exception(exc)
        else:
            future.set_result(result)

    def until(self, future: Future, *, timeout_s: float | None = None) -> Any:
        """Run work items here until ``future`` is done; return its result (or raise). With
        ``timeout_s``, give up after that long (TimeoutError) and leave the rest to the next
        target (``serving``'s hand-over)."""
        future.add_done_callback(lambda _: self.items.put(None))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not future.done():
            try:
                item = self.items.get(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"compute: the awaited work was not done after {timeout_s} s") from None
            if item is not None:
                self.run_one(item)
        return future.result()


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>


@functools.cache
def tune_allocator() -> bool:
    """Keep freed memory for reuse between phases (see the module docstring). True if glibc's
    settings were applied; ``cpu_allocator.unavailable()`` says whether the tensor range is used."""
    cpu_allocator.install()  # which skips itself under MATERL_MALLOC=glibc or default
    if os.environ.get("MATERL_MALLOC", "").lower() == "default":
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))


_lock = threading.Lock()
_serving: list[_Server] = []  # threads inside ``serving()``, innermost last
_daemon: _Server | None = None


def _start_daemon() -> _Server:
    import torch

    threads = torch.get_num_threads()
    started = threading.Event()
    holder: list[_Server] = []

    def main() -> None:
        torch.set_num_threads(threads)
        tune_allocator()
        server = _Server(threading.current_thread())
        holder.append(server)
        started.set()
        while True:
            item = server.items.get()
            if item is not None:
                server.run_one(item)

    threading.Thread(target=main, name="materl-compute", daemon=True).start()
    started.wait()
    return holder[0]


def _target() -> _Server:
    global _daemon
    with _lock:
        if _serving:
            return _serving[-1]
        if _daemon is None:
            _daemon = _start_daemon()
        return _daemon


def _inline(server: _Server) -> bool:
    me = threading.current_thread()
    return server.thread is me or any(s.thread is me for s in _serving)


def compute_thread() -> threading.Thread:
    """The thread that runs compute work now (started if need be)."""
    return _target().thread


def call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run ``fn`` in the serving thread if one is serving (and wait), else right here: a thread
    that blocks on torch work is the one that will serve ``Compiled.run`` later, so loading a
    model from it keeps one pool."""
    with _lock:
        server = _serving[-1] if _serving else None
    if server is None or _inline(server):
        with cpu_allocator.scope():
            return fn(*args, **kwargs)
    return server.submit(fn, args, kwargs).result()


async def acall(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run ``fn`` in the compute thread; the event loop keeps running meanwhile. Not
    cancellable once submitted (like ``anyio.to_thread.run_sync``): the work finishes, and a
    cancellation of the caller is delivered after it (one already pending when the work is
    submitted is raised at once, as ``run_sync``'s first checkpoint does)."""
    server = _target()
    if _inline(server):
        with cpu_allocator.scope():
            return fn(*args, **kwargs)
    future = server.submit(fn, args, kwargs)
    await anyio.lowlevel.checkpoint_if_cancelled()
    if not future.done():
        with anyio.CancelScope(shield=True):
            await _done(future)
    return future.result()


def _done(future: Future) -> asyncio.Future:
    """An awaitable of the running loop that completes when ``future`` is done: the compute thread
    wakes the loop itself (one hop; ``run_sync(future.result)`` took an anyio worker thread, a
    queue hand-off and a capacity limiter per call). Cancelling the awaitable leaves ``future``
    and its work alone."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def wake(_: Future) -> None:
        try:
            loop.call_soon_threadsafe(_set_done, waiter)
        except RuntimeError:  # the loop was closed meanwhile: nobody is waiting
            pass

    future.add_done_callback(wake)
    return waiter


def _set_done(waiter: asyncio.Future) -> None:
    if not waiter.done():  # not cancelled meanwhile
        waiter.set_result(None)


@contextmanager
def serving():
    """Inside, compute work runs in this thread whenever it calls ``until`` on the yielded server."""
    tune_allocator()
    server = _Server(threading.current_thread())
    with _lock:
        _serving.append(server)
    try:
        yield server
    finally:
        with _lock:
            _serving.remove(server)
        _hand_over(server)


def _hand_over(server: _Server) -> None:
    """Work submitted after the serving thread stopped listening goes to the next target."""
    while True:
        try:
            item = server.items.get_nowait()
        except queue.Empty:
            return
        if item is not None:
            future, fn, args, kwargs = item
            nxt = _target()
            if future.set_running_or_notify_cancel():
                inner = nxt.submit(fn, args, kwargs)
                inner.add_done_callback(lambda f, out=future: _copy_result(f, out))


def _copy_result(src: Future, dst: Future) -> None:
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.result())
