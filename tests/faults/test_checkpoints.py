"""Damaged checkpoints and a full disk, against real ``materl train`` runs: a truncated, zeroed
or bit-flipped file (or a missing one) in the latest checkpoint is reported naming the file and
resume falls back to the newest intact checkpoint with a warning (or stops, with
``train.resume_fallback=false``); a save onto a full tmpfs says the disk is full, removes its
temp folder and leaves the previous checkpoint the latest."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import uuid

import pytest

from materl.errors import CheckpointError
from materl.runtime.checkpoint import CheckpointWarning, load_checkpoint

from .conftest import CONFIG, ROOT

WEIGHTS = "agents/policy/model.safetensors"


def train(run_dir, *sets: str, steps: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MODULAR_TELEMETRY_ENABLED": "0"}
    return subprocess.run([sys.executable, "-m", "materl.cli", "train", str(CONFIG), "--set", f"train.run_dir={run_dir}",
                           "--set", f"train.steps={steps}", "--set", "train.save_every=1", "--set", "train.keep_last=3",
                           *sets], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run dir with the checkpoints of steps 1 and 2 (latest: 2)."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    done = train(run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def copy_of(run_dir, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    return out


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def zero(path):
    path.write_bytes(bytes(path.stat().st_size))


def flip_one_float(path):
    """Change the first float of a safetensors file's data by one bit (same size, same header)."""
    data = bytearray(path.read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])  # safetensors: u64 header length, JSON header, data
    data[8 + header_len] ^= 0x01  # the lowest mantissa bit of the first float32
    path.write_bytes(bytes(data))


def remove(path):
    path.unlink()


@pytest.mark.parametrize("rel, damage", [(WEIGHTS, truncate), (WEIGHTS, flip_one_float), ("optim/policy.pt", zero),
                                         ("rng.pt", truncate), ("sched/policy.pt", remove)],
                         ids=["truncated-weights", "one-float-changed", "zeroed-optimizer", "truncated-rng",
                              "missing-scheduler"])
def test_damaged_latest_falls_back_with_a_warning_naming_the_file(trained, tmp_path, rel, damage):
    run_dir = copy_of(trained, tmp_path)
    damage(run_dir / "checkpoints" / "step-000002" / rel)
    with pytest.warns(CheckpointWarning, match=rf"step-000002': file {rel} .*Falling back to .*step-000001"):
        assert load_checkpoint(run_dir).step == 1
    with pytest.raises(CheckpointError, match=rf"step-000002': file {rel} "):
        load_checkpoint(run_dir, fallback=False)


def test_resume_skips_a_damaged_checkpoint_or_stops_by_option(trained, tmp_path):
    run_dir = copy_of(trained, tmp_path)
    zero(run_dir / "checkpoints" / "step-000002" / "optim" / "policy.pt")
    stopped = train(run_dir, "--set", "train.resume=true", "--set", "train.resume_fallback=false", steps=3)
    assert stopped.returncode == 2, stopped.stderr[-3000:]
    assert "materl train: error: checkpoint" in stopped.stderr and "file optim/policy.pt does not match its sha256" in stopped.stderr
    resumed = train(run_dir, "--set", "train.resume=true", steps=3)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "CheckpointWarning" in resumed.stderr and "file optim/policy.pt" in resumed.stderr
    assert json.loads(resumed.stdout)["final"]["step"] == 3
    # resumed from step 1: steps 2 and 3 trained again, and step 2's checkpoint is whole again
    assert load_checkpoint(run_dir / "checkpoints" / "step-000002").step == 2
    assert load_checkpoint(run_dir, fallback=False).step == 3


@pytest.fixture
def small_tmpfs(trained, tmp_path):
    """A tmpfs with room for one checkpoint and a half (skipped where mounting is not allowed)."""
    one = sum(p.stat().st_size for p in (trained / "checkpoints" / "step-000001").rglob("*") if p.is_file())
    mount = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    size_kb = (one * 3 // 2 + (256 << 10)) // 1024
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_disk_during_a_save_says_so_and_keeps_the_previous_checkpoint(small_tmpfs):
    run_dir = small_tmpfs / "run"
    done = train(run_dir, steps=3)
    assert done.returncode == 2, done.stderr[-3000:]
    err = done.stderr
    assert "checkpoint step 2 was not saved: the disk is full" in err, err[-3000:]
    assert f"writing {run_dir}/checkpoints/.tmp-step-000002" in err  # the file it was writing
    assert "a checkpoint needs about" in err and "free on that filesystem" in err
    assert "the previous checkpoint step-000001 is still the latest" in err
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]  # no temp folder left
    assert load_checkpoint(run_dir, fallback=False).step == 1
