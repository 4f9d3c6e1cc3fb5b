"""The torchrun entry point as a user starts it: ``python -m torch.distributed.run --standalone
--nproc_per_node=2 -m materl.distributed.torchrun --batch ... --out ...`` in a real subprocess, on
batch files the driver wrote with ``save_batch``. The versions it publishes equal the one-process
run's weights; a rank killed with SIGKILL in the middle of a step makes torchrun exit non-zero,
leaves no rank running and the version published before intact (and no later one).
"""

import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import torch

from materl.distributed.torchrun import load_published, save_batch
from tests.distributed import helpers as H
from tests.tolerance import assert_same_update

ROOT = Path(__file__).resolve().parents[2]
CASE = "full-sgd"


def batch_files(tmp: Path) -> list[str]:
    paths = []
    for k, blob in enumerate(H.case(CASE)["batches"], start=1):
        episodes, ctx = pickle.loads(blob)
        paths.append(str(save_batch(tmp / f"batch-{k:06d}.pkl", episodes, ctx)))
    return paths


def torchrun(batches: list[str], out: Path, strategy: str, agents: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "-m", "materl.distributed.torchrun", "--batch", *batches, "--out", str(out), "--strategy", strategy,
            "--agents", agents]


def environment(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MODULAR_TELEMETRY_ENABLED": "0", **extra}


def assert_version(out: Path, k: int) -> None:
    """Published version k equals the one-process run after step k; SGD: so does the gradient."""
    ref = H.case(CASE)
    weights = load_published(out, k)
    before, expected = ref["weights"][k - 1], ref["weights"][k]
    got = weights.tensors["policy"]
    assert weights.version == k and sorted(got) == sorted(expected)
    assert_same_update([got[n] for n in expected], list(expected.values()), list(before.values()))
    lr = H.SGD["lr"]
    for n in expected:  # after = before - lr * gradient
        grad, want = (before[n] - got[n]) / lr, (before[n] - expected[n]) / lr
        torch.testing.assert_close(grad, want, rtol=0, atol=1e-6 * max(1.0, float(want.abs().max())))


def test_torchrun_publishes_the_one_process_weights(tmp_path):
    out = tmp_path / "weights"
    run = subprocess.run(torchrun(batch_files(tmp_path), out, "ddp", "tests.distributed.helpers:tiny_agents"),
                         cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=500)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["v000001", "v000002"]
    assert "materl learner: version 2" in run.stdout
    for k in (1, 2):
        assert_version(out, k)
        assert (out / f"v{k:06d}" / "metrics.json").is_file()


def session_processes(sid: int) -> list[int]:
    """Live (non-zombie) processes of session ``sid``."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields after "(comm)": state, ppid, pgrp, session
            pids.append(int(stat.parent.name))
    return pids


def test_a_killed_rank_fails_torchrun_and_keeps_the_last_version(tmp_path):
    out, marker = tmp_path / "weights", tmp_path / "rank1.pid"
    # rank 1 holds at its first forward once version 1 is published: inside step 2 (FSDP2's
    # all-gathers before that forward need rank 0 in step 2, which it enters after publishing)
    env = environment(MATERL_TEST_HOLD=str(out / "v000001"), MATERL_TEST_MARKER=str(marker))
    proc = subprocess.Popen(torchrun(batch_files(tmp_path), out, "fsdp2", "tests.distributed.helpers:slow_rank_agents"),
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        pid = H.wait_for_pid(marker)
        os.kill(pid, signal.SIGKILL)
        log, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0, log[-3000:]
    assert f"Signal 9 (SIGKILL) received by PID {pid}" in log or "exitcode  : -9" in log, log[-3000:]
    assert session_processes(proc.pid) == []  # torchrun stopped the other rank
    assert sorted(p.name for p in out.iterdir()) == ["v000001"]  # nothing of version 2, not even a temp folder
    assert_version(out, 1)
