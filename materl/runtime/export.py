"""Export a checkpoint's agent as a plain Hugging Face model folder.

    export("runs/demo", "exported/policy")               # latest checkpoint, LoRA merged
    AutoModelForCausalLM.from_pretrained("exported/policy")  # same logits as in training

The agent is rebuilt from its ``agent.json`` (``materl.agent.Agent``: the same base model, LoRA
and head), its ``model.safetensors`` loaded (strict), LoRA merged into the base weights with
peft's ``merge_and_unload`` (``W + (alpha / r) * B @ A``) unless ``merge_lora=False``, and the
result written with ``save_pretrained`` plus the tokenizer (and its chat template). A value-head
agent also writes ``value_head.safetensors`` next to the backbone (ignored by
``AutoModelForCausalLM``, read back by ``materl.Agent(out_dir, head="value")``). Every file written
gets the mode a plain ``open`` gives (0644 under the usual umask 022), not safetensors' 0600.

With ``merge_lora=False`` a LoRA agent is written as a peft adapter folder
(``adapter_config.json`` + ``adapter_model.safetensors``) whose ``base_model_name_or_path`` is
the base model's folder; transformers loads it with peft installed.
(TRL: ``trainer.save_model`` + ``model.merge_and_unload()``; verl: ``model_merger`` for FSDP
shards.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from materl.agent import Agent
from materl.errors import ConfigError
from materl.runtime.checkpoint import Checkpoint, load_checkpoint

EXPORT_INFO = "materl_export.json"


def export(checkpoint: Checkpoint | str | os.PathLike, out_dir: str | os.PathLike, *, agent: str = "policy",
           merge_lora: bool = True) -> Path:
    """Write agent ``agent`` of ``checkpoint`` (a Checkpoint, checkpoint folder or run dir) to
    ``out_dir`` as an HF folder; returns ``out_dir``. ``out_dir`` must be empty or absent."""
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else load_checkpoint(checkpoint)
    ckpt.model_file(agent)  # ConfigError listing the agents when absent
    info = ckpt.agents[agent]
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"export: output folder {str(out)!r} exists and is not empty; pick a new folder")
    built = agent_from_checkpoint(ckpt, agent)
    merged = bool(merge_lora and info.get("lora"))
    out.mkdir(parents=True, exist_ok=True)
    if merge_lora or not info.get("lora"):
        built.save_pretrained(out)  # merges LoRA (merge_and_unload), writes the value head, tokenizer
    else:
        built.model.save_pretrained(str(out))  # peft adapter folder (+ value head for a critic)
        built.tokenizer.save_pretrained(str(out))
    (out / EXPORT_INFO).write_text(json.dumps({
        "checkpoint": str(ckpt.path), "step": ckpt.step, "agent": agent, "lora_merged": merged,
        **{k: info.get(k) for k in ("model_name_or_path", "head", "lora")}}, indent=2))
    readable_by_umask(out)
    return out


def readable_by_umask(folder: Path) -> None:
    """Give every file under ``folder`` the mode a plain ``open`` would (``0o666`` less the umask,
    0644 with the usual 022): safetensors writes its files through a private temporary file,
    mode 0600, which a server reading the exported model as another user cannot open."""
    mode = 0o666 & ~_umask()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


def _umask() -> int:
    """The process's umask, read without changing it (Linux's /proc), else set and restored."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def agent_from_checkpoint(checkpoint: Checkpoint | str | os.PathLike, agent: str = "policy", **options: Any):
    """Agent ``agent`` of ``checkpoint`` (a Checkpoint, checkpoint folder or run dir): rebuilt
    from its agent.json (``rebuild_agent``, ``options`` passed on) and its model.safetensors
    loaded, strictly, now. ConfigError listing the checkpoint's agents when it has no ``agent``."""
    from safetensors.torch import load_model

    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else load_checkpoint(checkpoint)
    weights = ckpt.model_file(agent)
    built = rebuild_agent(ckpt.agents[agent], **options)
    load_model(built.model, str(weights), strict=True, device=str(built.device))
    return built


def rebuild_agent(info: dict[str, Any], **options: Any):
    """A fresh ``materl.agent.Agent`` with the model, head, LoRA and dtype recorded in
    ``agent.json``; ``options`` (``trainable``, ``device``, ``engine``, ...) as ``Agent``'s, by
    default the recorded ``trainable`` on the default engine (exporting needs no server)."""
    import torch


    name = info.get("model_name_or_path")
    if not name:
        raise ConfigError(f"agent.json does not say which model to rebuild (an Agent built from an nn.Module "
                          f"cannot be exported from a checkpoint): {info!r}")
    dtype = getattr(torch, str(info.get("dtype") or "float32"))
    options = {"trainable": bool(info.get("trainable")), **options}
    return Agent(name, head=info.get("head"), lora=info.get("lora"), dtype=dtype, **options)
