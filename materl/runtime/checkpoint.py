"""Atomic, resumable checkpoints.

    path = save_checkpoint("runs/demo", 30, agents=step.agents, optimizers=step.optimizers,
                           schedulers=schedulers, data_state={"sampler": ...}, config=cfg)
    ckpt = load_checkpoint("runs/demo")          # follows runs/demo/checkpoints/latest
    restore(ckpt, agents=step.agents, optimizers=step.optimizers, schedulers=schedulers)

Layout of ``run_dir/checkpoints/step-000030/``::

    agents/<name>/model.safetensors   full state_dict of agent.model (LoRA adapters, value head)
    agents/<name>/agent.json          how to rebuild the agent: model, head, lora, trainable, engine
    optim/<name>.pt                   optimizer state_dict        (torch.save; loaded weights_only)
    sched/<name>.pt                   LR-scheduler state_dict     (torch.save; loaded weights_only)
    rng.pt                            torch (+ CUDA), python ``random`` and numpy RNG states
    state.json                        step, data_state, metrics, format version
    config.yaml                       the run's config (when given)

Atomicity: everything is written into ``checkpoints/.tmp-step-000030-<pid>-<id>/``, each file
fsync'd, then the folder is renamed into place (one ``rename``, atomic on POSIX) and the
``checkpoints/latest`` pointer file is replaced atomically (temp file + ``os.replace``). A crash
at any point leaves the previous checkpoint and ``latest`` untouched; a half-written temp folder
is never taken for a checkpoint (only ``step-*`` folders with a ``state.json`` are) and is
removed by the next save. Checkpoints beyond ``keep_last`` are deleted only after the new one is
complete. (verl: ``global_step_N`` folders + ``latest_checkpointed_iteration.txt``, written in
place; TRL: ``transformers.Trainer`` ``checkpoint-N`` with ``save_total_limit``. Deliberate
difference: rename-into-place so no reader ever sees a partial checkpoint.)
"""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from materl.errors import ConfigError
from materl.runtime.config import config_to_dict

FORMAT = 1
CHECKPOINTS = "checkpoints"
LATEST = "latest"
STATE = "state.json"
_PREFIX = "step-"
_TMP = ".tmp-"


def step_dir_name(step: int) -> str:
    """``step-000030``: zero-padded so names sort in step order."""
    return f"{_PREFIX}{step:06d}"


# ----------------------------------------------------------------------------- save


def save_checkpoint(run_dir: str | os.PathLike, step: int, *, agents: Mapping[str, Any],
                    optimizers: Mapping[str, torch.optim.Optimizer], schedulers: Mapping[str, Any] | None = None,
                    data_state: Mapping[str, Any] | None = None, config: Any = None,
                    metrics: Mapping[str, Any] | None = None, keep_last: int = 3,
                    tensors: Mapping[str, Mapping[str, torch.Tensor]] | None = None) -> Path:
    """Write ``run_dir/checkpoints/step-<step>/`` atomically, point ``latest`` at it, prune old
    ones to ``keep_last``; returns the checkpoint folder.

    agents: name -> Agent (``.model``, and ``name``/``head``/``lora``/``trainable`` for
    ``agent.json``). ``data_state``: JSON-able (e.g. a sampler's ``state_dict()``). ``config``: a
    TrainConfig or a plain dict. ``tensors``: name -> tensors saved as ``extra/<name>.safetensors``
    (an asynchronous run's recent policy versions), read back with ``load_tensors``. Saving the
    same step again replaces that checkpoint.
    """
    if not isinstance(step, int) or step < 0:
        raise ConfigError(f"checkpoint step must be an int >= 0, got {step!r}")
    if keep_last < 1:
        raise ConfigError(f"keep_last must be >= 1, got {keep_last!r}")
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(root)
    name = step_dir_name(step)
    tmp = root / f"{_TMP}{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_agents(tmp, agents)
        _write_states(tmp / "optim", optimizers)
        _write_states(tmp / "sched", schedulers or {})
        _torch_save(rng_state(), tmp / "rng.pt")
        _write_tensors(tmp / "extra", tensors or {})
        if config is not None:
            _write_text(tmp / "config.yaml", _config_yaml(config))
        state = {"format": FORMAT, "step": step, "data_state": dict(data_state or {}),
                 "metrics": _floats(metrics or {}), "agents": sorted(agents),
                 "optimizers": sorted(optimizers), "schedulers": sorted(schedulers or {})}
        _write_text(tmp / STATE, _json(state, "data_state"))  # written last: marks the folder complete
        _fsync_dir(tmp)
        final = root / name
        if final.exists():  # re-saving a step (e.g. after a resume): move the old one aside first
            old = root / f"{_TMP}old-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_text(root / LATEST, name + "\n")
    _fsync_dir(root)
    _prune(root, keep_last=keep_last, keep=name)
    return final


def _write_agents(folder: Path, agents: Mapping[str, Any]) -> None:
    from safetensors.torch import save_model

    for name, agent in agents.items():
        d = folder / "agents" / name
        d.mkdir(parents=True)
        save_model(agent.model, str(d / "model.safetensors"))  # dedups tied weights
        _fsync_file(d / "model.safetensors")
        _write_text(d / "agent.json", json.dumps(agent_info(agent), indent=2))


def agent_info(agent: Any) -> dict[str, Any]:
    """What rebuilding ``agent`` needs: ``materl.agent.Agent(model_name_or_path, trainable=...,
    engine=..., head=..., lora=...)``; ``name`` is the agent's label."""
    source = getattr(agent, "source", None) or getattr(agent, "name", None)
    dtype = getattr(agent, "dtype", None)
    return {"model_name_or_path": str(source) if source is not None else None,
            "name": str(getattr(agent, "name", source)), "head": getattr(agent, "head", None),
            "lora": _jsonable(getattr(agent, "lora", None)), "trainable": bool(getattr(agent, "trainable", False)),
            "engine": getattr(agent, "engine_name", "transformers"),
            "dtype": str(dtype).removeprefix("torch.") if dtype is not None else "float32"}


def _write_tensors(folder: Path, tensors: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    from safetensors.torch import save_file

    if not tensors:
        return
    folder.mkdir()
    for name, table in tensors.items():
        save_file({k: v.detach().contiguous() for k, v in table.items()}, str(folder / f"{name}.safetensors"))
        _fsync_file(folder / f"{name}.safetensors")


def load_tensors(checkpoint: Any, name: str) -> dict[str, torch.Tensor]:
    """The tensors saved under ``name`` (``save_checkpoint(tensors=...)``); {} if there are none."""
    from safetensors.torch import load_file

    path = Path(getattr(checkpoint, "path", checkpoint)) / "extra" / f"{name}.safetensors"
    return load_file(str(path)) if path.exists() else {}


def _write_states(folder: Path, objs: Mapping[str, Any]) -> None:
    if not objs:
        return
    folder.mkdir()
    for name, obj in objs.items():
        _torch_save(obj.state_dict(), folder / f"{name}.pt")


def _config_yaml(config: Any) -> str:
    import yaml

    return yaml.safe_dump(config_to_dict(config) if not isinstance(config, dict) else _jsonable(config),
                          sort_keys=False)


def _prune(root: Path, *, keep_last: int, keep: str) -> None:
    steps = sorted(p for p in root.glob(f"{_PREFIX}*") if p.is_dir())
    for old in steps[:-keep_last]:
        if old.name != keep:
            shutil.rmtree(old, ignore_errors=True)


def _remove_stale_temps(root: Path) -> None:
    """Remove temp folders left by crashed saves (their writer process is gone)."""
    for tmp in root.glob(f"{_TMP}*"):
        pid = tmp.name.rsplit("-", 2)[-2] if tmp.name.count("-") >= 2 else ""
        if not pid.isdigit() or not _alive(int(pid)):
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # a temp folder of ours from an earlier, failed save
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ----------------------------------------------------------------------------- load


@dataclass
class Checkpoint:
    """A complete checkpoint on disk; tensors load lazily (``model_state``, ``optimizer_state``)."""
    path: Path
    step: int
    data_state: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    config: dict[str, Any] | None = None
    agents: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> agent.json
    optimizers: list[str] = field(default_factory=list)
    schedulers: list[str] = field(default_factory=list)

    def model_file(self, agent: str) -> Path:
        if agent not in self.agents:
            raise ConfigError(f"checkpoint {str(self.path)!r} has no agent {agent!r}; agents: "
                              f"{', '.join(self.agents) or '(none)'}")
        return self.path / "agents" / agent / "model.safetensors"

    def optimizer_state(self, name: str) -> dict:
        return _torch_load(self.path / "optim" / f"{name}.pt")

    def scheduler_state(self, name: str) -> dict:
        return _torch_load(self.path / "sched" / f"{name}.pt")

    def rng_state(self) -> dict:
        return _torch_load(self.path / "rng.pt")


def resolve_checkpoint(path_or_run_dir: str | os.PathLike) -> Path:
    """A checkpoint folder from itself, a run dir or a ``checkpoints`` folder (via ``latest``;
    without a readable ``latest``, the highest complete ``step-*``)."""
    p = Path(path_or_run_dir)
    if (p / STATE).is_file():
        return p
    for root in (p / CHECKPOINTS, p):
        if (root / LATEST).is_file():
            target = root / (root / LATEST).read_text().strip()
            if (target / STATE).is_file():
                return target
        complete = sorted(d for d in root.glob(f"{_PREFIX}*") if (d / STATE).is_file())
        if complete:
            return complete[-1]
    raise ConfigError(f"no checkpoint at {str(p)!r}: expected a step-NNNNNN folder with {STATE}, or a run dir "
                      f"whose {CHECKPOINTS}/{LATEST} names one")


def load_checkpoint(path_or_run_dir: str | os.PathLike) -> Checkpoint:
    """Read a checkpoint's metadata (see :func:`resolve_checkpoint` for what the path may be)."""
    import yaml

    path = resolve_checkpoint(path_or_run_dir)
    state = json.loads((path / STATE).read_text())
    if state.get("format") != FORMAT:
        raise ConfigError(f"checkpoint {str(path)!r} has format {state.get('format')!r}; this materl reads {FORMAT}")
    agents = {name: json.loads((path / "agents" / name / "agent.json").read_text()) for name in state["agents"]}
    config = yaml.safe_load((path / "config.yaml").read_text()) if (path / "config.yaml").exists() else None
    return Checkpoint(path=path, step=int(state["step"]), data_state=state.get("data_state") or {},
                      metrics=state.get("metrics") or {}, config=config, agents=agents,
                      optimizers=list(state.get("optimizers", [])), schedulers=list(state.get("schedulers", [])))


def restore(checkpoint: Checkpoint | str | os.PathLike, *, agents: Mapping[str, Any],
            optimizers: Mapping[str, torch.optim.Optimizer] | None = None,
            schedulers: Mapping[str, Any] | None = None, rng: bool = True) -> Checkpoint:
    """Load weights into each ``agents[name].model``, optimizer and scheduler states, and (with
    ``rng``) the torch/python/numpy RNG states. Every name given must be in the checkpoint."""
    from safetensors.torch import load_model

    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else load_checkpoint(checkpoint)
    for kind, given, saved in (("optimizer", optimizers or {}, ckpt.optimizers),
                               ("scheduler", schedulers or {}, ckpt.schedulers)):
        missing = sorted(set(given) - set(saved))
        if missing:
            raise ConfigError(f"checkpoint {str(ckpt.path)!r} has no {kind} state for {missing}; saved: "
                              f"{', '.join(saved) or '(none)'}")
    for name, agent in agents.items():
        load_model(agent.model, str(ckpt.model_file(name)), strict=True, device=str(_device_of(agent.model)))
    for name, opt in (optimizers or {}).items():
        opt.load_state_dict(ckpt.optimizer_state(name))
    for name, sched in (schedulers or {}).items():
        sched.load_state_dict(ckpt.scheduler_state(name))
    if rng:
        set_rng_state(ckpt.rng_state())
    return ckpt


def _device_of(model: torch.nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


# ----------------------------------------------------------------------------- RNG


def rng_state() -> dict[str, Any]:
    """torch (CPU and every CUDA device), python ``random`` and numpy global RNG states, as
    tensors/tuples that ``torch.load(weights_only=True)`` accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of :func:`rng_state`: the next draws of every generator repeat the saved run's."""
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))


# ----------------------------------------------------------------------------- files


def _torch_save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _torch_load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def _write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: temp file in the same folder, fsync, os.replace."""
    tmp = path.with_name(f"{_TMP}{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync_file(path)
    except OSError:  # some filesystems do not fsync directories
        pass


def _json(obj: Any, what: str) -> str:
    try:
        return json.dumps(obj, indent=2, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"checkpoint {what} must be JSON-serialisable (ints, floats, str, lists, dicts): {e}") from None


def _floats(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if f == f and abs(f) != float("inf"):
            out[str(k)] = f
    return out


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=lambda o: list(o) if isinstance(o, (tuple, set)) else str(o)))
