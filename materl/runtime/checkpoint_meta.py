"""What a checkpoint's metadata must be, read strictly: ``state.json`` against its schema
(``read_state``), and a run's ``checkpoints/latest`` pointer confined to that run
(``read_latest``). Anything else is damage, reported as a CheckpointError that the loader's
fallback handles like a damaged file (``materl.runtime.checkpoint``); the manifest's own schema
and the confinement of its paths are in ``materl.runtime.manifest``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from materl.errors import CheckpointError, ConfigError
from materl.runtime.manifest import has_manifest

READABLE = (1, 2)  # state.json formats this materl loads (2: with manifest.json)
LATEST = "latest"
STATE = "state.json"
CHECKPOINTS = "checkpoints"
PREFIX = "step-"
_STEP_NAME = re.compile(r"step-\d{6,}")
_ONE_PART = re.compile(r"[^/\\\0]+")  # an agent, optimizer or scheduler name: one path part


def read_state(path: Path) -> dict[str, Any]:
    """``path/state.json`` checked against the schema ``checkpoint._write_all`` writes (``format`` and
    ``step`` ints, ``agents``/``optimizers``/``schedulers`` lists of names that are single path
    parts, ``data_state``/``metrics`` objects); CheckpointError naming what is wrong, ConfigError
    for a format this materl cannot read."""
    where = f"checkpoint {str(path)!r}: file {STATE}"
    try:
        state = json.loads((path / STATE).read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{where} is unreadable ({exc})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{where} is malformed: a JSON {type(state).__name__}, not an object")
    if type(state.get("format")) is int and state["format"] not in READABLE:
        raise ConfigError(f"checkpoint {str(path)!r} has format {state['format']!r}; this materl reads "
                          f"{', '.join(map(str, READABLE))}")
    state = {"optimizers": [], "schedulers": [], "data_state": {}, "metrics": {}, **state}
    expected = {"format": (int, "an int"), "step": (int, "an int >= 0"), "agents": (list, "a list of names"),
                "optimizers": (list, "a list of names"), "schedulers": (list, "a list of names"),
                "data_state": (dict, "an object"), "metrics": (dict, "an object")}
    for key, (kind, what) in expected.items():
        value = state.get(key)
        bad = type(value) is not kind or (key == "step" and value < 0) or (
            kind is list and not all(isinstance(n, str) and _ONE_PART.fullmatch(n) and n not in (".", "..")
                                     for n in value))
        if bad:
            raise CheckpointError(f"{where} is malformed: {key!r} is {json.dumps(value)[:200]}, expected {what}"
                                  + (" (each a file name without '/')" if kind is list else ""))
    return state


def read_latest(root: Path) -> tuple[str | None, str | None]:
    """(name, problem): the ``step-*`` folder beside it that ``root/latest`` names, or why it
    names none (problem None when there is no ``latest``). ``latest`` is confined to its run: a
    name that is not ``step-NNNNNN``, or a folder that is a symlink leading elsewhere, is no
    checkpoint of this run."""
    try:
        name = (root / LATEST).read_text().strip()
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as exc:
        return None, f"{str(root / LATEST)!r} is unreadable ({exc})"
    if not _STEP_NAME.fullmatch(name):
        return None, (f"{str(root / LATEST)!r} names {name[:200]!r}, not a step-NNNNNN folder beside it (a run's "
                      f"latest names one of its own checkpoints)")
    folder = root / name
    if not folder.is_dir():
        return None, f"{str(root / LATEST)!r} names {name}, which is missing"
    if folder.is_symlink() or folder.resolve().parent != root.resolve():
        return None, f"{str(root / LATEST)!r} names {name}, which leads outside this run (to {str(folder.resolve())!r})"
    return name, None


def complete(folder: Path) -> bool:
    """A finished save: its manifest (format 2) or, from before manifests, its state.json."""
    return folder.is_dir() and (has_manifest(folder) or (folder / STATE).is_file())


def is_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a finished checkpoint folder, or a run dir or ``checkpoints`` folder
    holding one (what ``checkpoint.load_checkpoint`` accepts; the config checks names with it)."""
    p = Path(path).expanduser()
    return complete(p) or any(complete(d) for root in (p / CHECKPOINTS, p) if root.is_dir()
                              for d in root.glob(f"{PREFIX}*") if not d.is_symlink())
