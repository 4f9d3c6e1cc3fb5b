"""Helpers for the fault suite: a real ``materl train`` subprocess on the tiny random model, held
at a chosen moment so a test can send it a real signal there, and a look at what it left behind.

The child is ``python -c CHILD MARKER POINT PAUSE materl-args...``: CHILD wraps one function of
materl so that, once the run has saved its first checkpoint, the first call writes MARKER and
sleeps PAUSE seconds inside that function (a real sleep, which a signal interrupts like any
computation). POINT names the moment:

    start     building the run (loading the models), before any checkpoint
    decode    a decode step of the engine, in the compute thread (the main thread)
    learner   the learner's updates (``Learner.run_updates``), in the compute thread
    save      a checkpoint save, after every file but the manifest is written

The child runs in a session of its own (``start_new_session``), so every process it started
(a Ray cluster and its workers) carries that session id; ``family`` lists those and the child's
descendants (the MCP SDK starts tool servers in sessions of their own), ``assert_no_leftovers``
checks that none is alive after the child exited.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "configs" / "tiny_grpo.yaml"
CALCULATOR = ["--set", "recipe=grpo_tools", "--set", "tools=[python -m materl.tools.calculator]"]

CHILD = r"""
import os, sys, time, pathlib
marker, point, pause = pathlib.Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
args = sys.argv[4:]
run_dir = pathlib.Path(next(a.split("=", 1)[1] for a in args if a.startswith("train.run_dir=")))
fired = []

def hold(fn):
    def held(*a, **k):
        ready = point == "start" or (run_dir / "checkpoints" / "latest").exists()
        if ready and not fired:
            fired.append(True)
            marker.write_text(str(os.getpid()))
            time.sleep(pause)
        return fn(*a, **k)
    return held

if point == "start":
    import materl.runtime.train as tr
    tr.build_from_config = hold(tr.build_from_config)
elif point == "decode":
    from materl.engines.mojo_engine import MojoEngine
    from materl.engines.transformers_engine import TransformersEngine
    MojoEngine._step = hold(MojoEngine._step)
    TransformersEngine._decode_batch = hold(TransformersEngine._decode_batch)
elif point == "learner":
    from materl.compiler.learner import Learner
    Learner.run_updates = hold(Learner.run_updates)
elif point == "save":
    import materl.runtime.checkpoint as ck
    ck.write_manifest = hold(ck.write_manifest)
else:
    raise SystemExit(f"unknown point {point!r}")

from materl.cli import main
sys.exit(main(args))
"""


def start_run(tmp_path: Path, point: str, *sets: str, pause: float = 60.0, steps: int = 50) -> tuple:
    """Start ``materl train`` on the tiny model (a checkpoint every step) and wait until it is held
    at ``point``; returns (process, run_dir)."""
    run_dir, marker = tmp_path / "run", tmp_path / f"held-{point}"
    args = ["train", str(CONFIG), "--set", f"train.run_dir={run_dir}", "--set", f"train.steps={steps}",
            "--set", "train.save_every=1", "--set", "train.keep_last=2", *sets]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MODULAR_TELEMETRY_ENABLED": "0"}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(marker), point, str(pause), *args], cwd=ROOT,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    deadline = time.monotonic() + 300
    while not marker.exists():
        if child.poll() is not None:
            raise AssertionError(f"the run ended (exit {child.returncode}) before reaching {point!r}:\n"
                                 f"{child.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            stop_session(child)
            raise AssertionError(f"the run never reached {point!r}")
        time.sleep(0.05)
    return child, run_dir


def signal_and_wait(child: subprocess.Popen, sig: int, *, timeout: float = 60.0) -> tuple[int, str]:
    """Send ``sig``; the exit code and stderr once the child exits (a hang fails the test)."""
    os.kill(child.pid, sig)
    try:
        _, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_session(child)
        raise AssertionError(f"materl train did not stop within {timeout} s of {signal.Signals(sig).name}") from None
    return child.returncode, err


def _proc(pid: int) -> tuple[bytes, int, int, str] | None:
    """(state, ppid, session, command) of a process, or None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()  # state ppid pgrp session ...
    return fields[0], int(fields[1]), int(fields[3]), cmd.strip()[:120]


def _all() -> dict[int, tuple]:
    procs = {int(e): _proc(int(e)) for e in os.listdir("/proc") if e.isdigit()}
    return {pid: p for pid, p in procs.items() if p is not None and p[0] != b"Z"}


def family(child: subprocess.Popen) -> dict[int, str]:
    """The child's live descendants and the processes of its session, pid -> command. (The MCP
    SDK starts stdio servers in a session of their own, so the session alone misses them.)"""
    procs = _all()
    found = {pid: p[3] for pid, p in procs.items() if p[2] == child.pid}
    todo = [child.pid]
    while todo:
        parent = todo.pop()
        for pid, p in procs.items():
            if p[1] == parent and pid not in found:
                found[pid] = p[3]
                todo.append(pid)
    found.pop(child.pid, None)
    return found


def assert_no_leftovers(child: subprocess.Popen, seen: dict[int, str] | None = None, *,
                        within_s: float = 5.0) -> None:
    """Nothing of the child's session, and none of the processes ``seen`` earlier, is alive
    (allowing ``within_s`` for processes already exiting)."""
    def left() -> list[str]:
        procs = _all()
        pids = {pid for pid, p in procs.items() if p[2] == child.pid} | {pid for pid in seen or {} if pid in procs}
        return [f"{pid} {procs[pid][3]}" for pid in sorted(pids)]

    deadline = time.monotonic() + within_s
    while (alive := left()) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive:
        for line in alive:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        raise AssertionError("processes outlived materl train: " + "; ".join(alive))


def stop_session(child: subprocess.Popen) -> None:
    """Kill the child and what it started (test clean-up after a failure)."""
    for pid in [child.pid, *family(child)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    child.wait()
