"""``materl compare RUN_DIR RUN_DIR ...``: several runs side by side, read from their
``metrics.jsonl``.

    table = compare_table(runs, metrics)            # final and best of each metric, per run
    figure = draw_comparison(runs, metrics)         # one panel per metric, one line per run

Without ``--metrics`` the table shows a short set (``DEFAULT_TABLE``: reward and its terms, masked
episodes, loss, kl, tool calls and success, first/last-turn advantages, evaluation); ``--metrics
all`` shows every metric the runs share; ``--columns`` picks the columns per run (``COLUMNS``).

A metric's *final* value is its value at the last step that logged it; its *best* is the max or
the min over the steps, by the metric's direction (``direction``, from its name):

- up (max): ``reward`` and every ``reward/...`` (each term's mean), names ending in
  ``accuracy``, ``tool_success``, ``tokens_per_s``;
- down (min): ``loss`` and ``loss/...``, names ending in ``loss`` (``dpo_loss``), ``time/...``,
  ``failed``, ``failed_episodes``, ``failures/...``;
- none: spreads (``.../std``) and everything else (counts such as ``episodes`` and ``tokens``,
  settings such as ``lr``, diagnostics such as ``kl``, ``entropy``, ``grad_norm``,
  ``policy_loss/clipfrac``): the table shows ``-`` for their best.

An ``eval/`` prefix keeps the direction of the name after it (``eval/accuracy`` is up). (TRL and
verl leave this to TensorBoard / W&B; the table is what a shaping experiment's report needs.)
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from pathlib import Path

from materl.errors import ConfigError, RunNotFoundError
from materl.runtime.logging import METRICS_FILE, read_metrics

PLOT_FILE = "compare.png"
# what the plot draws without --metrics (those every run has)
DEFAULT_PLOT = ("reward", "reward/*/mean", "loss", "eval/accuracy", "eval/reward", "tool_success")
# the table's rows without --metrics (those every run has); --metrics all: every common metric
DEFAULT_TABLE = ("reward", "reward/*/mean", "masked_episodes", "loss", "kl", "tool_calls", "tool_success",
                 "advantages/first_turn/mean", "advantages/last_turn/mean", "eval/accuracy", "eval/reward",
                 "eval/tool_success")
ALL = "all"
# the table's columns per run (--columns): final value, best value @step, first value, mean over steps
COLUMNS = ("final", "best", "first", "mean")
DEFAULT_COLUMNS = ("final", "best")
# one style per run, so identical curves stay visible: the later runs draw narrower, other dashes
# and other markers over the earlier ones
LINE_STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "x", "+", "*")
UP_LAST = ("accuracy", "tool_success", "tokens_per_s")
DOWN_FIRST = ("time", "failures")
DOWN_LAST = ("failed", "failed_episodes")

Run = Mapping[int, Mapping[str, float]]  # step -> that step's merged record


def direction(metric: str) -> str | None:
    """``"max"``, ``"min"`` or None (no best) for a metric name; see the module docstring."""
    parts = metric.split("/")
    if parts[0] == "eval" and len(parts) > 1:
        parts = parts[1:]
    if parts[-1] == "std":
        return None
    if parts[0] == "reward" or parts[-1] in UP_LAST or parts[-1].endswith("accuracy"):
        return "max"
    if parts[0] in DOWN_FIRST or parts[0] == "loss" or parts[-1] in DOWN_LAST or parts[-1].endswith("loss"):
        return "min"
    return None


def load_runs(run_dirs: Sequence[str | Path]) -> dict[str, Run]:
    """``{run dir as given: {step: record}}``; RunNotFoundError for a missing folder, one without
    ``metrics.jsonl`` or one whose file holds no record."""
    runs: dict[str, Run] = {}
    for given in run_dirs:
        path = Path(given)
        if not path.is_dir():
            what = "is a file, not a run folder" if path.exists() else "does not exist"
            raise RunNotFoundError(f"run dir {str(given)!r} {what} (resolved: {path.resolve()}); give the folders "
                                   f"ml.train(run_dir=...) or train.run_dir wrote")
        if not (path / METRICS_FILE).is_file():
            found = ", ".join(sorted(p.name for p in path.iterdir())[:8]) or "nothing"
            raise RunNotFoundError(f"run dir {str(given)!r} has no {METRICS_FILE} (it holds: {found}); a run writes "
                                   f"it at its first step")
        records = read_metrics(path / METRICS_FILE)
        if not records:
            raise RunNotFoundError(f"{path / METRICS_FILE} holds no record (every line empty or unreadable)")
        runs[str(given)] = records
    return runs


def common_metrics(runs: Mapping[str, Run]) -> list[str]:
    """The metrics every run logged (at some step), sorted."""
    keys = [{k for rec in run.values() for k in rec} for run in runs.values()]
    return sorted(set.intersection(*keys)) if keys else []


def select(common: Sequence[str], wanted: Sequence[str] | None, *, default: Sequence[str] = ()) -> list[str]:
    """The common metrics that the names or shell patterns ``wanted`` match (in their order), or
    those ``default`` matches when ``wanted`` is None. A wanted name that matches no common
    metric is a ConfigError listing them."""
    patterns = list(wanted) if wanted is not None else list(default)
    out: list[str] = []
    for pattern in patterns:
        hits = [m for m in common if fnmatch.fnmatchcase(m, pattern)]
        if not hits and wanted is not None:
            raise ConfigError(f"--metrics {pattern!r} matches no metric that every run has; common metrics: "
                              f"{', '.join(common) or 'none'}")
        out += [m for m in hits if m not in out]
    return out


def series(run: Run, metric: str) -> tuple[list[int], list[float]]:
    """The steps that logged ``metric`` and its values there, in step order."""
    pts = [(s, rec[metric]) for s, rec in sorted(run.items()) if metric in rec]
    return [s for s, _ in pts], [v for _, v in pts]


def final_and_best(run: Run, metric: str) -> tuple[float, tuple[float, int] | None]:
    """``(final value, (best value, its step) or None)``; the first step wins a tie."""
    steps, values = series(run, metric)
    how = direction(metric)
    if how is None:
        return values[-1], None
    pick = max if how == "max" else min
    best = pick(values)
    return values[-1], (best, steps[values.index(best)])


def short_labels(names: Sequence[str]) -> dict[str, str]:
    """Each run dir's shortest trailing path that tells it from the others (``runs/a`` -> ``a``;
    ``x/seed0`` and ``y/seed0`` keep their parents)."""
    parts = {n: Path(n).parts or (n,) for n in names}
    for k in range(1, max(len(p) for p in parts.values()) + 1):
        labels = {n: "/".join(p[-k:]) for n, p in parts.items()}
        if len(set(labels.values())) == len(labels):
            return labels
    return {n: n for n in names}


def compare_table(runs: Mapping[str, Run], metrics: Sequence[str], *,
                  columns: Sequence[str] = DEFAULT_COLUMNS) -> str:
    """A text table: one row per metric, the ``columns`` per run (``COLUMNS``: ``final``, ``best``
    as ``value @step`` or ``-`` for a metric without a direction, ``first``, ``mean`` over the
    steps); runs are headed by their ``short_labels``."""
    bad = [c for c in columns if c not in COLUMNS]
    if bad or not columns:
        raise ConfigError(f"compare: --columns {','.join(columns)!r}: unknown column(s) "
                          f"{', '.join(bad) or '(none given)'}; valid: {', '.join(COLUMNS)}")
    labels = short_labels(list(runs))
    header = ["metric"] + [f"{labels[name]} {col}" for name in runs for col in columns]
    rows = [header]
    for metric in metrics:
        row = [metric]
        for run in runs.values():
            row += [_cell(run, metric, col) for col in columns]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
                     .rstrip() for r in rows)


def _cell(run: Run, metric: str, column: str) -> str:
    _, values = series(run, metric)
    if column == "best":
        best = final_and_best(run, metric)[1]
        return f"{best[0]:.4g} @{best[1]}" if best is not None else "-"
    value = {"final": values[-1], "first": values[0], "mean": sum(values) / len(values)}[column]
    return f"{value:.4g}"


def draw_comparison(runs: Mapping[str, Run], metrics: Sequence[str]):
    """A matplotlib Figure (Agg canvas) with one panel per metric and one line per run. Each run
    has its own line style, marker and width (``LINE_STYLES``, ``MARKERS``; the first run widest),
    so runs with identical values still show every line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7.0, 2.3 * len(metrics)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(metrics), 1, sharex=True, squeeze=False)[:, 0]
    n = len(runs)
    for ax, metric in zip(axes, metrics):
        for i, (label, run) in enumerate(runs.items()):
            steps, values = series(run, metric)
            ax.plot(steps, values, label=label, linestyle=LINE_STYLES[i % len(LINE_STYLES)],
                    marker=MARKERS[i % len(MARKERS)], markevery=max(1, len(steps) // 15),
                    markersize=3 + 2 * (n - 1 - i), linewidth=1.0 + 1.5 * (n - 1 - i) / max(1, n - 1),
                    markerfacecolor="none" if i else None, zorder=2 + i)
        ax.set_ylabel(metric, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="best")  # the same runs, in the same colours, in every panel
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig


def compare(run_dirs: Sequence[str | Path], *, metrics: Sequence[str] | None = None,
            out: str | Path = PLOT_FILE, columns: Sequence[str] = DEFAULT_COLUMNS) -> tuple[str, Path | None]:
    """What ``materl compare`` runs: the table of ``metrics`` (default: ``DEFAULT_TABLE``'s common
    ones, or every common one when none of those is; ``["all"]``: every common metric) with
    ``columns`` per run, and the plot of ``metrics`` (default: ``DEFAULT_PLOT``'s common ones)
    written to ``out``; returns ``(table, plot path)`` (no path when there is nothing to draw)."""
    if len(run_dirs) < 1:
        raise ConfigError("compare: give at least one run dir")
    twice = sorted({str(d) for d in run_dirs if [str(x) for x in run_dirs].count(str(d)) > 1})
    if twice:
        raise ConfigError(f"compare: run dir(s) given more than once: {', '.join(twice)}")
    runs = load_runs(run_dirs)
    common = common_metrics(runs)
    if not common:
        raise ConfigError(f"compare: the runs have no metric in common ({', '.join(runs)})")
    if metrics is not None and list(metrics) == [ALL]:
        rows = drawn = common
    else:
        rows = select(common, metrics, default=DEFAULT_TABLE) or common
        drawn = select(common, metrics, default=DEFAULT_PLOT)
    table = compare_table(runs, rows, columns=columns)
    if not drawn:
        return table, None
    fig = draw_comparison(runs, drawn)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(out), dpi=100)
    return table, Path(out)
