"""SIGINT and SIGTERM stop a run cleanly and soon; a second one exits at once.

    with signals.handled():          # ``materl`` does this around every command
        train_from_config(cfg)       # a first signal raises Interrupted(signum) in the main thread
    with signals.deferred():         # a checkpoint save: a first signal waits for the block's end
        ...

The main thread owns the signals. A first SIGINT or SIGTERM raises ``Interrupted`` (a
KeyboardInterrupt carrying the signal number) in it, wherever it is: loading a model, waiting in
``Compiled.call_blocking``, or running a compute item there (a decode step, the learner). From
there the ordinary unwinding does the work: ``compute`` hands the item's awaiting task a
``WorkInterrupted`` instead of the interrupt (which would kill the event loop's thread);
``call_blocking`` cancels the step's task and serves its compute work while it unwinds; ``ml.train``
closes the rollout workers, the learner ranks and a Ray cluster it started; ``Compiled.close``
stops the MCP tool servers; the CLI reaps any child process still there and exits with 128 + the
signal number (130, 143), as a shell reports a process the signal ended.

Inside ``deferred()`` a first signal is held until the block ends: a checkpoint save completes
and becomes the latest, then the run stops. A second signal (or ``STOP_DEADLINE_S`` after the
first, if unwinding hangs) kills every descendant process and exits at once with ``os._exit``:
a save it cuts short leaves only a temp folder, and the previous checkpoint stays the latest.

Ray's ``ray.init`` installs its own SIGTERM handler (which aborts the driver); ``rearm()`` after
connecting puts ours back. Descendants are found through ``/proc`` (Linux); elsewhere the
reaping is skipped.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from materl.errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOP_DEADLINE_S = 30.0  # after a first signal, the longest the clean stop may take
REAP_GRACE_S = 3.0  # how long children get to exit on SIGTERM before SIGKILL


class _State:
    installed = False
    first: int | None = None  # the first signal received, once one was
    held: int | None = None  # a signal held by ``deferred()``
    deferring = 0
    previous: dict[int, object] = {}
    done = threading.Event()  # set when ``handled()`` is left


def _handle(signum: int, frame: object) -> None:
    if _State.first is not None:
        _exit_now(signum, "second signal")
    _State.first = signum
    _say(f"{signal.Signals(signum).name} received: stopping cleanly; "
         f"send it again to exit at once")
    threading.Thread(target=_watchdog, args=(signum, _State.done), name="materl-stop-deadline", daemon=True).start()
    if _State.deferring:
        _State.held = signum
        return
    raise Interrupted(signum)


def _watchdog(signum: int, done: threading.Event) -> None:
    if not done.wait(STOP_DEADLINE_S):  # set when ``handled()`` is left: the stop is complete
        _exit_now(signum, f"still stopping after {STOP_DEADLINE_S:.0f} s")


def _exit_now(signum: int, why: str) -> None:
    _say(f"{why}: killing child processes and exiting now")
    kill_descendants(grace_s=0.0)
    os._exit(128 + signum)


def _say(text: str) -> None:
    try:
        os.write(sys.stderr.fileno(), f"materl: {text}\n".encode())
    except (OSError, ValueError):  # stderr closed
        pass


@contextmanager
def handled() -> Iterator[None]:
    """Within, SIGINT and SIGTERM raise ``Interrupted`` in the main thread (see the module
    docstring); the previous handlers come back on exit. A no-op outside the main thread."""
    if threading.current_thread() is not threading.main_thread() or _State.installed:
        yield
        return
    _State.previous = {s: signal.getsignal(s) for s in SIGNALS}
    _State.installed, _State.first, _State.held, _State.done = True, None, None, threading.Event()
    rearm()
    try:
        yield
    finally:
        for s, h in _State.previous.items():
            signal.signal(s, h)
        _State.installed = False
        _State.done.set()


def rearm() -> None:
    """Put materl's handlers back (after a library, e.g. ``ray.init``, installed its own)."""
    if _State.installed and threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, _handle)


def received() -> int | None:
    """The first signal received inside ``handled()``, or None."""
    return _State.first


@contextmanager
def deferred() -> Iterator[None]:
    """Hold a first signal until the block ends, then raise it: a block that must not be cut
    short (a checkpoint save) completes. Only the main thread's handlers defer; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _State.deferring += 1
    try:
        yield
    finally:
        _State.deferring -= 1
        if not _State.deferring and _State.held is not None:
            held, _State.held = _State.held, None
            raise Interrupted(held)


# ----------------------------------------------------------------------------- child processes


def descendants(pid: int | None = None) -> list[int]:
    """Every live descendant of ``pid`` (default: this process), from ``/proc``; [] without it."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if entry.isdigit():
            ppid = _ppid(int(entry))
            if ppid is not None:
                children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
    return int(fields[1]) if len(fields) > 1 and fields[0] != b"Z" else None


def kill_descendants(*, grace_s: float = REAP_GRACE_S) -> list[int]:
    """SIGTERM every descendant, wait up to ``grace_s`` for them to go, SIGKILL the rest (with
    ``grace_s=0``, SIGKILL at once); returns the pids that were signalled."""
    pids = descendants()
    if grace_s > 0:
        _send(pids, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.05)
    _send([p for p in pids + descendants() if _alive(p)], signal.SIGKILL)
    return pids


def _send(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _alive(pid: int) -> bool:
    """Running, and not a zombie waiting for its parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] != b"Z"
