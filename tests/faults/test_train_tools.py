"""Tool faults through a real ``materl train`` (issue #26, item 8): the tiny random model never
writes a tool call, so each run uses a recipe of its own, written next to the test, whose every
episode makes one fixed call after the model's first turn (``force_call`` makes turn 1 look as
if it had asked for it), and whose rewards read that call's result.

- an HTTP calculator server (its own process, on a fixed port) is SIGKILLed while the run holds
  in step 2's update and restarted once a step has logged the outage: the run exits 0, every
  step is in metrics.jsonl, the outage steps count ``infra_failures/unavailable``, the step the
  outage left with nothing to learn from is skipped (``infra_failures/update_skipped``), the last
  steps' calls succeed again and the last checkpoint verifies.
- the python sandbox server runs, in every episode, the attacks of test_tools_sandbox.py (memfd,
  SysV shm, a big /dev/shm write, AF_VSOCK, /proc/self/mountinfo): the run exits 0, every step's
  reward for each attack is 1.0 (refused), shared memory on the host never grows by what an
  attack tried to pin, and no process of the run is left.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from materl.runtime.checkpoint import load_checkpoint

from .conftest import CONFIG, ROOT, assert_no_leftovers, family, start_run, stop_session
from .test_tools_http_restart import free_port, start_server

FORCE_CALL = '''
import json, os
from dataclasses import replace

import materl as ml
from materl.rollout.multiturn import TurnResult
from materl.rollout.types import ToolCall


def forcing(name, arguments):
    """An op that makes turn 1 look as if the model had called ``name(**arguments)``."""
    @ml.op
    async def force_call(turn):
        step = replace(turn.step, tool_calls=[ToolCall(name, dict(arguments), id="fixed")])
        return TurnResult(replace(turn.history, steps=turn.history.steps[:-1] + [step], done=False), step)
    return force_call


def one_call_recipe(toolbox, force_call, rewards):
    @ml.recipe
    def one_call(policy, prompts):
        turn_1 = ml.generate_step(policy, prompts, name="turn_1")
        called = force_call(turn_1)
        results = ml.call_tools(called, tools=toolbox, name="tool_results")
        turn_2 = ml.generate_step(policy, called.history, results, name="turn_2")
        rollout = ml.structure_rollout(turn_2, name="rollout")
        terms = [ml.reward(fn, rollout=rollout, name=fn.__name__) for fn in rewards]
        total = terms[0]
        for t in terms[1:]:
            total = total + t
        advantages = ml.advantages(total, estimator="grpo", completions=rollout)
        ml.set_loss(ml.policy_loss(advantages, ml.logprobs(policy, prompts, rollout)))
    return one_call
'''

HTTP_RECIPE = FORCE_CALL + '''

def calc_ok(*, rollouts, **_):
    """1 when the episode's call returned 42."""
    return [1.0 if [(r.is_error, r.content) for r in ro.tool_results] == [(False, "42")] else 0.0 for ro in rollouts]


calculator = ml.mcp_tools(ml.MCPServer(url=os.environ["FAULT_TOOL_URL"], name="calc", reconnect_s=3.0), timeout_s=10)
recipe = one_call_recipe(calculator, forcing("calculate", {"expression": "6 * 7"}), [calc_ok])
'''

ATTACKS = r'''
import ctypes, json, os, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.shmget.restype = ctypes.c_int
out = {}
try:
    fd = os.memfd_create("pin")
    for _ in range(300):
        os.write(fd, b"x" * (1 << 20))
    out["memfd"] = "wrote 300 MB"
except OSError as e:
    out["memfd"] = e.errno
out["shmget"] = [libc.shmget(0, 300 << 20, 0o1000 | 0o600), ctypes.get_errno()]
written, err = 0, None
try:
    with open("/dev/shm/pin", "wb") as f:
        for _ in range(300):
            f.write(b"x" * (1 << 20))
            f.flush()
            written += 1 << 20
except OSError as e:
    err = e.errno
out["dev_shm"] = [written, err]
try:
    socket.socket(40, socket.SOCK_STREAM).close()
    out["vsock"] = "ok"
except OSError as e:
    out["vsock"] = e.errno
try:
    out["mountinfo"] = open("/proc/self/mountinfo").read()
except OSError as e:
    out["mountinfo"] = e.errno
print(json.dumps(out))
'''

SANDBOX_RECIPE = FORCE_CALL + '''
ATTACKS = {attacks!r}


def report(rollout):
    """The attack program's JSON line, or {{}} when the call failed."""
    results = rollout.tool_results
    if len(results) != 1 or results[0].is_error:
        return {{}}
    return json.loads(results[0].content.rstrip().splitlines()[-1])


def memfd_refused(*, rollouts, **_):
    return [float(report(r).get("memfd") == 1) for r in rollouts]  # EPERM


def shmget_refused(*, rollouts, **_):
    return [float(report(r).get("shmget") == [-1, 1]) for r in rollouts]


def dev_shm_bounded(*, rollouts, **_):  # stops at the 16 MiB tmpfs or file size limit: ENOSPC or EFBIG
    return [float(r.get("dev_shm", [None])[0] is not None and r["dev_shm"][0] <= 16 << 20
                  and r["dev_shm"][1] in (27, 28)) for r in map(report, rollouts)]


def vsock_refused(*, rollouts, **_):
    return [float(report(r).get("vsock") == 1) for r in rollouts]


def no_mountinfo(*, rollouts, **_):
    return [float(report(r).get("mountinfo") in (2, 13)) for r in rollouts]


sandbox = ml.mcp_tools("python -m materl.tools.python_sandbox --memory-mb 256", timeout_s=60)
recipe = one_call_recipe(sandbox, forcing("run_python", {{"code": ATTACKS, "timeout_s": 20}}),
                         [memfd_refused, shmget_refused, dev_shm_bounded, vsock_refused, no_mountinfo])
'''


def write_recipe(tmp_path: Path, text: str, monkeypatch) -> list[str]:
    """The recipe as module ``fault_recipes.tools`` on the child's PYTHONPATH; its --set overrides."""
    package = tmp_path / "modules" / "fault_recipes"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "tools.py").write_text(text)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(package.parent), os.environ.get("PYTHONPATH")])))
    return ["--set", "recipe=fault_recipes.tools:recipe", "--set", "rewards=[]"]


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if "step" in r and not any(k.startswith("eval") for k in r)]


def test_http_tool_server_restarted_during_training(tmp_path, monkeypatch):
    port = free_port()
    servers = [start_server(port)]
    monkeypatch.setenv("FAULT_TOOL_URL", f"http://127.0.0.1:{port}/mcp")
    sets = write_recipe(tmp_path, HTTP_RECIPE, monkeypatch)
    # held 1.5 s in step 2's update (step 1 saved, step 2's calls answered): the server dies there,
    # so step 3's calls find it gone and fail as 'unavailable' after waiting reconnect_s = 3 s each,
    # side by side (test_tools_http_restart.py::test_calls_in_flight_during_an_outage_wait_side_by_side).
    # The default infra_failures="mask" leaves those episodes out: step 3 has nothing to learn from
    # and is skipped (no update), and the run goes on (max_skipped_steps=3 in a row).
    child, run_dir = start_run(tmp_path, "learner", *sets, "--set", "logging.samples_every=1", pause=1.5, steps=8)
    try:
        servers[0].send_signal(signal.SIGKILL)
        servers[0].wait()
        deadline = time.monotonic() + 60
        while not any("infra_failures/unavailable" in r for r in records(run_dir)):
            if child.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no step logged the outage (exit {child.poll()})")
            time.sleep(0.1)
        servers.append(start_server(port))  # the same port, a new process; later steps' calls wait for it
        _, err = child.communicate(timeout=90)
    finally:
        if child.poll() is None:
            stop_session(child)
        for proc in servers:
            proc.kill()
            proc.wait()
    assert child.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    steps = records(run_dir)
    assert [r["step"] for r in steps] == list(range(1, 9))
    outage = [r["step"] for r in steps if r.get("infra_failures/unavailable", 0) > 0]
    assert outage[0] == 3 and outage == list(range(3, outage[-1] + 1)), outage  # from the first step after the kill
    # 4 episodes a step (2 prompts x group_size 2): step 3 ran wholly in the outage
    # its rewards (0 for every episode) are not the model's: the reward metrics leave them out
    assert steps[2]["infra_failures/unavailable"] == 4.0 and steps[2]["masked_episodes"] == 4.0
    assert "reward" not in steps[2] and "reward/calc_ok/mean" not in steps[2]
    assert steps[2]["infra_failures/episodes_masked"] == 4.0 and steps[2]["infra_failures/update_skipped"] == 1.0
    assert "loss" not in steps[2] and "loss" in steps[-1]  # the skipped step took no optimizer step
    skipped = [r["step"] for r in steps if r["infra_failures/update_skipped"] == 1.0]
    assert set(skipped) <= set(outage) and steps[-1]["infra_failures/update_skipped"] == 0.0, skipped
    said = " ".join(err.split())  # the warning, as the log handler wrapped it
    assert "step 3 made no update" in said and "4 x unavailable); the step is skipped" in said, err[-3000:]
    assert steps[0]["reward/calc_ok/mean"] == steps[1]["reward/calc_ok/mean"] == 1.0
    assert steps[-1]["reward/calc_ok/mean"] == 1.0 and "infra_failures/unavailable" not in steps[-1]
    assert outage[-1] < 8  # the server was used again
    # what the episodes read (samples/): the outage as a tool error naming the server, then 42 again
    during = (run_dir / "samples" / "step-000003.txt").read_text()
    assert "tool 'calculate' is unavailable: its server 'calc' is down" in during, during[-2000:]
    assert "reconnecting continues" in during
    after = (run_dir / "samples" / "step-000008.txt").read_text()
    assert "unavailable" not in after and len(re.findall(r"< calculate \[ok, [\d.]+s\]: 42\n", after)) == 4, after
    assert load_checkpoint(run_dir, fallback=False).step == 8  # every file checked against its manifest
    assert_no_leftovers(child)


@pytest.mark.skipif(sys.platform != "linux", reason="the sandbox is built from Linux namespaces")
def test_sandbox_attacks_during_training(tmp_path, monkeypatch):
    sets = write_recipe(tmp_path, SANDBOX_RECIPE.format(attacks=ATTACKS), monkeypatch)
    run_dir = tmp_path / "run"
    args = ["train", str(CONFIG), "--set", f"train.run_dir={run_dir}", "--set", "train.steps=3",
            "--set", "logging.samples_every=1", *sets]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MODULAR_TELEMETRY_ENABLED": "0"}
    shmem_before, peak = shmem_kb(), {"rss_kb": 0, "shmem_kb": 0}
    child = subprocess.Popen([sys.executable, "-m", "materl.cli", *args], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen: dict[int, str] = {}
    watcher = threading.Thread(target=watch, args=(child, seen, peak), daemon=True)
    watcher.start()
    try:
        _, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            stop_session(child)
        watcher.join()
    assert child.returncode == 0, err[-3000:]
    assert any("python_sandbox" in cmd for cmd in seen.values()), seen  # the server ran under the run
    steps = records(run_dir)
    assert [r["step"] for r in steps] == [1, 2, 3]
    for term in ("memfd_refused", "shmget_refused", "dev_shm_bounded", "vsock_refused", "no_mountinfo"):
        assert [r[f"reward/{term}/mean"] for r in steps] == [1.0] * 3, (term, steps)
    sample = (run_dir / "samples" / "step-000003.txt").read_text()  # what the episodes read
    assert sample.count('"memfd": 1, "shmget": [-1, 1]') == 4 and '"vsock": 1, "mountinfo": 2' in sample, sample[-3000:]
    # 4 episodes a step each tried to pin 300 MB three ways: the host's shared memory grew by at most
    # the sandboxes' 16 MiB /dev/shm each (other users of this machine add noise; 200 MB is far below
    # one successful attack), and the run's processes together stayed under 3 GB resident.
    assert peak["shmem_kb"] - shmem_before < 200 * 1024, (peak, shmem_before)
    assert peak["rss_kb"] < 3 * 1024 * 1024, peak
    assert_no_leftovers(child, seen)


def shmem_kb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1])
    return 0


def watch(child: subprocess.Popen, seen: dict[int, str], peak: dict[str, int]) -> None:
    """Every 50 ms until the child exits: the processes it started, and the peak of their summed
    resident memory and of the host's shared memory."""
    while child.poll() is None:
        procs = {child.pid: "materl train", **family(child)}
        seen.update(procs)
        rss = 0
        for pid in procs:
            try:
                rss += next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                            if line.startswith("VmRSS:"))
            except (OSError, StopIteration):
                pass
        peak["rss_kb"] = max(peak["rss_kb"], rss)
        peak["shmem_kb"] = max(peak["shmem_kb"], shmem_kb())
        time.sleep(0.05)
    seen.pop(child.pid, None)
