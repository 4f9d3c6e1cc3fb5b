"""Noticing an ``async def`` agent that holds the event loop (``ml.agent_episodes``).

The agent endpoint answers in the event loop that runs the agents. An ``async def`` agent that
calls blocking code (a synchronous OpenAI client, ``requests``, ``time.sleep``, a framework's
``invoke``) holds that loop: no episode's request is answered meanwhile, including the one it is
waiting for, so it waits until its client times out (10 minutes with the openai defaults), and
``episode_timeout_s`` cannot fire. Python cannot interrupt it, so materl says so at once: a
thread checks that the loop runs (a heartbeat task), and when it has not for ``after_s`` while an
agent's code is the task running and the loop's thread has been waiting in the kernel all that
while (state ``S`` in ``/proc``: a blocking read, a sleep; not a slow import or computation,
which keep it running), it logs one error naming the agent and the line it is blocked at, with
the fix (write it as a plain ``def``, which materl runs in a thread with a synchronous client, or
await the asynchronous client it is given). Once per agent task.
(asyncio's debug mode reports slow callbacks after the fact; this reports while it happens.)
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("materl")
BLOCKED_AFTER_S = 5.0


class LoopWatch:
    """See the module docstring. ``start`` in the loop; ``agent(name, fn)`` around an agent's run."""

    def __init__(self, *, after_s: float = BLOCKED_AFTER_S):
        self.after_s = after_s
        self.agents: dict[asyncio.Task, tuple[str, str]] = {}  # running agent task -> (name, code file)
        self.reported: list[str] = []  # the messages logged
        self._loop: asyncio.AbstractEventLoop | None = None
        self._beat = time.monotonic()
        self._stop = threading.Event()
        self._tasks: list = []

    def start(self) -> None:
        self._loop, self._beat = asyncio.get_running_loop(), time.monotonic()
        self._stat = Path(f"/proc/self/task/{threading.get_native_id()}/stat")  # the loop thread's state
        self._stop.clear()
        self._tasks = [self._loop.create_task(self._heartbeat())]
        thread = threading.Thread(target=self._check, name="materl-loop-watch", daemon=True)
        thread.start()
        self._tasks.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for t in self._tasks:
            if isinstance(t, asyncio.Task):
                t.cancel()
        self._tasks = []

    @contextmanager
    def agent(self, name: str, fn):
        task = asyncio.current_task()
        code = getattr(getattr(fn, "__code__", None) or getattr(getattr(fn, "__call__", None), "__code__", None),
                       "co_filename", "")
        self.agents[task] = (name, code)
        try:
            yield
        finally:
            self.agents.pop(task, None)

    async def _heartbeat(self) -> None:
        while True:
            self._beat = time.monotonic()
            await asyncio.sleep(self.after_s / 10)

    def _check(self) -> None:
        seen: set = set()
        waiting = deque(maxlen=10)  # the loop thread's last states: True while it waits in the kernel
        while not self._stop.wait(self.after_s / 10):
            waiting.append(self._waiting())
            held = time.monotonic() - self._beat
            if held < self.after_s or self._loop is None or self._loop.is_closed() or not all(waiting):
                continue
            task = asyncio.current_task(self._loop)
            if task in self.agents and task not in seen:
                seen.add(task)
                self._report(task, held)

    def _waiting(self) -> bool:
        """Whether the loop's thread is asleep in the kernel (True where /proc cannot say)."""
        try:
            stat = self._stat.read_text()
        except OSError:
            return True
        return stat[stat.rfind(")") + 2:].startswith("S")

    def _report(self, task: asyncio.Task, held: float) -> None:
        name, code = self.agents[task]
        thread = getattr(self._loop, "_thread_id", None)
        frame = sys._current_frames().get(thread) if thread is not None else None
        where, innermost = "", None
        while frame is not None:
            innermost = innermost or f"{frame.f_code.co_filename}:{frame.f_lineno}"
            if frame.f_code.co_filename == code:
                where = f"{code}:{frame.f_lineno}"
                break
            frame = frame.f_back
        inside = f", inside {innermost}" if where and innermost and not innermost.startswith(code) else ""
        message = (f"agent {name!r} has held the event loop for {held:.1f} s, blocked in a call that does not "
                   f"await (at {where or innermost or 'an unknown line'}{inside}): while it does, the endpoint "
                   f"answers no episode's requests, its own included, so a blocking call to the model waits for "
                   f"its client's timeout. Write the agent as a plain `def` (materl runs it in a thread with a "
                   f"synchronous openai client) or await the AsyncOpenAI client it is given")
        self.reported.append(message)
        log.error(message)
