"""The search space of ``materl sweep`` (``materl.runtime.sweep``): the ``sweep.space`` section as
Optuna distributions, and a trial's config (the base config with its parameters applied).

A key is a dotted config path (as ``--set`` takes it); its value a list of choices (Optuna's
CategoricalDistribution) or a range ``{low, high, log, step}`` (IntDistribution when low and
high are integers, else FloatDistribution). Every error names the key: ``sweep.space.KEY``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from materl.errors import ConfigError
from materl.runtime.config_yaml import apply_override

RESERVED = ("train.run_dir", "train.resume")  # the sweep sets these per trial


def import_optuna():
    try:
        import optuna
    except ImportError as e:
        raise ConfigError(f"materl sweep needs Optuna: pip install \"materl[sweep]\" ({e})") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def distributions(space: Mapping[str, Any], *, grid: bool) -> dict[str, Any]:
    """Optuna distributions of the ``space`` section; ConfigError naming the key at fault."""
    optuna = import_optuna()
    d = optuna.distributions
    if not space:
        raise ConfigError("sweep.space is empty; give at least one key, e.g. compile.lr: {low: 1e-5, high: 1e-3}")
    out: dict[str, Any] = {}
    for key, spec in space.items():
        where = f"sweep.space.{key}"
        if key in RESERVED:
            raise ConfigError(f"{where}: the sweep sets {key} for every trial; it cannot be searched")
        if isinstance(spec, list):
            bad = [v for v in spec if v is not None and not isinstance(v, (bool, int, float, str))]
            if not spec or bad:
                raise ConfigError(f"{where}: choices must be a non-empty list of numbers, strings, booleans or "
                                  f"null; got {spec!r}")
            out[key] = d.CategoricalDistribution(spec)
        elif isinstance(spec, dict):
            if grid:
                raise ConfigError(f"{where}: the grid sampler needs a list of values, got the range {spec!r}")
            out[key] = _range(where, spec, d)
        else:
            raise ConfigError(f"{where}: expected a list of choices or a range {{low, high, log, step}}; "
                              f"got {spec!r} ({type(spec).__name__})")
    return out


def _range(where: str, spec: Mapping[str, Any], d) -> Any:
    unknown = sorted(set(spec) - {"low", "high", "log", "step"})
    if unknown or "low" not in spec or "high" not in spec:
        raise ConfigError(f"{where}: a range takes low, high and optionally log, step; got keys "
                          f"{sorted(spec)}")
    low, high, log, step = spec["low"], spec["high"], bool(spec.get("log", False)), spec.get("step")
    numbers = [v for v in (low, high, step) if v is not None]
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in numbers):
        raise ConfigError(f"{where}: low, high and step must be numbers; got {dict(spec)!r}")
    try:
        if all(isinstance(v, int) for v in numbers):
            return d.IntDistribution(low, high, log=log, step=step or 1)
        return d.FloatDistribution(float(low), float(high), log=log, step=step)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def first_values(dists: Mapping[str, Any]) -> dict[str, Any]:
    """One value of every key (each range's low, each list's first choice), to validate the keys."""
    return {k: (v.choices[0] if hasattr(v, "choices") else v.low) for k, v in dists.items()}


def trial_data(base: Mapping[str, Any], params: Mapping[str, Any], run_dir: Path, *, resume: bool) -> dict:
    """The base config with a trial's parameters applied and its run dir set (a plain dict)."""
    data = json.loads(json.dumps(base))
    for key, value in params.items():
        apply_override(data, f"{key}={json.dumps(value)}")
    data.setdefault("train", {})
    data["train"]["run_dir"], data["train"]["resume"] = str(run_dir), bool(resume)
    data.setdefault("logging", {})["progress"] = False
    return data
