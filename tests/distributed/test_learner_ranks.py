"""The whole stack on a real local Ray cluster: rollout actors with their MCP tool servers, learner
ranks in one gloo group, the asynchronous pipeline between them, and ``materl train`` driving it
(a learner rank killed with SIGKILL stops the run; the last checkpoint resumes; a step skipped
for a tool outage advances the ranks' version too)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import materl as ml
from materl.runtime.checkpoint import load_checkpoint
from materl.runtime.tasks import arithmetic_rows
from materl.runtime.train import train
from tests.compiler.test_infra_failures import train_through_an_outage
from tests.distributed.test_ray_workers import alive, descendants
from tests.distributed.tool_recipe import calculator_recipe

ray = pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[2]
SAME = ("reward", "tokens", "episodes", "tool_calls", "async/batch_version", "async/staleness_max")
CLOSE = ("loss", "grad_norm", "entropy")


@pytest.fixture
def cluster():
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}})
    yield
    ray.shutdown()


def run(tmp_path, name, *, workers, ranks, steps=3):
    recipe = calculator_recipe(ml.mcp_tools("python -m materl.tools.calculator"), diversity=1.0)
    step = ml.compile(recipe, policy=ml.Agent("tiny-random", trainable=True), group_size=2, max_new_tokens=5,
                      lr=1e-2, seed=0, max_staleness=1, deterministic=True)
    before = {n: p.detach().clone() for n, p in step.agents["policy"].model.named_parameters()}
    try:
        out = train(step, arithmetic_rows(16, seed=1), steps=steps, batch_size=2, run_dir=tmp_path / name,
                    progress=False, tensorboard=False, workers=workers, learner_ranks=ranks, learner_strategy="ddp",
                    lr_schedule="linear")
        return out["history"], before, {n: p.detach().clone() for n, p in step.agents["policy"].model.named_parameters()}
    finally:
        step.close()


def test_rollout_actors_and_learner_ranks_make_the_one_process_run(tmp_path, cluster):
    """Deterministic mode, S=1: 3 asynchronous steps with calculator calls over MCP on 2 Ray
    rollout actors and 2 gloo learner ranks (DDP) give the in-process, one-learner run: the same
    batches (versions, rewards, tool calls) and, float32 gradients being summed in another order,
    the same losses and weights to float32 precision. A linear LR schedule runs on the driver:
    the ranks learn with its rates (2/3 and 1/3 of the first at steps 2 and 3)."""
    local, start, w_local = run(tmp_path, "local", workers=0, ranks=1)
    stack, _, w_stack = run(tmp_path, "stack", workers=2, ranks=2)
    assert [h["step"] for h in stack] == [1, 2, 3]
    assert [h["lr"] for h in stack] == pytest.approx([1e-2, 1e-2 * 2 / 3, 1e-2 / 3])
    assert [[h[k] for k in SAME] for h in stack] == [[h[k] for k in SAME] for h in local]
    assert [h["async/batch_version"] for h in stack] == [0.0, 0.0, 1.0]  # batch k sampled from version max(0, k-1)
    assert all(h["tool_calls"] == 1.0 and h["episodes"] == 4.0 and h["ranks"] == 2.0 for h in stack)
    turns = [k for k in local[0] if k.startswith("advantages/")]
    assert "advantages/turn_1/mean" in turns and "advantages/last_turn/std" in turns  # the calculator's 2 turns
    for h_local, h_stack in zip(local, stack):
        for k in (*CLOSE, *turns):
            assert h_stack[k] == pytest.approx(h_local[k], rel=1e-4, abs=1e-6), k
    moved = max(float((w_local[n] - p).abs().max()) for n, p in start.items())
    assert moved > 1e-3  # training changed the weights, so equal weights mean equal updates
    for n, p in w_local.items():  # each parameter's update to 1% of its largest element: AdamW divides by
        # sqrt(v), so an element whose gradient is near 0 magnifies float32 summation-order differences
        update, expected = w_stack[n] - start[n], p - start[n]
        torch.testing.assert_close(update, expected, rtol=0, atol=0.01 * float(expected.abs().max()),
                                   msg=lambda m, n=n: f"{n}: {m}")


def materl_train(run_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "materl.cli", "train", "examples/configs/tiny_grpo.yaml", "--set",
         f"train.run_dir={run_dir}", "--set", "train.save_every=1", "--set", "distributed.learner_ranks=2",
         "--set", "distributed.learner_strategy=fsdp2", *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def rank_pids(pid: int) -> list[int]:
    return sorted(p for p, cmd in descendants(pid).items() if "ray::_Rank" in cmd)


def test_a_killed_learner_rank_stops_materl_train_and_the_checkpoint_resumes(tmp_path):
    """``materl train`` with 2 FSDP2 learner ranks: kill -9 one rank's process once step 2's checkpoint
    is written; the command exits 2 naming the rank and its pid, the last checkpoint loads, and
    ``train.resume`` goes on from it to the end."""
    run_dir = tmp_path / "run"
    proc = materl_train(run_dir, "--set", "train.steps=40", "--set", "train.keep_last=40")
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "checkpoints" / "step-000002").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.1)
        ranks = rank_pids(proc.pid)
        assert len(ranks) == 2, descendants(proc.pid)
        os.kill(ranks[1], signal.SIGKILL)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, err[-3000:]
    assert "materl train: error: learner rank" in err and f"(pid {ranks[1]}) died" in err, err[-3000:]
    assert not any(alive(p) for p in ranks)  # the group was stopped: the other rank too
    ckpt = load_checkpoint(run_dir)  # the latest: written whole, before the kill or after it
    last = int(ckpt.step)
    assert 2 <= last < 40
    resumed = subprocess.run(
        [sys.executable, "-m", "materl.cli", "train", "examples/configs/tiny_grpo.yaml", "--set", f"train.run_dir={run_dir}",
         "--set", "train.resume=true", "--set", f"train.steps={last + 1}", "--set", "distributed.learner_ranks=2",
         "--set", "distributed.learner_strategy=fsdp2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout)["final"]["step"] == last + 1
    assert int(load_checkpoint(run_dir).step) == last + 1


def test_learner_ranks_count_the_skipped_step_too(tmp_path):
    # 2 DDP learner ranks on a local Ray cluster: the skipped step advances their version with the
    # driver's (step 2 trains to version 2), and the driver's weights stay until then
    out, start, end = train_through_an_outage(tmp_path / "run", learner_ranks=2)
    history = out["history"]
    assert [h["infra_failures/update_skipped"] for h in history] == [1.0, 0.0, 0.0]
    assert [h.get("version") for h in history] == [None, 2.0, 3.0] and history[1]["ranks"] == 2.0
    assert [h["lr"] for h in history] == pytest.approx([1e-2, 1e-2 * 2 / 3, 1e-2 / 3])
    first = load_checkpoint(tmp_path / "run" / "checkpoints" / "step-000001", fallback=False)
    saved = load_file(str(Path(first.path) / "agents" / "policy" / "model.safetensors"))
    assert all(torch.equal(saved[k], start[k]) for k in saved)
    assert any(not torch.equal(end[k], start[k]) for k in start)
