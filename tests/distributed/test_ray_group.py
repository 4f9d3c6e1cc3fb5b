"""Learner ranks as Ray actors, on a real local Ray cluster: two FSDP2 actors over gloo learn the
one-process run's batches (LoRA, AdamW with clipping, two shuffled epochs; float64 tiny-random)
and get its weights; one actor killed with SIGKILL in the middle of a step stops the group with
``LearnerRankError`` naming it, the other actor is gone too, and the checkpoint saved before the
kill (``runtime.checkpoint``, safetensors) resumes a new group to the uninterrupted run's weights.
Without Ray importable, asking for the group names the extra to install.
"""

import functools
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from materl.distributed.errors import LearnerGroupClosedError, LearnerRankError
from materl.distributed.ray_group import LearnerGroup
from materl.distributed.state import LearnerState, StateHolder
from materl.runtime.checkpoint import load_checkpoint, restore, save_checkpoint
from tests.distributed import helpers as H
from tests.tolerance import assert_same_update

try:
    import ray
except ImportError:  # the last test needs no Ray; the others do (pip install "materl[ray]", in .[dev])
    ray = None

CASE = "lora-adamw"


@pytest.fixture(scope="module")
def cluster():
    if ray is None:
        pytest.skip('Ray is not installed: pip install "materl[ray]"')
    ray.init(num_cpus=4, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def first(cluster, tmp_path_factory):
    """A 2-actor group whose rank 1 holds (to be killed) once ``hold`` exists, after its first step."""
    tmp = tmp_path_factory.mktemp("ray")
    hold, marker = tmp / "hold", tmp / "rank1.pid"
    ref = H.case(CASE)
    episodes, ctx = pickle.loads(ref["batches"][0])
    group = LearnerGroup(2, ctx.options, agents=functools.partial(H.hold_agents, str(hold), str(marker), True),
                         strategy="fsdp2", num_cpus=1)
    result = group.step(episodes, ctx)
    yield {"group": group, "result": result, "state": group.state(), "hold": hold, "marker": marker, "tmp": tmp}
    hold.unlink(missing_ok=True)
    if group.actors:
        group.shutdown()


def assert_weights(weights, k: int) -> None:
    """Published weights equal the one-process run's after step k (1e-6 of each tensor's scale)."""
    ref = H.case(CASE)
    before, expected = ref["weights"][k - 1], ref["weights"][k]
    assert weights.version == k and sorted(weights.tensors) == ["policy"]
    got = weights.tensors["policy"]
    assert sorted(got) == sorted(expected)  # the LoRA adapters, nothing else
    assert_same_update([got[n] for n in expected], list(expected.values()), list(before.values()))


def test_two_actors_equal_one_process(first):
    result, ref = first["result"], H.case(CASE)
    assert result.version == 1 and first["group"].version == 1
    assert_weights(result.weights, 1)
    assert result.metrics["loss"] == pytest.approx(ref["metrics"][0]["loss"], rel=1e-9, abs=1e-12)
    assert result.metrics["grad_norm"] == pytest.approx(ref["metrics"][0]["grad_norm"], rel=1e-9)
    assert result.metrics["ranks"] == 2.0
    pids = first["group"].pids
    assert len(set(pids)) == 2 and os.getpid() not in pids  # two processes of their own


def save(run_dir, state: LearnerState):
    """A driver-side checkpoint of a learner state: the model through an agent, the optimizer
    through a StateHolder (what the training loop will do)."""
    policy = H.tiny_agents(lora=True)["policy"]
    policy.model.load_state_dict(state.models["policy"])
    return save_checkpoint(run_dir, state.version, agents={"policy": policy},
                           optimizers={"policy": StateHolder(state.optimizers["policy"])})


def load(run_dir) -> LearnerState:
    policy, holder = H.tiny_agents(lora=True)["policy"], StateHolder()
    ckpt = restore(run_dir, agents={"policy": policy}, optimizers={"policy": holder}, rng=False)
    return LearnerState(ckpt.step, {"policy": policy.model.state_dict()}, {"policy": holder.state})


def test_killed_rank_stops_the_group_and_the_checkpoint_resumes(first):
    group, run_dir = first["group"], first["tmp"] / "run"
    save(run_dir, first["state"])
    episodes, ctx = pickle.loads(H.case(CASE)["batches"][1])
    actors, pids, killed = list(group.actors), list(group.pids), []

    def kill_rank_1_mid_step():
        pid = H.wait_for_pid(first["marker"])
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    killer = threading.Thread(target=kill_rank_1_mid_step, daemon=True)
    killer.start()
    first["hold"].touch()  # rank 1's next forward (in the step below) holds until killed
    with pytest.raises(LearnerRankError) as info:
        group.step(episodes, ctx)
    killer.join(timeout=60)
    assert killed == [pids[1]]
    assert info.value.rank == 1 and info.value.pid == pids[1]
    assert f"learner rank 1 (pid {pids[1]}) died during the step to version 2" in str(info.value)
    with pytest.raises(LearnerGroupClosedError, match="stopped after learner rank 1"):
        group.step(episodes, ctx)

    for actor in actors:  # every actor of the group is gone, its process too
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.pid.remote(), timeout=60)
    deadline = time.monotonic() + 60
    while not all(H.gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [H.gone(p) for p in pids] == [True, True]

    first["hold"].unlink()
    ckpt = load_checkpoint(run_dir)  # intact: the version-1 weights the group published
    assert ckpt.step == 1
    state = load(run_dir)
    for name, value in first["result"].weights.tensors["policy"].items():
        assert torch.equal(state.models["policy"][name], value), name
    resumed = LearnerGroup(2, ctx.options, agents=H.lora_agents, strategy="fsdp2", num_cpus=1)
    try:
        resumed.load_state(state)
        assert resumed.version == 1
        result = resumed.step(episodes, ctx)
    finally:
        resumed.shutdown()
    assert_weights(result.weights, 2)  # the uninterrupted run's version 2


BLOCK_RAY = """
import sys

class NoRay:  # as if Ray were not installed: its import fails for real
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoRay())
from materl.compiler.options import CompileOptions
from materl.distributed.errors import ExtraNotInstalledError
from materl.distributed.ray_group import LearnerGroup
try:
    LearnerGroup(2, CompileOptions(), agents=dict)
except ExtraNotInstalledError as exc:
    print("ExtraNotInstalledError:", exc, "| ImportError:", isinstance(exc, ImportError))
"""


def test_without_ray_the_error_names_the_extra():
    out = subprocess.run([sys.executable, "-c", BLOCK_RAY], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MODULAR_TELEMETRY_ENABLED": "0"})
    assert out.returncode == 0, out.stderr
    assert 'ExtraNotInstalledError: learner ranks on Ray need Ray: pip install "materl[ray]"' in out.stdout
    assert "No module named 'ray'" in out.stdout and "| ImportError: True" in out.stdout
