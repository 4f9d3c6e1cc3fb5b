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
    manifest.json                     size and SHA-256 of every file above (runtime/manifest.py)

Atomicity: everything is written into ``checkpoints/.tmp-step-000030-<pid>-<id>/``, each file
fsync'd, the manifest last, then the folder is renamed into place (one ``rename``, atomic on
POSIX) and the ``checkpoints/latest`` pointer file is replaced atomically (temp file +
``os.replace``). A crash at any point leaves the previous checkpoint and ``latest`` untouched; a
half-written temp folder is never taken for a checkpoint (only ``step-*`` folders with a
manifest are) and is removed by the next save. A first SIGINT/SIGTERM during a save waits for it
(``signals.deferred``). A failed write (a full disk) raises CheckpointError naming the file and
the space needed, after removing the temp folder. Checkpoints beyond ``keep_last`` are deleted
only after the new one is complete, each renamed out of ``step-*`` first; the one that
``checkpoints/best`` names (``mark_best``, early stopping's best step) is never pruned. Loading
checks every file against the manifest, read strictly (``manifest.read_manifest``,
``checkpoint_meta``): a malformed manifest or state.json, a format-2 checkpoint without its
manifest, a path that leads out of the checkpoint folder or a ``latest`` that leads out of the
run is damage like a changed file. From a run dir, a damaged latest falls back to the newest
intact one with a warning (``fallback=False``: an error). (verl: ``global_step_N`` folders +
``latest_checkpointed_iteration.txt``, written in place, no checksums; TRL:
``transformers.Trainer`` ``checkpoint-N`` with ``save_total_limit``. Deliberate difference:
rename-into-place so no reader ever sees a partial checkpoint, and checksums so none loads a
damaged one.)
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from materl.errors import CheckpointError, ConfigError
from materl.runtime import signals
from materl.runtime.checkpoint_meta import CHECKPOINTS, LATEST, READABLE, STATE, read_latest, read_state
from materl.runtime.checkpoint_meta import PREFIX as _PREFIX
from materl.runtime.checkpoint_meta import complete as _complete
from materl.runtime.config import config_to_dict
from materl.runtime.manifest import MANIFEST, confined, has_manifest, save_error, verify, write_manifest, writing
from materl.pids import alive
from materl.runtime.rng import rng_state, set_rng_state

FORMAT = 2  # 2: with manifest.json; 1 (no manifest) still loads, unverified
BEST = "best"  # pointer file naming the best checkpoint (early stopping); never pruned
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
    with signals.deferred():  # a first SIGINT/SIGTERM waits for the save to finish (or roll back)
        try:
            _write_all(tmp, agents=agents, optimizers=optimizers, schedulers=schedulers or {},
                       data_state=data_state, config=config, metrics=metrics, tensors=tensors or {}, step=step)
            final = _move_into_place(tmp, root / name)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, OSError):
                raise save_error(exc, root, step, latest=_latest_name(root),
                                 estimate=lambda: _state_bytes(agents, optimizers)) from exc
            raise
        previous = _latest_name(root)
        try:
            _write_text(root / LATEST, name + "\n")
        except OSError as exc:
            raise CheckpointError(f"checkpoint {name} was saved, but {root / LATEST} could not be updated "
                                  f"({exc.strerror or exc}); {previous or 'no checkpoint'} is still the latest "
                                  f"({name} is complete: resume from it by its path)") from exc
        _fsync_dir(root)
        _prune(root, keep_last=keep_last, keep=name)
    return final


def _write_all(tmp: Path, *, agents, optimizers, schedulers, data_state, config, metrics, tensors,
               step: int) -> None:
    """Every file of the checkpoint into ``tmp``, the manifest last."""
    tmp.mkdir()
    _write_agents(tmp, agents)
    _write_states(tmp / "optim", optimizers)
    _write_states(tmp / "sched", schedulers)
    _torch_save(rng_state(), tmp / "rng.pt")
    _write_tensors(tmp / "extra", tensors)
    if config is not None:
        _write_text(tmp / "config.yaml", _config_yaml(config))
    state = {"format": FORMAT, "step": step, "data_state": dict(data_state or {}),
             "metrics": _floats(metrics or {}), "agents": sorted(agents),
             "optimizers": sorted(optimizers), "schedulers": sorted(schedulers)}
    _write_text(tmp / STATE, _json(state, "data_state"))
    write_manifest(tmp, _write_text)  # last: covers every file above
    _fsync_dir(tmp)


def _move_into_place(tmp: Path, final: Path) -> Path:
    """Rename the finished temp folder to ``final`` (one atomic rename)."""
    if final.exists():  # re-saving a step (e.g. after a resume): move the old one out of step-* first
        old = final.with_name(f"{_TMP}old-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    return final


def _state_bytes(agents: Mapping[str, Any], optimizers: Mapping[str, Any]) -> int:
    """Bytes of the weights and optimizer tensors a save writes (an estimate of its size)."""
    n = sum(t.numel() * t.element_size() for a in agents.values() for t in a.model.state_dict().values())
    for opt in optimizers.values():
        n += sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
                 if isinstance(t, torch.Tensor))
    return n


def _latest_name(root: Path) -> str | None:
    """The checkpoint folder ``root/latest`` names, if it names one of this run."""
    return read_latest(root)[0]



def _write_agents(folder: Path, agents: Mapping[str, Any]) -> None:
    from safetensors.torch import save_model

    for name, agent in agents.items():
        d = folder / "agents" / name
        d.mkdir(parents=True)
        with writing(d / "model.safetensors"):
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
        path = folder / f"{name}.safetensors"
        with writing(path):
            save_file({k: v.detach().contiguous() for k, v in table.items()}, str(path))
            _fsync_file(path)


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


def mark_best(run_dir: str | os.PathLike, step: int) -> Path:
    """Point ``checkpoints/best`` at step ``step``'s checkpoint (atomically); it is then kept
    whatever ``keep_last`` says. Returns that checkpoint's folder."""
    root = Path(run_dir) / CHECKPOINTS
    name = step_dir_name(step)
    if not _complete(root / name):
        raise CheckpointError(f"cannot mark step {step} as best: {root / name} is not a complete checkpoint")
    _write_text(root / BEST, name + "\n")
    _fsync_dir(root)
    return root / name


def best_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint ``checkpoints/best`` names, or None."""
    root = Path(run_dir) / CHECKPOINTS
    try:
        name = (root / BEST).read_text().strip()
    except OSError:
        return None
    return root / name if _complete(root / name) else None


def _prune(root: Path, *, keep_last: int, keep: str) -> None:
    """Delete all but the newest ``keep_last`` checkpoints and the best one. Each leaves the
    ``step-*`` names by one rename before its files go, so a kill mid-delete leaves a temp folder
    (removed by the next save), never a ``step-*`` folder that looks complete and is not."""
    steps = sorted(p for p in root.glob(f"{_PREFIX}*") if p.is_dir())
    best = best_checkpoint(root.parent)
    for old in steps[:-keep_last]:
        if old.name != keep and (best is None or old.name != best.name):
            doomed = root / f"{_TMP}pruned-{old.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.rename(old, doomed)
            shutil.rmtree(doomed, ignore_errors=True)


def _remove_stale_temps(root: Path) -> None:
    """Remove temp folders left by crashed saves (their writer process is gone)."""
    for tmp in root.glob(f"{_TMP}*"):
        pid = tmp.name.rsplit("-", 2)[-2] if tmp.name.count("-") >= 2 else ""
        # our own pid: a temp folder of ours from an earlier, failed save
        if not pid.isdigit() or not alive(int(pid), count_self=False):
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)


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


def candidates(path_or_run_dir: str | os.PathLike) -> tuple[list[Path], bool]:
    """The checkpoints ``path_or_run_dir`` names, newest first, and whether it named one folder
    itself. A run dir or a ``checkpoints`` folder names the one ``latest`` points at, then the
    complete ``step-*`` folders before it (all of them, without a usable ``latest``); a
    ``step-*`` entry that is a symlink is not one of the run's checkpoints."""
    return _candidates(path_or_run_dir)[:2]


def _candidates(path_or_run_dir: str | os.PathLike) -> tuple[list[Path], bool, list[str]]:
    """``candidates``, and what is wrong with the run's ``latest`` (``read_latest``), if anything."""
    p = Path(path_or_run_dir)
    if _complete(p):
        return [p], True, []
    for root in (p / CHECKPOINTS, p):
        complete = sorted((d for d in root.glob(f"{_PREFIX}*") if not d.is_symlink() and _complete(d)), reverse=True)
        latest, problem = read_latest(root)
        problems = [problem] if problem else []
        if latest is not None and _complete(root / latest):
            return [root / latest] + [d for d in complete if d.name < latest], False, problems
        if complete or problems:
            return complete, False, problems
    raise ConfigError(f"no checkpoint at {str(p)!r}: expected a step-NNNNNN folder with {MANIFEST} (or {STATE}), or "
                      f"a run dir whose {CHECKPOINTS}/{LATEST} names one")


def resolve_checkpoint(path_or_run_dir: str | os.PathLike) -> Path:
    """A checkpoint folder from itself, a run dir or a ``checkpoints`` folder (via ``latest``;
    without a usable ``latest``, the highest complete ``step-*``). Does not verify it."""
    folders, _, problems = _candidates(path_or_run_dir)
    if not folders:
        raise CheckpointError(f"no checkpoint at {str(path_or_run_dir)!r}: {'; '.join(problems)}")
    return folders[0]


def load_checkpoint(path_or_run_dir: str | os.PathLike, *, fallback: bool = True, verify_files: bool = True
                    ) -> Checkpoint:
    """Read a checkpoint's metadata (see :func:`candidates` for what the path may be), after
    checking every file against its manifest. A damaged one (a file missing, truncated, zeroed or
    changed) raises CheckpointError naming the file; given a run dir, ``fallback`` instead warns
    (CheckpointWarning) and takes the newest intact checkpoint before it. A checkpoint from before
    manifests (format 1) loads with a warning that it cannot be verified."""
    folders, explicit, damaged = _candidates(path_or_run_dir)
    if damaged and not fallback:
        raise CheckpointError(f"{damaged[0]} (train.resume_fallback: true resumes from the newest intact checkpoint)")
    for folder in folders:
        try:
            ckpt = _load_one(folder, verify_files=verify_files)
        except CheckpointError as exc:
            if explicit or not fallback:
                hint = "" if explicit else " (train.resume_fallback: true resumes from the newest intact one)"
                raise CheckpointError(f"{exc}{hint}") from None
            damaged.append(str(exc))
            continue
        if damaged:
            warnings.warn(f"{'; '.join(damaged)}. Falling back to {str(folder)!r} (step {ckpt.step}), the newest "
                          f"intact checkpoint", CheckpointWarning, stacklevel=2)
        return ckpt
    raise CheckpointError(f"no intact checkpoint at {str(path_or_run_dir)!r}: " + "; ".join(damaged))


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (damaged) or could not be verified (format 1, no manifest)."""


def _load_one(path: Path, *, verify_files: bool) -> Checkpoint:
    """One checkpoint folder's metadata, after its files are checked against the manifest; any
    damage (a file, the manifest or state.json malformed, a path leading out) is a CheckpointError."""
    import yaml

    manifest = has_manifest(path)
    if manifest:
        verify(path, hashes=verify_files)  # the schema and the paths always; sizes and hashes unless told not to
    state = read_state(path)
    if not manifest:
        if state["format"] >= 2:
            raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} is missing, but {STATE} says format "
                                  f"{state['format']}, which always has one: its files cannot be trusted")
        warnings.warn(f"checkpoint {str(path)!r} has no {MANIFEST} (format 1, saved by an older materl): its files "
                      f"cannot be verified", CheckpointWarning, stacklevel=3)
    try:
        agents = {name: json.loads(confined(path, f"agents/{name}/agent.json", what="agent").read_text())
                  for name in state["agents"]}
        config = yaml.safe_load((path / "config.yaml").read_text()) if (path / "config.yaml").exists() else None
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise CheckpointError(f"checkpoint {str(path)!r}: unreadable ({exc})") from None
    if not all(isinstance(a, dict) for a in agents.values()):
        raise CheckpointError(f"checkpoint {str(path)!r}: an agent.json is not a JSON object")
    return Checkpoint(path=path, step=state["step"], data_state=state["data_state"], metrics=state["metrics"],
                      config=config, agents=agents, optimizers=state["optimizers"], schedulers=state["schedulers"])



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


# ----------------------------------------------------------------------------- files


def _torch_save(obj: Any, path: Path) -> None:
    with writing(path), open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _torch_load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def _write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: temp file in the same folder, fsync, os.replace."""
    tmp = path.with_name(f"{_TMP}{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with writing(path), open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
