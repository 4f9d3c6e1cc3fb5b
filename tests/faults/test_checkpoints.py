"""Damaged checkpoints and a full disk, against real ``materl train`` runs: a truncated, zeroed
or bit-flipped file (or a missing one) in the latest checkpoint is reported naming the file and
resume falls back to the newest intact checkpoint with a warning (or stops, with
``train.resume_fallback=false``); so does a malformed manifest or state.json (valid JSON, wrong
shape), a format-2 checkpoint whose manifest was deleted, a manifest path or a symlink leading out
of the checkpoint folder and a ``latest`` leading out of the run; a save onto a full tmpfs says
the disk is full, removes its temp folder and leaves the previous checkpoint the latest."""

from __future__ import annotations

import hashlib
import json
import os
import re
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


# ----------------------------------------------------------------------------- the manifest, state.json and latest


STEP2 = "checkpoints/step-000002"


def edit_manifest(run_dir, change):
    path = run_dir / STEP2 / "manifest.json"
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps(change(manifest)))


def rehash(run_dir):
    """Rewrite step 2's manifest over its files as they are now (whoever edits can do that too)."""
    from materl.runtime.checkpoint import _write_text
    from materl.runtime.manifest import write_manifest

    (run_dir / STEP2 / "manifest.json").unlink()
    write_manifest(run_dir / STEP2, _write_text)


def entry(manifest, rel="rng.pt"):
    return manifest["files"][rel]


MALFORMED_MANIFESTS = {  # valid JSON, wrong shape: each a traceback before (AttributeError, TypeError, KeyError)
    "files-as-a-list": (lambda m: {**m, "files": sorted(m["files"])}, "expected an object with 'files' an object"),
    "entry-as-a-string": (lambda m: {**m, "files": {**m["files"], "rng.pt": entry(m)["sha256"]}},
                          "entry 'rng.pt' is \"[0-9a-f]{64}\"; expected"),
    "entry-without-sha256": (lambda m: {**m, "files": {**m["files"], "rng.pt": {"size": entry(m)["size"]}}},
                             "entry 'rng.pt' is {\"size\": \\d+}; expected"),
    "size-as-a-string": (lambda m: {**m, "files": {**m["files"], "rng.pt": {**entry(m), "size": str(entry(m)["size"])}}},
                         "entry 'rng.pt' is .*expected"),
    "sha256-not-hex": (lambda m: {**m, "files": {**m["files"], "rng.pt": {**entry(m), "sha256": 12345}}},
                       "entry 'rng.pt' is .*expected"),
    "manifest-a-list": (lambda m: [m], "got a JSON list"),
    "files-missing": (lambda m: {"algorithm": "sha256"}, "got NoneType"),
}


@pytest.mark.parametrize("kind", MALFORMED_MANIFESTS)
def test_a_malformed_manifest_is_a_damaged_checkpoint(trained, tmp_path, kind):
    change, message = MALFORMED_MANIFESTS[kind]
    run_dir = copy_of(trained, tmp_path)
    edit_manifest(run_dir, change)
    with pytest.warns(CheckpointWarning, match=rf"step-000002': manifest.json is malformed: .*{message}.*Falling back "
                                               rf"to .*step-000001"):
        assert load_checkpoint(run_dir).step == 1
    with pytest.raises(CheckpointError, match="manifest.json is malformed"):
        load_checkpoint(run_dir, fallback=False)
    with pytest.raises(CheckpointError, match="manifest.json is malformed"):
        load_checkpoint(run_dir / STEP2)  # named itself: never swapped for another


MALFORMED_STATES = {  # manifests rewritten over them, so only the schema can tell
    "agents-a-string": (lambda s: {**s, "agents": "policy"}, "'agents' is \"policy\", expected a list of names"),
    "step-a-string": (lambda s: {**s, "step": "2"}, "'step' is \"2\", expected an int >= 0"),
    "agent-leading-out": (lambda s: {**s, "agents": ["../../../step-000001/agents/policy"]},
                          "expected a list of names .each a file name without '/'"),
    "state-a-list": (lambda s: [s], "a JSON list, not an object"),
}


@pytest.mark.parametrize("kind", MALFORMED_STATES)
def test_a_malformed_state_json_is_a_damaged_checkpoint(trained, tmp_path, kind):
    change, message = MALFORMED_STATES[kind]
    run_dir = copy_of(trained, tmp_path)
    state = run_dir / STEP2 / "state.json"
    state.write_text(json.dumps(change(json.loads(state.read_text()))))
    rehash(run_dir)
    with pytest.warns(CheckpointWarning, match=rf"file state.json is malformed: .*{message}.*Falling back"):
        assert load_checkpoint(run_dir).step == 1


def test_a_format_2_checkpoint_without_its_manifest_is_damaged(trained, tmp_path):
    run_dir = copy_of(trained, tmp_path)
    flip_one_float(run_dir / STEP2 / WEIGHTS)  # one changed float, and the manifest that would tell deleted
    remove(run_dir / STEP2 / "manifest.json")
    with pytest.warns(CheckpointWarning, match=r"step-000002': manifest.json is missing, but state.json says format 2, "
                                               r"which always has one.*Falling back to .*step-000001"):
        assert load_checkpoint(run_dir).step == 1  # before: step 2 resumed silently, one float different
    with pytest.raises(CheckpointError, match="manifest.json is missing, but state.json says format 2"):
        load_checkpoint(run_dir / STEP2)


def test_manifest_paths_leading_out_of_the_checkpoint_are_damage(trained, tmp_path):
    run_dir = copy_of(trained, tmp_path)
    outside = run_dir / "outside.bin"
    outside.write_bytes(b"planted")
    listed = {"size": 7, "sha256": hashlib.sha256(b"planted").hexdigest()}  # right size and hash: only the path is wrong
    for rel, why in (("../../outside.bin", "is not a path inside the checkpoint folder"),
                     (str(outside), "is not a path inside the checkpoint folder"),
                     ("optim/./policy.pt", "is not a path inside the checkpoint folder")):
        run = copy_of(run_dir, tmp_path / rel.replace("/", "_"))
        edit_manifest(run, lambda m: {**m, "files": {**m["files"], rel: listed}})
        with pytest.warns(CheckpointWarning, match=rf"manifest entry '{re.escape(rel)}' {why}.*Falling back"):
            assert load_checkpoint(run).step == 1


def test_symlinks_leading_out_of_a_checkpoint_are_damage(trained, tmp_path):
    run_dir = copy_of(trained, tmp_path)
    other = copy_of(trained, tmp_path / "other")  # another run's checkpoint, intact
    rng = run_dir / STEP2 / "rng.pt"
    rng.unlink()
    rng.symlink_to(other / STEP2 / "rng.pt")  # a file that is a link to another run's
    rehash(run_dir)  # the manifest now agrees with what the link reads
    with pytest.warns(CheckpointWarning, match=r"manifest entry 'rng.pt' leads outside the checkpoint folder .*through a "
                                               r"symlink.*Falling back to .*step-000001"):
        assert load_checkpoint(run_dir).step == 1
    run_dir = copy_of(trained, tmp_path / "dir")
    agents = run_dir / STEP2 / "agents"
    shutil.rmtree(agents)
    agents.symlink_to(other / STEP2 / "agents")  # a folder that is a link
    with pytest.warns(CheckpointWarning, match=r"manifest entry 'agents/policy/.*' leads outside"):
        assert load_checkpoint(run_dir).step == 1


def test_latest_is_confined_to_its_run(trained, tmp_path):
    run_dir = copy_of(trained, tmp_path)
    other = copy_of(trained, tmp_path / "other")
    latest = run_dir / "checkpoints" / "latest"
    latest.write_text(f"../../other/run/{STEP2}\n")  # another run's checkpoint, by a relative path
    with pytest.warns(CheckpointWarning, match=r"latest' names '\.\./\.\./other/run/checkpoints/step-000002', not a "
                                               r"step-NNNNNN folder beside it.*Falling back to .*run/checkpoints/step-000002"):
        assert load_checkpoint(run_dir).path == run_dir / STEP2  # this run's own newest
    with pytest.raises(CheckpointError, match="not a step-NNNNNN folder beside it"):
        load_checkpoint(run_dir, fallback=False)
    latest.write_text(str(other / STEP2))  # ... by an absolute path
    with pytest.warns(CheckpointWarning, match="not a step-NNNNNN folder beside it"):
        assert load_checkpoint(run_dir).path == run_dir / STEP2
    # a step folder of this run that is a link to another run's: not one of this run's checkpoints
    latest.write_text("step-000003\n")
    (run_dir / "checkpoints" / "step-000003").symlink_to(other / STEP2)
    with pytest.warns(CheckpointWarning, match=r"names step-000003, which leads outside this run"):
        assert load_checkpoint(run_dir).path == run_dir / STEP2


def test_resume_from_a_malformed_manifest_falls_back_without_a_traceback(trained, tmp_path):
    run_dir = copy_of(trained, tmp_path)
    edit_manifest(run_dir, lambda m: {**m, "files": sorted(m["files"])})
    resumed = train(run_dir, "--set", "train.resume=true", steps=3)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stderr
    assert "CheckpointWarning" in resumed.stderr and "manifest.json is malformed" in resumed.stderr
    assert json.loads(resumed.stdout)["final"]["step"] == 3
    stop_dir = copy_of(trained, tmp_path / "stop")
    edit_manifest(stop_dir, lambda m: [m])
    stopped = train(stop_dir, "--set", "train.resume=true", "--set", "train.resume_fallback=false", steps=3)
    assert stopped.returncode == 2 and "Traceback" not in stopped.stderr
    assert "materl train: error: checkpoint" in stopped.stderr and "manifest.json is malformed" in stopped.stderr
