"""A sweep trial's process: started here (``LocalTrial``) or by a Ray actor on a cluster node
(``RayTrial``); ``materl.runtime.sweep`` drives both through ``TrialProcess``.

A trial is ``materl train`` in a process of its own session (so a terminal's Ctrl-C reaches the
sweep, which stops its trials cleanly itself). ``read(offset)`` returns the bytes of the trial's
``metrics.jsonl`` from ``offset``: on Ray the actor reads them on the trial's node, so only the
final ``materl compare`` needs the run dirs where the sweep runs (a folder every node shares).
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol


class TrialProcess(Protocol):
    def poll(self) -> int | None:
        """The exit status, or None while it runs."""

    def read(self, offset: int) -> bytes:
        """metrics.jsonl's bytes from ``offset`` (b"" before the file exists)."""

    def stop(self, sig: int) -> None:
        """Send ``sig`` (SIGINT, SIGTERM: materl train's clean stop) if it still runs."""

    def kill(self) -> None:
        """SIGKILL if it still runs, and wait for it."""

    def close(self) -> None:
        """Release what holds the process (a Ray actor)."""


class LocalTrial:
    """``cmd`` as a child process of this one, output appended to ``log``."""

    def __init__(self, cmd: Sequence[str], *, cwd: str, env: Mapping[str, str], log: Path, metrics: Path):
        self.metrics = Path(metrics)
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(list(cmd), cwd=cwd, env=dict(env), stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def poll(self) -> int | None:
        return self.proc.poll()

    def read(self, offset: int) -> bytes:
        try:
            with open(self.metrics, "rb") as f:
                f.seek(offset)
                return f.read()
        except FileNotFoundError:
            return b""

    def stop(self, sig: int = signal.SIGINT) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        pass


class RayTrial:
    """A ``LocalTrial`` inside a Ray actor of ``num_cpus`` CPUs: the process runs on the actor's node."""

    def __init__(self, ray: Any, cmd: Sequence[str], *, cwd: str, env: Mapping[str, str], log: Path, metrics: Path,
                 num_cpus: int):
        self._ray = ray
        actor_cls = ray.remote(num_cpus=num_cpus)(LocalTrial)
        self._actor = actor_cls.remote(list(cmd), cwd=cwd, env=dict(env), log=log, metrics=metrics)

    def poll(self) -> int | None:
        return self._ray.get(self._actor.poll.remote())

    def read(self, offset: int) -> bytes:
        return self._ray.get(self._actor.read.remote(offset))

    def stop(self, sig: int = signal.SIGINT) -> None:
        self._ray.get(self._actor.stop.remote(sig))

    def kill(self) -> None:
        self._ray.get(self._actor.kill.remote())

    def close(self) -> None:
        self._ray.kill(self._actor)
