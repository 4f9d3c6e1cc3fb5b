"""The local Ray cluster materl starts (issue #26, item 7): its services listen on loopback
only (Ray's services do not authenticate: the ShadowRay attacks); losing every rollout worker
ends ``materl train`` with a clear message and exit 2; more threads than cores is warned about,
with the figures."""

import ipaddress
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from materl.distributed.ray_workers import warn_if_oversubscribed
from tests.distributed.test_ray_workers import alive, descendants

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")
ROOT = Path(__file__).resolve().parents[2]


def listening(pids: set[int]) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every TCP/UDP socket those processes listen on."""
    found = []
    for conn in psutil.net_connections("inet"):
        if conn.pid in pids and (conn.status == psutil.CONN_LISTEN or conn.type == 2 and not conn.raddr):
            try:
                name = psutil.Process(conn.pid).name()
            except psutil.Error:
                name = "?"
            found.append((conn.laddr.ip, conn.laddr.port, name))
    return found


def loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def test_the_local_cluster_listens_on_loopback_and_losing_every_worker_exits_2(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "materl.cli", "train", "examples/configs/tiny_grpo.yaml", "--set",
         f"train.run_dir={run_dir}", "--set", "train.steps=400", "--set", "train.keep_last=2",
         "--set", "distributed.workers=1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "RAY_ADDRESS": ""})
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "checkpoints" / "step-000001").exists():  # a liveness wait
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.1)
        tree = descendants(proc.pid)
        sockets = listening({proc.pid, *tree})
        names = {name for _, _, name in sockets}
        assert "gcs_server" in names and "raylet" in names, sockets  # the services were found
        assert [s for s in sockets if not loopback(s[0])] == [], sockets
        actors = [pid for pid, cmd in tree.items() if "ray::RolloutActor" in cmd]
        assert len(actors) == 1, tree
        os.kill(actors[0], signal.SIGKILL)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 2, err[-3000:]
    assert "materl train: error: every rollout worker has died (1 of 1), so the run cannot sample any more: " \
           "rollout-0: " in err, err[-3000:]
    assert "train.resume=true" in err and "Traceback" not in err, err[-3000:]
    assert not alive(actors[0])


def test_more_threads_than_cores_is_warned_with_the_figures():
    cores = len(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # cores - 1 workers x 1 thread + the learner's 1 = cores: they fit, no warning
        assert warn_if_oversubscribed(cores - 1, 1) is None
        # cores workers x 1 thread + 1 = cores + 1 threads on `cores` cores
        with pytest.warns(RuntimeWarning) as caught:
            message = warn_if_oversubscribed(cores, 1)
        assert message == str(caught[0].message)
        assert message.startswith(f"materl: {cores} rollout worker(s) x 1 torch thread(s) + 1 learner thread(s) in "
                                  f"this process = {cores + 1} threads on {cores} CPU core(s)")
        # cores workers x 2 threads + 1 = 2 * cores + 1
        with pytest.warns(RuntimeWarning, match=rf"x 2 torch thread\(s\) \+ 1 learner thread\(s\) in this process = "
                                                rf"{2 * cores + 1} threads on {cores} CPU core"):
            warn_if_oversubscribed(cores, 2)
    finally:
        torch.set_num_threads(threads)

