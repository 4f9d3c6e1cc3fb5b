"""``materl sweep CONFIG.yaml``: a hyperparameter sweep whose trials are ordinary ``materl train``
runs, searched and pruned by Optuna (``pip install "materl[sweep]"``).

The file is a training config plus a ``sweep`` section::

    sweep:
      sampler: tpe              # grid | random | tpe (Optuna's GridSampler, RandomSampler, TPESampler)
      pruner: median            # none | median | successive_halving | hyperband | threshold (Optuna's)
      pruner_params: {n_startup_trials: 2, n_warmup_steps: 1}
      n_trials: 8               # grid: default and at most the grid's size
      metric: eval/reward       # a metric of the runs' metrics.jsonl, reported by step
      direction: maximize       # default from the metric's name (materl compare's direction)
      parallel: 2               # trials at once, each its own process
      backend: processes        # or ray: each trial's process started by a Ray actor
      dir: runs/sweep
      space:                    # dotted config keys, as --set takes them
        compile.lr: {low: 1.0e-5, high: 1.0e-3, log: true}      # float range (ints: an int range)
        compile.group_size: [2, 4]                              # choices (grid: every key a list)

Each trial is a process running ``materl train`` on its own config (written to
``dir/trial_NNN/config.yaml``, run dir that folder, output in ``train.log``). The sweep reads each
trial's ``metrics.jsonl`` as it grows, reports ``metric`` at every step that logs it
(``trial.report``), and stops a trial the pruner rejects with SIGTERM (materl train's clean stop).
A finished trial's value is the metric's last reported value. The study lives in
``dir/optuna.journal`` (Optuna's JournalStorage), so a sweep stopped with Ctrl-C continues when
the same command runs again: finished trials are kept, never rerun; a trial that was running
**resumes from its run dir's latest checkpoint** (``train.resume``; ``train.save_every`` sets how
much is lost) as an Optuna retry of the same parameters with its reported values inherited, or
starts again from scratch when it had saved no checkpoint. At the end: a table of the trials and
``materl compare`` of their run dirs (table, and ``dir/compare.png``).

No search or pruning logic lives here: sampling, pruning decisions and the study state are
Optuna's; this module runs processes and feeds them the metric stream. (Counterparts: Ray
Tune / Optuna integrations of TRL and verl scripts, where the user writes this loop.)
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from materl.errors import ConfigError
from materl.runtime.compare import common_metrics, compare, direction, load_runs
from materl.runtime.config import resolve_data_source, validate_config
from materl.runtime.config_yaml import apply_override, read_config_data
from materl.runtime.logging import METRICS_FILE
from materl.pids import alive
from materl.runtime.sweep_space import distributions, first_values, import_optuna, trial_data
from materl.runtime.trial_process import LocalTrial, RayTrial, TrialProcess
from materl.validation import describe

STUDY = "materl-sweep"
JOURNAL = "optuna.journal"
LOCK = "sweep.pid"
POLL_S = 0.25
STOP_WAIT_S = 20.0  # under signals.STOP_DEADLINE_S: the trials' clean stops fit in the sweep's


class SweepSpec(BaseModel):
    """The ``sweep`` section (see the module docstring)."""
    model_config = ConfigDict(extra="forbid")
    sampler: Literal["grid", "random", "tpe"] = "tpe"
    pruner: Literal["none", "median", "successive_halving", "hyperband", "threshold"] = "median"
    pruner_params: dict[str, Any] = Field(default_factory=dict)
    n_trials: int | None = Field(default=None, ge=1)
    metric: str = "eval/reward"
    direction: Literal["maximize", "minimize"] | None = None
    parallel: int = Field(default=1, ge=1)
    threads_per_trial: int | None = Field(default=None, ge=1)  # OMP_NUM_THREADS; default: cores / parallel
    backend: Literal["processes", "ray"] = "processes"
    ray_address: str | None = None
    dir: str = "runs/sweep"
    seed: int = 0
    space: dict[str, Any]


# ----------------------------------------------------------------------------- loading


@dataclass
class Sweep:
    spec: SweepSpec
    base: dict  # the training config without ``sweep``, data.source resolved
    dists: dict
    dir: Path
    config_dir: Path
    fingerprint: str = ""
    trials: dict[int, Any] = field(default_factory=dict)  # trial number -> (Trial, TrialProcess, reported steps)


def load_sweep(path: str | Path, overrides: Sequence[str] = (), sweep_overrides: Sequence[str] = ()) -> Sweep:
    """Read and check a sweep file: the ``sweep`` section, the space's keys (each applied with one of its
    values to the base config, which must validate) and the metric; ConfigError naming the key."""
    path = Path(path)
    data = read_config_data(path)
    for item in sweep_overrides:
        apply_override(data, item)
    raw = data.pop("sweep", None)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a sweep file needs a 'sweep' section with a 'space' (see materl sweep --help); "
                          f"got {raw!r}")
    try:
        spec = SweepSpec.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(describe(e, SweepSpec, where=f"sweep ({path})").replace("\n  ", "\n  sweep.")) from None
    for item in overrides:
        apply_override(data, item)
    resolve_data_source(data, path.parent)
    dists = distributions(spec.space, grid=spec.sampler == "grid")
    sweep_dir = Path(spec.dir).resolve()
    for key, value in first_values(dists).items():
        try:
            validate_config(trial_data(data, {key: value}, sweep_dir / "check", resume=False), where=str(path))
        except ConfigError as e:
            raise ConfigError(f"sweep.space.{key}={value!r} does not make a valid config: {e}") from None
    cfg = validate_config(trial_data(data, first_values(dists), sweep_dir / "check", resume=False), where=str(path))
    if spec.metric.startswith("eval/") and cfg.train.eval_every == 0 and "train.eval_every" not in dists:
        raise ConfigError(f"sweep.metric={spec.metric!r} is an evaluation metric but train.eval_every=0 (never "
                          f"evaluated); set train.eval_every >= 1 so trials report it by step")
    if spec.direction is None and direction(spec.metric) is None:
        raise ConfigError(f"sweep.direction: metric {spec.metric!r} has no direction of its own; set "
                          f"direction: maximize or minimize")
    sweep = Sweep(spec, data, dists, sweep_dir, path.resolve().parent)
    sweep.fingerprint = hashlib.sha256(json.dumps(
        [spec.model_dump(exclude={"parallel", "backend", "ray_address", "threads_per_trial"}), data],
        sort_keys=True, default=str).encode()).hexdigest()[:16]
    return sweep


def _grid_sampler(optuna):
    class AskTellGrid(optuna.samplers.GridSampler):
        """Optuna's GridSampler, whose ``after_trial`` ends an ``optimize`` loop with
        ``study.stop()`` once the grid is covered (an error outside ``optimize``); this
        ask-and-tell loop stops itself after the grid's size (``_total``)."""

        def after_trial(self, study, trial, state, values) -> None:
            pass

    return AskTellGrid


def _study(sweep: Sweep):
    optuna = import_optuna()
    spec = sweep.spec
    if spec.sampler == "grid":
        sampler = _grid_sampler(optuna)({k: list(v.choices) for k, v in sweep.dists.items()}, seed=spec.seed)
    elif spec.sampler == "random":
        sampler = optuna.samplers.RandomSampler(seed=spec.seed)
    else:
        sampler = optuna.samplers.TPESampler(seed=spec.seed)
    pruners = {"none": optuna.pruners.NopPruner, "median": optuna.pruners.MedianPruner,
               "successive_halving": optuna.pruners.SuccessiveHalvingPruner,
               "hyperband": optuna.pruners.HyperbandPruner, "threshold": optuna.pruners.ThresholdPruner}
    try:
        pruner = pruners[spec.pruner](**spec.pruner_params)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"sweep.pruner_params {spec.pruner_params!r} for pruner {spec.pruner!r}: {e}") from None
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(sweep.dir / JOURNAL)))
    how = spec.direction or ("maximize" if direction(spec.metric) == "max" else "minimize")
    study = optuna.create_study(study_name=STUDY, storage=storage, sampler=sampler, pruner=pruner, direction=how,
                                load_if_exists=True)
    held = study.user_attrs.get("fingerprint")
    if held is None:
        study.set_user_attr("fingerprint", sweep.fingerprint)
    elif held != sweep.fingerprint:
        raise ConfigError(f"sweep dir {str(sweep.dir)!r} holds a different sweep (its config or sweep section "
                          f"changed since it started); use another sweep.dir or delete that folder")
    return study


# ----------------------------------------------------------------------------- running


@dataclass
class _Running:
    trial: Any  # optuna.trial.Trial
    proc: TrialProcess
    run_dir: Path
    reported: set[int]
    offset: int = 0
    buffer: bytes = b""
    last: float | None = None
    pruning: bool = False  # the pruner rejected it (its process is stopped)
    pruned_at: int | None = None


def run_sweep(path: str | Path, overrides: Sequence[str] = (), *, sweep_overrides: Sequence[str] = (),
              say=print) -> dict[str, Any]:
    """What ``materl sweep`` runs (module docstring); returns the trials, the best one, the trial
    table, the ``materl compare`` table and the plot's path. ``overrides`` apply to the training
    config (every trial), ``sweep_overrides`` (``sweep.parallel=2``) to the sweep section."""
    sweep = load_sweep(path, overrides, sweep_overrides)
    sweep.dir.mkdir(parents=True, exist_ok=True)
    with _lock(sweep.dir):
        study = _study(sweep)
        total = _total(sweep)
        for n in _retry_interrupted(study):
            say(f"trial {n} was interrupted: it runs again with the same parameters")
        start, close = _starter(sweep)
        try:
            _loop(sweep, study, total, start, say)
        except KeyboardInterrupt:
            _stop_all(sweep, study, say)
            raise
        finally:
            close()
    return report(sweep, study)


def _total(sweep: Sweep) -> int:
    spec = sweep.spec
    if spec.sampler != "grid":
        if spec.n_trials is None:
            raise ConfigError(f"sweep.n_trials is required with sampler {spec.sampler!r} (how many trials to run)")
        return spec.n_trials
    size = 1
    for dist in sweep.dists.values():
        size *= len(dist.choices)
    if spec.n_trials is not None and spec.n_trials > size:
        raise ConfigError(f"sweep.n_trials={spec.n_trials} is more than the grid's {size} points; "
                          f"leave it out to run every point")
    return spec.n_trials or size


def _states():
    return import_optuna().trial.TrialState


def _retried(trials) -> set[int]:
    return {n for t in trials for n in t.system_attrs.get("retry_history", [])}


def _done(study) -> int:
    S = _states()
    trials = study.get_trials(deepcopy=False)
    retried = _retried(trials)
    return sum(t.state in (S.COMPLETE, S.PRUNED) or (t.state == S.FAIL and t.number not in retried) for t in trials)


def _retry_interrupted(study) -> list[int]:
    """Trials a stopped sweep left running: failed, then queued again with their parameters and
    reported values (Optuna's RetryHeartbeatStaleTrialCallback)."""
    import warnings

    optuna = import_optuna()
    with warnings.catch_warnings():  # "experimental": the retry is Optuna's own, pinned in constraints.txt
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        retry = optuna.storages.RetryHeartbeatStaleTrialCallback(inherit_intermediate_values=True)
    stale = study.get_trials(deepcopy=True, states=(_states().RUNNING,))
    for t in stale:
        study.tell(t.number, state=_states().FAIL)
        retry(study, t)
    return [t.number for t in stale]


def _starter(sweep: Sweep):
    """``(start(cmd, env, run_dir) -> TrialProcess, close())`` for the sweep's backend."""
    spec = sweep.spec
    threads = spec.threads_per_trial or max(1, (os.cpu_count() or 1) // spec.parallel)
    if spec.backend == "processes":
        return (lambda cmd, env, run_dir: LocalTrial(cmd, cwd=os.getcwd(), env=env, log=run_dir / "train.log",
                                                     metrics=run_dir / METRICS_FILE)), (lambda: None)
    from materl.distributed.ray_workers import connect
    from materl.runtime import signals

    was_running = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    ray = connect(spec.ray_address, num_cpus=None if spec.ray_address else spec.parallel * threads)
    signals.rearm()  # ray.init installs a SIGTERM handler of its own

    def start(cmd, env, run_dir):
        return RayTrial(ray, cmd, cwd=os.getcwd(), env=env, log=run_dir / "train.log",
                        metrics=run_dir / METRICS_FILE, num_cpus=threads)

    return start, (lambda: None if was_running else ray.shutdown())


def _loop(sweep: Sweep, study, total: int, start, say) -> None:
    while True:
        for number in list(sweep.trials):
            _poll(sweep, study, number, say)
        while len(sweep.trials) < sweep.spec.parallel and _done(study) + len(sweep.trials) < total:
            _launch(sweep, study, start, say)
        if not sweep.trials and _done(study) >= total:
            return
        time.sleep(POLL_S)


def _launch(sweep: Sweep, study, start, say) -> None:
    import shutil

    from materl.runtime.checkpoint import candidates

    trial = study.ask(sweep.dists)
    frozen = next(t for t in study.get_trials(deepcopy=False) if t.number == trial.number)
    origin = frozen.system_attrs.get("failed_trial")
    run_dir = sweep.dir / f"trial_{origin if origin is not None else trial.number:03d}"
    try:
        resume = origin is not None and bool(candidates(run_dir)[0])
    except ConfigError:
        resume = False
    if origin is not None and not resume and run_dir.exists():
        shutil.rmtree(run_dir)  # no checkpoint to resume from: start the trial again
    run_dir.mkdir(parents=True, exist_ok=True)
    trial.set_user_attr("run_dir", str(run_dir))
    data = trial_data(sweep.base, trial.params, run_dir, resume=resume)
    try:
        validate_config(data, where=f"trial {trial.number}")
    except ConfigError as e:
        (run_dir / "train.log").write_text(f"invalid trial config: {e}\n")
        study.tell(trial, state=_states().FAIL)
        say(f"trial {trial.number}: failed before starting: {e}")
        return
    (run_dir / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    threads = sweep.spec.threads_per_trial or max(1, (os.cpu_count() or 1) // sweep.spec.parallel)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join(p for p in (str(sweep.config_dir), os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "materl.cli", "train", str(run_dir / "config.yaml")]
    sweep.trials[trial.number] = _Running(trial, start(cmd, env, run_dir), run_dir, set(frozen.intermediate_values))
    how = " (resumes from its latest checkpoint)" if resume else ""
    say(f"trial {trial.number}: started {_params(trial.params)} in {run_dir}{how}")


def _params(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def _read(sweep: Sweep, r: _Running) -> None:
    """Report the new records' metric values and ask the pruner after each one, as Optuna's own
    ``optimize`` loop would (so a trial's state does not depend on when it was read)."""
    chunk = r.proc.read(r.offset)
    r.offset += len(chunk)
    *lines, r.buffer = (r.buffer + chunk).split(b"\n")
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        step, value = rec.get("step"), rec.get(sweep.spec.metric)
        if r.pruning or not isinstance(step, int) or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        r.last = float(value)
        if step not in r.reported:
            r.trial.report(float(value), step)
            r.reported.add(step)
            r.pruning = r.trial.should_prune()
            r.pruned_at = step


def _poll(sweep: Sweep, study, number: int, say) -> None:
    import signal

    r = sweep.trials[number]
    rc = r.proc.poll()
    stopping = r.pruning
    _read(sweep, r)
    if r.pruning and not stopping:
        r.proc.stop(signal.SIGTERM)
        say(f"trial {number}: pruned at step {r.pruned_at} ({sweep.spec.metric}={r.last:.4g})")
    if rc is None:
        return
    del sweep.trials[number]
    r.proc.close()
    S = _states()
    if r.pruning:
        study.tell(r.trial, state=S.PRUNED)
    elif rc == 0 and r.last is not None:
        study.tell(r.trial, r.last)
        say(f"trial {number}: finished, {sweep.spec.metric}={r.last:.4g}")
    else:
        study.tell(r.trial, state=S.FAIL)
        why = f"exit status {rc}" if rc != 0 else f"it logged no {sweep.spec.metric!r}"
        say(f"trial {number}: failed ({why}); last lines of {r.run_dir / 'train.log'}:\n{_tail(r.run_dir / 'train.log')}")


def _tail(path: Path, lines: int = 8) -> str:
    try:
        return "\n".join("    " + x for x in path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "    (no log)"


def _stop_all(sweep: Sweep, study, say) -> None:
    """Ctrl-C: the running trials stop cleanly (SIGINT, each keeps its last checkpoint) and stay
    RUNNING in the study, so the next run of the sweep resumes them."""
    import signal

    for number in list(sweep.trials):
        _poll(sweep, study, number, say)  # record what finished meanwhile
    for r in sweep.trials.values():
        r.proc.stop(signal.SIGINT)
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline and any(r.proc.poll() is None for r in sweep.trials.values()):
        time.sleep(0.1)
    for number, r in list(sweep.trials.items()):
        r.proc.kill()
        if r.pruning:
            study.tell(r.trial, state=_states().PRUNED)
        r.proc.close()
    say(f"sweep interrupted: {len(sweep.trials)} running trial(s) stopped; run the same command to continue")
    sweep.trials.clear()


class _lock:
    """One ``materl sweep`` per sweep dir (``sweep.pid``); a dead owner's lock is taken over."""

    def __init__(self, folder: Path):
        self.path = folder / LOCK

    def __enter__(self):
        try:
            pid = int(self.path.read_text().strip())
        except (OSError, ValueError):
            pid = None
        if pid is not None and alive(pid, count_self=False):  # our own pid: a lock left by an earlier attempt
            raise ConfigError(f"another materl sweep (pid {pid}) is running in {str(self.path.parent)!r}; "
                              f"wait for it or stop it first")
        self.path.write_text(f"{os.getpid()}\n")
        return self

    def __exit__(self, *exc):
        self.path.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- the report


def report(sweep: Sweep, study) -> dict[str, Any]:
    """The trials (retried interrupted ones left out), the best, a trial table and
    ``materl compare`` of the trials' run dirs (``dir/compare.png``)."""
    trials = study.get_trials(deepcopy=False)
    retried = _retried(trials)
    shown = [t for t in trials if not (t.state == _states().FAIL and t.number in retried)]
    rows = [{"number": t.number, "state": t.state.name.lower(), "value": t.value, "params": dict(t.params),
             "run_dir": t.user_attrs.get("run_dir"), "steps": len(t.intermediate_values)} for t in shown]
    lines = [f"{'trial':>5}  {'state':<9}  {sweep.spec.metric:>12}  params"]
    for row in rows:
        value = f"{row['value']:.4g}" if row["value"] is not None else "-"
        lines.append(f"{row['number']:>5}  {row['state']:<9}  {value:>12}  {_params(row['params'])}")
    best = None
    if any(t.state == _states().COMPLETE for t in trials):
        b = study.best_trial
        best = {"number": b.number, "value": b.value, "params": dict(b.params), "run_dir": b.user_attrs.get("run_dir")}
    dirs = [row["run_dir"] for row in rows if row["run_dir"] and _has_metrics(Path(row["run_dir"]))]
    table, plot = None, None
    if dirs:
        labels = [os.path.relpath(d) if not os.path.relpath(d).startswith("..") else d for d in dirs]
        common = common_metrics(load_runs(labels))
        wanted = [m for m in dict.fromkeys((sweep.spec.metric, "reward", "loss")) if m in common]
        if wanted:
            table, plot = compare(labels, metrics=wanted, out=sweep.dir / "compare.png")
    return {"trials": rows, "best": best, "table": "\n".join(lines), "compare": table,
            "plot": str(plot) if plot else None, "dir": str(sweep.dir)}


def _has_metrics(run_dir: Path) -> bool:
    p = run_dir / METRICS_FILE
    return p.is_file() and p.stat().st_size > 0
