"""Run logging: a JSONL metrics file, a live progress bar, TensorBoard / W&B / MLflow, episode
samples, and a plot at the end.

    with RunLogger("runs/demo", total_steps=50) as log:
        log.log(step, metrics)                         # metrics.jsonl + progress bar + TensorBoard
        log.log_samples(step, [format_episode(r, tokenizer) for r in rollouts])
    # close() wrote runs/demo/plot.png

``run_dir/metrics.jsonl`` holds one object per ``log`` call: ``{"step": 3, "reward": 0.5, ...}``
with numbers only (non-numbers are skipped; NaN/inf are written as ``null``). The file is
appended to, so a resumed run continues it; the plot keeps the last record of each step.
(TRL: ``transformers.Trainer`` callbacks / ``report_to``; verl: ``Tracking`` with backends.
Deliberate difference: the JSONL file is always written and is the source of truth.)
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from materl.errors import ConfigError
from materl.rollout.types import SEGMENT_START

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "plot.png"
SAMPLES_DIR = "samples"
KL_KEYS = ("kl", "policy_loss/kl")


class RunLogger:
    """Logs a run's metrics into ``run_dir``; see the module docstring.

    progress: a tqdm bar over ``total_steps``. tensorboard: None = on if ``tensorboard`` is
    installed. wandb / mlflow: on only when asked; ConfigError if asked and not installed.
    ``config`` (a dict) is passed to W&B / MLflow as the run's parameters.
    """

    def __init__(self, run_dir: str | Path, *, progress: bool = True, total_steps: int | None = None,
                 tensorboard: bool | None = None, wandb: bool = False, mlflow: bool = False,
                 config: Mapping[str, Any] | None = None, run_name: str | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / METRICS_FILE
        self._closed = False
        self._bar = _progress_bar(total_steps) if progress else None
        self._step_bars: dict[int, Any] = {}
        self._tb = _tensorboard_writer(self.run_dir, tensorboard)
        self._wandb = _start_wandb(self.run_dir, config, run_name) if wandb else None
        self._mlflow = _MLflowRun(self.run_dir, config, run_name) if mlflow else None

    # -- logging --
    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float | None]:
        """Append ``{"step": step, **numeric metrics}`` to metrics.jsonl and every enabled sink;
        returns the record written."""
        record = numeric({k: v for k, v in metrics.items() if k != "step"})
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps({"step": int(step), **record}, allow_nan=False) + "\n")
        finite = {k: v for k, v in record.items() if v is not None}
        if self._bar is not None:
            self._update_bar(int(step), finite)
        if self._tb is not None:
            for k, v in finite.items():
                self._tb.add_scalar(k, v, int(step))
        if self._wandb is not None:
            self._wandb.log(finite, step=int(step))
        if self._mlflow is not None:
            self._mlflow.log(finite, int(step))
        return record

    def log_samples(self, step: int, episodes_text: Sequence[str]) -> Path:
        """Append readable episodes to ``run_dir/samples/step-<step>.txt``; returns the file."""
        folder = self.run_dir / SAMPLES_DIR
        folder.mkdir(exist_ok=True)
        path = folder / f"step-{int(step):06d}.txt"
        with open(path, "a") as f:
            for i, text in enumerate(episodes_text, 1):
                f.write(f"===== step {int(step)} · episode {i} =====\n{text.rstrip()}\n\n")
        return path

    @contextmanager
    def episode_bar(self, total: int, desc: str):
        """A second bar over the episodes of one step (or one evaluation); yields the callback
        to call with each finished episode (a no-op without ``progress``)."""
        if self._bar is None:
            yield lambda episode: None
            return
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc=desc, unit="episode", leave=False, dynamic_ncols=True, position=1)
        failed = 0

        def tick(episode: Any) -> None:
            nonlocal failed
            failed += getattr(episode, "error", None) is not None
            if failed:
                bar.set_postfix(failed=failed, refresh=False)
            bar.update(1)

        try:
            yield tick
        finally:
            bar.close()

    def step_bar(self, step: int, total: int):
        """A bar over the episodes of training step ``step`` (several can be open at once when
        rollouts run ahead); returns the per-episode callback. ``end_step_bar`` closes it."""
        if self._bar is None:
            return lambda episode: None
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc=f"step {step}", unit="episode", leave=False, dynamic_ncols=True,
                   position=1 + len(self._step_bars))
        self._step_bars[step] = bar
        return lambda episode: bar.update(1)

    def end_step_bar(self, step: int) -> None:
        bar = self._step_bars.pop(step, None)
        if bar is not None:
            bar.close()

    def _update_bar(self, step: int, m: Mapping[str, float]) -> None:
        bar = self._bar
        shown = progress_fields(m)
        if shown:
            bar.set_postfix(shown, refresh=False)
        if step > bar.n:
            bar.update(step - bar.n)

    # -- closing --
    def close(self, *, plot: bool = True) -> Path | None:
        """Flush and close every sink and write ``run_dir/plot.png``; returns the plot's path
        (None when nothing was logged). ``plot=False`` skips the plot (an interrupted run stops
        without importing matplotlib, seconds on a busy machine; ``plot_metrics`` draws it later)."""
        if self._closed:
            return None
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            self._mlflow.close()
        if not plot:
            return None
        try:
            return plot_metrics(self.metrics_path, self.run_dir / PLOT_FILE)
        except OSError as exc:  # e.g. a full disk: the run's own error (if any) is the one to report
            warnings.warn(f"could not write {self.run_dir / PLOT_FILE}: {exc}", RuntimeWarning, stacklevel=2)
            return None

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# ----------------------------------------------------------------------------- helpers


def numeric(metrics: Mapping[str, Any]) -> dict[str, float | None]:
    """Numbers only, as floats (bools, ints, numpy scalars, 1-element tensors); NaN/inf -> None."""
    out: dict[str, float | None] = {}
    for k, v in metrics.items():
        if isinstance(v, str) or v is None:
            continue
        if hasattr(v, "numel") and v.numel() != 1:  # tensors with several values
            continue
        try:
            f = float(v.item() if hasattr(v, "item") else v)
        except (TypeError, ValueError):
            continue
        out[str(k)] = f if math.isfinite(f) else None
    return out


def progress_fields(m: Mapping[str, float]) -> dict[str, str]:
    """What the progress bar shows: reward, loss, kl, tokens/s (= tokens / time/step)."""
    shown = {}
    for label, keys in (("reward", ("reward",)), ("loss", ("loss",)), ("kl", KL_KEYS)):
        key = next((k for k in keys if k in m), None)
        if key is not None:
            shown[label] = f"{m[key]:.4g}"
    if m.get("tokens") is not None and m.get("time/step"):
        shown["tok/s"] = f"{m['tokens'] / m['time/step']:.1f}"
    return shown


def read_metrics(path: str | Path) -> dict[int, dict[str, float]]:
    """metrics.jsonl -> {step: merged record}; later records for a step update earlier ones
    (eval metrics and a resumed run's repeats), and a torn last line is ignored."""
    by_step: dict[int, dict[str, float]] = {}
    p = Path(path)
    if not p.exists():
        return by_step
    for line in p.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        step = rec.pop("step", None)
        if isinstance(step, int):
            by_step.setdefault(step, {}).update({k: v for k, v in rec.items() if v is not None})
    return by_step


# panels of plot.png: (title, keys drawn in it); "reward/*" expands to each reward term's mean
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward", "reward/*", "eval/reward")),
    ("loss", ("loss",)),
    ("KL", KL_KEYS[:1]),
    ("entropy", ("entropy",)),
    ("tool success", ("tool_success", "eval/tool_success")),
    ("tokens/s", ("tokens_per_s",)),
    ("held-out accuracy", ("eval/accuracy",)),
    ("curriculum level", ("curriculum/level",)),
    ("curriculum pass rate", ("curriculum/pass_rate", "curriculum/window_pass_rate")),
)


def plot_series(by_step: Mapping[int, Mapping[str, float]]) -> list[tuple[str, list[tuple[str, list[int], list[float]]]]]:
    """What plot.png draws: ``[(panel title, [(key, steps, values), ...]), ...]``, panels in
    ``PANELS`` order, each with the keys that were logged (training and evaluation curves)."""
    keys = {k for rec in by_step.values() for k in rec}
    terms = sorted(k for k in keys if k.startswith("reward/") and k.endswith("/mean"))
    kl = next((k for k in KL_KEYS if k in keys), KL_KEYS[0])
    out = []
    for title, wanted in PANELS:
        expanded = [k for w in wanted for k in (terms if w == "reward/*" else [kl] if w in KL_KEYS else [w])]
        lines = []
        for key in expanded:
            pts = [(s, rec[key]) for s, rec in sorted(by_step.items()) if key in rec]
            if pts:
                lines.append((key, [s for s, _ in pts], [v for _, v in pts]))
        if lines:
            out.append((title, lines))
    return out


def draw_metrics(by_step: Mapping[int, Mapping[str, float]]):
    """A matplotlib Figure with one panel per :func:`plot_series` panel (Agg canvas, no global
    backend change), or None with nothing to draw."""
    panels = plot_series(by_step)
    if not panels:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7.0, 2.3 * len(panels)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (title, lines) in zip(axes, panels):
        for key, steps, values in lines:
            evaluation = key.startswith("eval/")
            ax.plot(steps, values, label=key, linestyle="--" if evaluation else "-",
                    marker="o" if evaluation or len(steps) < 30 else None, markersize=3)
        ax.set_ylabel(title, fontsize=8)
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend(fontsize=7, loc="best")
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig


def plot_metrics(metrics_path: str | Path, out_path: str | Path) -> Path | None:
    """Write :func:`draw_metrics` of ``metrics_path`` to ``out_path``; None with nothing to plot."""
    fig = draw_metrics(read_metrics(metrics_path))
    if fig is None:
        return None
    fig.savefig(str(out_path), dpi=100)
    return Path(out_path)


def _progress_bar(total: int | None):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="train", unit="step", dynamic_ncols=True)


def _tensorboard_writer(run_dir: Path, enabled: bool | None):
    if enabled is False:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch's writer needs the tensorboard package
        if enabled:
            raise ConfigError("logging.tensorboard=true but the tensorboard package is not installed; "
                              "pip install tensorboard (or set it to false / null)") from None
        return None
    return SummaryWriter(log_dir=str(run_dir / "tensorboard"))


def _start_wandb(run_dir: Path, config: Mapping[str, Any] | None, name: str | None):
    """A W&B run in ``run_dir/wandb`` (project ``materl``; ``WANDB_MODE=offline`` and the other
    WANDB_* variables apply). ConfigError, before W&B starts, when it has no login here
    (:func:`wandb_login_problem`), and when W&B refuses to start (its message kept)."""
    wandb = require_backend("wandb")
    problem = wandb_login_problem()
    if problem:
        raise ConfigError(problem)
    try:
        run = wandb.init(project=os.environ.get("WANDB_PROJECT", "materl"), name=name, dir=str(run_dir),
                         config=dict(config or {}))
    except wandb.errors.Error as e:  # UsageError, AuthenticationError, CommError: a set-up problem
        raise ConfigError(f"logging.wandb=true but W&B did not start: {type(e).__name__}: {e}; run `wandb login`, "
                          f"set WANDB_API_KEY or WANDB_MODE=offline (or set logging.wandb: false)") from None
    return run if run is not None else wandb


def wandb_login_problem() -> str | None:
    """Why W&B would not start a run here, or None: it runs with ``WANDB_MODE=offline`` (or
    ``disabled``), with an API key in ``WANDB_API_KEY``, or with a login in the netrc file (what
    ``wandb login`` writes: ``$NETRC``, else ``~/.netrc``) for the host of ``WANDB_BASE_URL``."""
    import netrc
    from urllib.parse import urlparse

    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return None
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        if netrc.netrc(path).authenticators(host):
            return None
    except (OSError, netrc.NetrcParseError):
        pass
    return (f"logging.wandb=true but W&B has no login on this machine (no WANDB_API_KEY, no {host} entry in "
            f"{path}); run `wandb login`, set WANDB_API_KEY, or set WANDB_MODE=offline to write the run under "
            f"run_dir/wandb only (or set logging.wandb: false)")


class _MLflowRun:
    """One MLflow run driven through ``MlflowClient`` with its run id (the fluent API keeps the
    active run per thread, and a run's steps may be logged from the step's event-loop thread)."""

    def __init__(self, run_dir: Path, config: Mapping[str, Any] | None, name: str | None):
        mlflow = require_backend("mlflow")
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        exp = self.client.get_experiment_by_name(experiment) if experiment else None
        exp_id = exp.experiment_id if exp else (self.client.create_experiment(experiment) if experiment else "0")
        self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
        self._Metric, self._Param = mlflow.entities.Metric, mlflow.entities.Param
        if config:
            params = [self._Param(k, v) for k, v in _flatten(config).items()]
            for i in range(0, len(params), 100):  # MLflow caps a batch at 100 params
                self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self._Metric(_mlflow_key(k), v, now, step)
                                                    for k, v in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def require_backend(package: str):
    """Import a logging backend, or ConfigError naming the extra that installs it."""
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError:
        raise ConfigError(f"logging.{package}=true but {package} is not installed; pip install 'materl[{package}]' "
                          f"(or set logging.{package}: false)") from None


def _mlflow_key(key: str) -> str:
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in key)


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)[:500]  # mlflow caps parameter values
    return out


# ----------------------------------------------------------------------------- episodes


def format_episode(rollout: Any, tokenizer: Any = None, *, metrics: Mapping[str, Any] | None = None,
                   notes: Mapping[str, str] | None = None) -> str:
    """A readable rendering of a :class:`materl.rollout.types.Rollout`: the question
    (``Rollout.question``), each turn (generated text, tool calls, malformed calls), each tool
    result or error, step rewards, the episode error, ``metrics`` (an episode's ``reward/<term>``
    values as REWARDS, others such as ``judge/<node>/calls`` as METRICS) and ``notes`` (an
    episode's ``judge/<node>`` answers).

    ``tokenizer`` decodes token ids when a step (or the prompt) carries no text.
    """
    if rollout is None:
        return "(no rollout)"
    lines = [f"PROMPT: {_prompt_text(rollout, tokenizer)}"]
    turn = 0
    for step in rollout.steps:
        if step.kind == "generate":
            turn += 1
            lines.append(f"--- turn {turn} · {_step_facts(step)} ---")
            lines.append(_text(step, tokenizer))
            for call in step.tool_calls:
                if call.error:
                    lines.append(f"  ! malformed tool call: {call.error} | raw: {_clip(call.raw)}")
                else:
                    lines.append(f"  > tool call {call.name}({json.dumps(call.arguments, ensure_ascii=False)})")
        elif step.metadata.get(SEGMENT_START):  # an agent rewrote its history: the new segment's prompt
            lines.append(f"--- segment {step.metadata[SEGMENT_START] + 1}: history rewritten, new prompt · "
                         f"{_step_facts(step)} ---")
            lines.append(_text(step, tokenizer))
        else:
            lines.append(f"--- tool · {_step_facts(step)} ---")
            for res in step.tool_results:
                status = "ERROR" if res.is_error else "ok"
                lines.append(f"  < {res.name} [{status}, {res.latency_s:.2f}s]: {_clip(res.content)}")
            if not step.tool_results:
                lines.append(_text(step, tokenizer))
        if step.error:
            lines.append(f"  ! step error: {step.error}")
    rewards = [s.reward for s in rollout.steps if s.reward is not None]
    if rewards:
        lines.append(f"STEP REWARDS: {', '.join(f'{r:.3g}' for r in rewards)} (sum {sum(rewards):.3g})")
    shown = {k: v for k, v in numeric(metrics or {}).items() if v is not None}
    for label, keys in (("REWARDS", [k for k in shown if k.startswith("reward")]),
                        ("METRICS", [k for k in shown if not k.startswith("reward")])):
        if keys:
            lines.append(f"{label}: " + ", ".join(f"{k}={shown[k]:.3g}" for k in sorted(keys)))
    for key, text in sorted((notes or {}).items()):
        lines.append(f"{key} answered: {_clip(text, 2000)}")
    if rollout.error:
        lines.append(f"EPISODE ERROR: {rollout.error}")
    return "\n".join(lines)


def _prompt_text(rollout: Any, tokenizer: Any) -> str:
    """The question (``Rollout.question``: the last user message of the prompt, not a few-shot
    example's), else the decoded prompt."""
    if rollout.question:
        return rollout.question
    if tokenizer is not None and rollout.prompt_ids:
        return tokenizer.decode(rollout.prompt_ids, skip_special_tokens=False)
    return f"({len(rollout.prompt_ids)} prompt tokens)"


def _step_facts(step: Any) -> str:
    facts = [f"{len(step.token_ids)} tokens"]
    if step.finish_reason:
        facts.append(f"finish={step.finish_reason}")
    if step.reward is not None:
        facts.append(f"reward={step.reward:.3g}")
    if step.latency_s:
        facts.append(f"{step.latency_s:.2f}s")
    return ", ".join(facts)


def _text(step: Any, tokenizer: Any) -> str:
    if step.text:
        return step.text
    if tokenizer is not None and step.token_ids:
        return tokenizer.decode(step.token_ids, skip_special_tokens=False)
    return f"({len(step.token_ids)} tokens)"


def _clip(text: str, limit: int = 500) -> str:
    text = str(text).replace("\n", "\\n")
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more chars)"
