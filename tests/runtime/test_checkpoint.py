"""Checkpoints: save/restore round trip (weights, optimizer, scheduler, RNG), atomicity under a
crash (SIGKILL mid-save), pruning, ``latest`` resolution, weights-only loading."""

import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from materl.agent import Agent
from materl.errors import ConfigError
import materl.runtime.checkpoint as ck
from materl.runtime.checkpoint import (
    load_checkpoint, resolve_checkpoint, restore, save_checkpoint,
)
from materl.runtime.manifest import write_manifest
from materl.runtime.config import validate_config

IDS = torch.tensor([[257, 72, 105, 33, 258]])  # "<|im_start|>Hi!<|im_end|>" in the byte tokenizer


def make_run(lr=1e-2):
    policy = Agent("tiny-random", trainable=True)
    critic = Agent("tiny-random", trainable=True, head="value", lora=dict(r=2, alpha=4))
    ref = Agent("tiny-random")
    agents = {"policy": policy, "ref_policy": ref, "value_model": critic}
    opts = {"policy": torch.optim.AdamW(policy.parameters(), lr=lr),
            "value_model": torch.optim.AdamW(critic.parameters(), lr=lr)}
    scheds = {k: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (s + 1)) for k, o in opts.items()}
    return agents, opts, scheds


def train_step(agents, opts, scheds):
    mask = torch.ones_like(IDS)
    noise = torch.randn(())  # consumes the torch RNG, so a restored RNG matters for the next step
    loss = agents["policy"].model(IDS, attention_mask=mask).logits.logsumexp(-1).mean() * (1 + 0.01 * noise)
    loss = loss + agents["value_model"].values(IDS, mask).pow(2).mean()
    loss.backward()
    for name, opt in opts.items():
        opt.step()
        opt.zero_grad()
        scheds[name].step()


def weights(agents):
    return {f"{a}.{k}": v.detach().clone() for a, ag in agents.items() for k, v in ag.model.state_dict().items()}


def test_round_trip_resumes_bit_identically(tmp_path):
    torch.manual_seed(0)
    agents, opts, scheds = make_run()
    train_step(agents, opts, scheds)
    cfg = validate_config({"train": {"steps": 5}})
    path = save_checkpoint(tmp_path, 1, agents=agents, optimizers=opts, schedulers=scheds,
                           data_state={"sampler": {"epoch": 0, "index": 4}}, config=cfg,
                           metrics={"loss": 0.5, "name": "x", "bad": float("nan")})
    assert path == tmp_path / "checkpoints" / "step-000001"
    # the original run continues: one more step from the saved state, then RNG draws
    train_step(agents, opts, scheds)
    expected_w, expected_lr = weights(agents), scheds["policy"].get_last_lr()
    expected_draws = (torch.rand(3), random.random(), np.random.rand())

    # a fresh process-equivalent: new agents/optimizers, a scrambled RNG, then restore
    torch.manual_seed(123), random.seed(123), np.random.seed(123)
    agents2, opts2, scheds2 = make_run()
    ckpt = restore(load_checkpoint(tmp_path), agents=agents2, optimizers=opts2, schedulers=scheds2)
    assert (ckpt.step, ckpt.data_state, ckpt.metrics) == (1, {"sampler": {"epoch": 0, "index": 4}}, {"loss": 0.5})
    assert ckpt.config["train"]["steps"] == 5 and ckpt.agents["value_model"]["head"] == "value"
    assert ckpt.agents["value_model"]["lora"] == {"r": 2, "alpha": 4} and ckpt.agents["policy"]["trainable"]
    assert opts2["policy"].state_dict()["state"][0]["step"] == 1  # Adam moments came back
    train_step(agents2, opts2, scheds2)
    got_w = weights(agents2)
    assert got_w.keys() == expected_w.keys()
    for k in expected_w:
        assert torch.equal(got_w[k], expected_w[k]), k
    assert scheds2["policy"].get_last_lr() == expected_lr
    assert torch.equal(torch.rand(3), expected_draws[0])
    assert random.random() == expected_draws[1] and np.random.rand() == expected_draws[2]


def tiny_agents():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return {"policy": SimpleNamespace(model=model, source="tiny-random", trainable=True)}, {"policy": opt}


def test_keep_last_and_latest(tmp_path):
    agents, opts = tiny_agents()
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, agents=agents, optimizers=opts, keep_last=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000003", "step-000004"]
    assert (root / "latest").read_text().strip() == "step-000004"
    # a run dir, its checkpoints folder and the step folder itself all resolve
    for p in (tmp_path, root, root / "step-000003"):
        assert resolve_checkpoint(p).name == ("step-000003" if p.name == "step-000003" else "step-000004")
    (root / "latest").unlink()  # without a pointer: the highest complete step
    assert resolve_checkpoint(tmp_path).name == "step-000004"


def test_resaving_a_step_replaces_it(tmp_path):
    agents, opts = tiny_agents()
    save_checkpoint(tmp_path, 2, agents=agents, optimizers=opts, metrics={"loss": 1.0})
    save_checkpoint(tmp_path, 2, agents=agents, optimizers=opts, metrics={"loss": 2.0})
    assert load_checkpoint(tmp_path).metrics == {"loss": 2.0}
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-000002"]


def test_failed_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    import materl.runtime.checkpoint as ck

    agents, opts = tiny_agents()
    save_checkpoint(tmp_path, 1, agents=agents, optimizers=opts)
    monkeypatch.setattr(ck, "rng_state", lambda: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, agents=agents, optimizers=opts)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-000001"]
    assert load_checkpoint(tmp_path).step == 1


def test_bad_arguments_and_missing_checkpoints(tmp_path):
    agents, opts = tiny_agents()
    with pytest.raises(ConfigError, match="keep_last must be >= 1, got 0"):
        save_checkpoint(tmp_path, 1, agents=agents, optimizers=opts, keep_last=0)
    with pytest.raises(ConfigError, match="must be JSON-serialisable"):
        save_checkpoint(tmp_path, 1, agents=agents, optimizers=opts, data_state={"x": object()})
    with pytest.raises(ConfigError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "nothing")
    save_checkpoint(tmp_path, 1, agents=agents, optimizers=opts)
    with pytest.raises(ConfigError, match="no agent 'critic'; agents: policy"):
        restore(load_checkpoint(tmp_path), agents={"critic": agents["policy"]})
    with pytest.raises(ConfigError, match=r"no scheduler state for \['policy'\]"):
        restore(load_checkpoint(tmp_path), agents=agents, optimizers=opts,
                schedulers={"policy": torch.optim.lr_scheduler.LambdaLR(opts["policy"], lambda s: 1.0)})


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_optimizer_state_loads_weights_only(tmp_path):
    agents, opts = tiny_agents()
    path = save_checkpoint(tmp_path, 1, agents=agents, optimizers=opts)
    torch.save({"state": {}, "param_groups": [], "evil": Evil()}, path / "optim" / "policy.pt")
    write_manifest(path, ck._write_text)  # whoever planted the file can rewrite the manifest too
    with pytest.raises(pickle.UnpicklingError):
        restore(load_checkpoint(tmp_path), agents=agents, optimizers=opts)


CHILD = textwrap.dedent("""
    import sys, time
    from types import SimpleNamespace
    import torch
    import materl.runtime.checkpoint as ck

    run_dir, marker = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])  # ~32 MiB of weights
    agents = {"policy": SimpleNamespace(model=model, source="tiny-random", trainable=True)}
    opts = {"policy": torch.optim.SGD(model.parameters(), lr=0.1)}
    ck.save_checkpoint(run_dir, 1, agents=agents, optimizers=opts, metrics={"loss": 1.0})
    with torch.no_grad():
        model[0].weight.add_(1.0)

    def stall(*args, **kwargs):  # the weights of step 2 are on disk; the rest is not
        open(marker, "w").close()
        time.sleep(600)

    ck._write_states = stall
    ck.save_checkpoint(run_dir, 2, agents=agents, optimizers=opts, metrics={"loss": 2.0})
""")


def test_sigkill_mid_save_keeps_previous_checkpoint(tmp_path):
    marker = tmp_path / "stalled"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "run"), str(marker)],
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert child.poll() is None, child.stderr.read()
        assert time.monotonic() < deadline, "child never reached the middle of the save"
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    root = tmp_path / "run" / "checkpoints"
    partial = [p for p in root.iterdir() if p.name.startswith(".tmp-step-000002")]
    assert len(partial) == 1 and (partial[0] / "agents" / "policy" / "model.safetensors").exists()
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["latest", "step-000001"]
    assert (root / "latest").read_text().strip() == "step-000001"
    ckpt = load_checkpoint(tmp_path / "run")
    assert (ckpt.step, ckpt.metrics) == (1, {"loss": 1.0})
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    restore(ckpt, agents={"policy": SimpleNamespace(model=model)}, rng=False)
    torch.manual_seed(0)
    assert torch.equal(model[0].weight, torch.nn.Linear(1024, 1024).weight)  # step 1's weights, not +1
    # the next save removes the dead writer's temp folder
    agents, opts = tiny_agents()
    save_checkpoint(tmp_path / "run", 3, agents=agents, optimizers=opts)
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]


def test_manifest_lists_every_file_with_its_sha256(tmp_path):
    import hashlib
    import json

    agents, opts = tiny_agents()
    path = save_checkpoint(tmp_path, 1, agents=agents, optimizers=opts, config={"a": 1})
    manifest = json.loads((path / "manifest.json").read_text())
    files = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != "manifest.json")
    assert sorted(manifest["files"]) == files and "state.json" in files and "rng.pt" in files
    for rel, entry in manifest["files"].items():
        data = (path / rel).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_a_format_1_checkpoint_loads_with_a_warning(tmp_path):
    import json

    agents, opts = tiny_agents()
    path = save_checkpoint(tmp_path, 1, agents=agents, optimizers=opts)
    (path / "manifest.json").unlink()  # what materl wrote before manifests
    state = json.loads((path / "state.json").read_text())
    (path / "state.json").write_text(json.dumps({**state, "format": 1}))
    with pytest.warns(ck.CheckpointWarning, match="has no manifest.json .*cannot be verified"):
        assert load_checkpoint(tmp_path).step == 1


def test_pruning_leaves_no_step_folder_half_deleted(tmp_path):
    agents, opts = tiny_agents()
    root = tmp_path / "checkpoints"
    save_checkpoint(tmp_path, 1, agents=agents, optimizers=opts, keep_last=1)
    # a prune that was killed mid-delete: renamed out of step-* first, so never taken for a checkpoint
    os.rename(save_checkpoint(tmp_path, 2, agents=agents, optimizers=opts, keep_last=2),
              root / ".tmp-pruned-step-000002-999999999-deadbeef")
    assert resolve_checkpoint(tmp_path).name == "step-000001"
    save_checkpoint(tmp_path, 3, agents=agents, optimizers=opts, keep_last=1)  # removes it (its pid is gone)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000003"]


def test_a_full_device_is_reported_as_a_full_disk_naming_the_file():
    """/dev/full fails every write with ENOSPC, for real; torch reports it as 'unexpected pos ...'
    (the OSError only its context), and the checkpoint writer turns it back into that OSError
    with the file's name. (A full tmpfs during a whole run: tests/faults/test_checkpoints.py.)"""
    import errno
    import stat
    from pathlib import Path

    if not os.path.exists("/dev/full") or not stat.S_ISCHR(os.stat("/dev/full").st_mode):
        pytest.skip("no /dev/full character device here")
    with pytest.raises(OSError) as caught:
        ck._torch_save({"x": torch.zeros(100_000)}, Path("/dev/full"))
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == "/dev/full"
