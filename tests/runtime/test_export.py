"""export(): a checkpoint's agent -> a plain HF folder that AutoModelForCausalLM loads with the
trained logits (full fine-tune, LoRA merged, LoRA as an adapter, value head)."""

import json
import os
import stat

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from materl.agent import Agent
from materl.errors import ConfigError
from materl.runtime.checkpoint import save_checkpoint
from materl.runtime.export import export

IDS = torch.tensor([[257, 72, 105, 33, 258, 10]])


def perturb(model, *, only_trainable=True, seed=1):
    """Move weights away from the base model, so a export that forgot them would be caught."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad or not only_trainable:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def logits(model):
    with torch.no_grad():
        return model(IDS, attention_mask=torch.ones_like(IDS)).logits


def save(tmp_path, agents):
    opts = {n: torch.optim.SGD(a.parameters(), lr=0.1) for n, a in agents.items() if a.trainable}
    return save_checkpoint(tmp_path / "run", 7, agents=agents, optimizers=opts)


def test_full_model_export_has_identical_logits(tmp_path):
    policy = Agent("tiny-random", trainable=True)
    perturb(policy.model)
    ckpt = save(tmp_path, {"policy": policy, "ref_policy": Agent("tiny-random")})
    out = export(ckpt, tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(logits(loaded), logits(policy.model))
    assert not torch.equal(logits(loaded), logits(Agent("tiny-random").model))  # the trained weights
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.encode("Hi!") == [72, 105, 33] and "<tool_call>" in tok.chat_template
    info = json.loads((out / "materl_export.json").read_text())
    assert (info["step"], info["agent"], info["lora_merged"]) == (7, "policy", False)
    # another agent of the same checkpoint, by run dir
    ref = AutoModelForCausalLM.from_pretrained(export(tmp_path / "run", tmp_path / "ref", agent="ref_policy"))
    assert torch.equal(logits(ref), logits(Agent("tiny-random").model))


def test_lora_merged_export(tmp_path):
    policy = Agent("tiny-random", trainable=True, lora=dict(r=4, alpha=8))
    perturb(policy.model)  # LoRA B starts at zero; move it so the adapters change the logits
    trained = logits(policy.model)
    assert not torch.allclose(trained, logits(Agent("tiny-random").model), atol=1e-3)
    export(save(tmp_path, {"policy": policy}), tmp_path / "out")
    assert not (tmp_path / "out" / "adapter_config.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert not any("lora" in k for k in loaded.state_dict())
    # merging W + (alpha/r) B A reorders float sums: equal up to rounding
    torch.testing.assert_close(logits(loaded), trained, rtol=1e-5, atol=1e-5)


def test_lora_unmerged_export_is_an_adapter_folder(tmp_path):
    policy = Agent("tiny-random", trainable=True, lora=dict(r=4, alpha=8))
    perturb(policy.model)
    export(save(tmp_path, {"policy": policy}), tmp_path / "out", merge_lora=False)
    assert (tmp_path / "out" / "adapter_config.json").exists()
    assert not (tmp_path / "out" / "model.safetensors").exists()  # adapters only
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # transformers + peft: base + adapters
    assert torch.equal(logits(loaded), logits(policy.model))


def test_value_head_export(tmp_path):
    critic = Agent("tiny-random", trainable=True, head="value")
    perturb(critic.model)
    export(save(tmp_path, {"value_model": critic}), tmp_path / "out", agent="value_model")
    again = Agent(str(tmp_path / "out"), head="value")
    mask = torch.ones_like(IDS)
    assert torch.equal(again.values(IDS, mask), critic.values(IDS, mask))


def test_export_errors(tmp_path):
    ckpt = save(tmp_path, {"policy": Agent("tiny-random", trainable=True)})
    with pytest.raises(ConfigError, match="no agent 'critic'; agents: policy"):
        export(ckpt, tmp_path / "out", agent="critic")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ConfigError, match="exists and is not empty"):
        export(ckpt, tmp_path / "full")


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_exported_files_have_the_mode_open_gives_under_the_umask(tmp_path, umask):
    # safetensors writes model.safetensors (and the value head) through a 0600 temporary file;
    # an export is read by servers and other users: 0o666 & ~umask, i.e. 0644 under 022, 0600 under 077
    critic = Agent("tiny-random", trainable=True, head="value")
    ckpt = save(tmp_path, {"value_model": critic})
    old = os.umask(umask)
    try:
        out = export(ckpt, tmp_path / "out", agent="value_model")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir() if p.is_file()}
    assert {"model.safetensors", "value_head.safetensors", "config.json", "materl_export.json"} <= set(modes)
    assert set(modes.values()) == {0o666 & ~umask}, {k: oct(v) for k, v in modes.items()}
