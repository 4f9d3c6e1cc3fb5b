"""Rollout workers on a real local Ray cluster: the same run as in process, MCP tool servers
owned by each worker, a worker killed mid-episode, and the error without Ray."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import materl as ml
from materl.runtime.tasks import arithmetic_rows
from materl.runtime.train import train
from tests.distributed.tool_recipe import calculator_recipe

ray = pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[2]
KEYS = ("loss", "reward", "tokens", "grad_norm", "episodes", "async/batch_version", "async/staleness_max")


@pytest.fixture(scope="module", autouse=True)
def cluster():
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}})
    yield
    ray.shutdown()


def make_step(delay_s=0.0, **options):
    recipe = calculator_recipe(ml.mcp_tools("python -m materl.tools.calculator"), delay_s=delay_s)
    return ml.compile(recipe, policy=ml.Agent("tiny-random", trainable=True), group_size=2, max_new_tokens=5,
                      lr=1e-3, seed=0, **options)


def run(tmp_path, name, *, workers, steps=3, on_step=None, delay_s=0.0, **options):
    step = make_step(delay_s, **options)
    try:
        out = train(step, arithmetic_rows(16, seed=1), steps=steps, batch_size=2, run_dir=tmp_path / name,
                    progress=False, tensorboard=False, workers=workers, on_step=on_step)
        return out["history"], [p.detach().clone() for p in step.agents["policy"].parameters()]
    finally:
        step.close()


def test_two_ray_workers_make_the_in_process_run(tmp_path):
    """Deterministic mode: 3 asynchronous steps with MCP tool calls on 2 Ray actors give the
    metrics and weights of the in-process run, bit for bit."""
    local, w_local = run(tmp_path, "local", workers=0, max_staleness=1, deterministic=True)
    remote, w_remote = run(tmp_path, "ray", workers=2, max_staleness=1, deterministic=True)
    assert [[h[k] for k in KEYS] for h in local] == [[h[k] for k in KEYS] for h in remote]
    assert all(h["tool_calls"] == 1.0 and h["episodes"] == 4.0 for h in remote)  # every episode called the server
    assert all(torch.equal(p, q) for p, q in zip(w_local, w_remote))


def descendants(pid: int) -> dict[int, str]:
    """Every live process under ``pid``: pid -> command line."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError):
            continue
    found, todo = {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            try:
                found[child] = (Path("/proc") / str(child) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_killed_worker_has_its_episodes_requeued_and_its_tools_stopped(tmp_path, caplog):
    """kill -9 one actor while step 3's episodes wait on their (slow) tool: its groups run again
    on the other worker, no step is lost, and the calculator servers it started exit with it."""
    killed = {}

    def kill_a_worker(step, metrics):
        if step != 2:
            return
        actors = {p: c for p, c in descendants(os.getpid()).items() if "RolloutActor" in c}
        victim = min(actors)
        killed["tools"] = [p for p, c in descendants(victim).items() if "materl.tools.calculator" in c]
        killed["pid"] = victim
        os.kill(victim, signal.SIGKILL)

    history, _ = run(tmp_path, "kill", workers=2, steps=4, on_step=kill_a_worker, delay_s=1.0, max_staleness=1)
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert all(h["episodes"] == 4.0 and h["failed_episodes"] == 0.0 for h in history)
    assert history[-1]["async/requeued"] >= 1
    assert any("died" in r.getMessage() for r in caplog.records)
    assert killed["tools"], "the worker had started its calculator server"
    deadline = time.monotonic() + 20
    while any(alive(p) for p in killed["tools"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in killed["tools"])


def test_workers_without_ray_name_the_extra(tmp_path):
    code = f"""
import sys
class NoRay:
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
sys.meta_path.insert(0, NoRay())
import materl as ml
from materl.errors import ConfigError
from materl.recipes import grpo
from materl.runtime.train import train
step = ml.compile(grpo, policy=ml.Agent("tiny-random", trainable=True), ref_policy=ml.Agent("tiny-random"),
                  group_size=2, max_new_tokens=2)
try:
    train(step, [{{"prompt": "1+1=", "answer": "2"}}], steps=1, batch_size=1, workers=2, run_dir={str(tmp_path)!r},
          progress=False, tensorboard=False)
except ConfigError as exc:
    print("ERROR:", exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert 'ERROR: rollout workers on Ray need Ray: pip install "materl[ray]"' in out.stdout, out.stderr[-2000:]
