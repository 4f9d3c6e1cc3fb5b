"""A curriculum over a dataset's declared difficulty knobs, moved by the running pass rate.

    task = ReasoningGymTask("basic_arithmetic")            # any Knobbed dataset
    ml.train(step, task, steps=200, curriculum=ml.Curriculum(raise_above=0.8, lower_below=0.2, window=64))

Each batch is drawn at the current level from a fixed pool of ``pool_size`` prompts per level
(``rows_at(level, pool_size, seed=seed + level)``, in a seeded permutation per epoch, like
``Sampler``). After a step is learned its episodes are scored (an episode passes when the
dataset's ``score_key`` metric, e.g. ``reward/reasoning_gym``, is >= ``pass_score``) and kept
in a window of the last ``window`` episodes at the current level: once the window is full, a
pass rate >= ``raise_above`` raises the level by one, below ``lower_below`` lowers it (each move
empties the window). ``band=(lo, hi)`` also skips prompts whose last observed group pass rate
lies outside [lo, hi] (online difficulty filtering, Bae et al. 2025, arXiv:2504.03380, which
keeps prompts of intermediate pass rate; a prompt never seen is always eligible; a whole epoch
of ineligible prompts is drawn from anyway and counted in ``curriculum/band_fallback``).

Determinism under the asynchronous pipeline: batch j applies the outcomes of steps up to
``j - 1 - max_staleness`` exactly (those are learned before batch j may be drawn), whatever the
timing. ``state_dict`` before batch j plus the outcomes recorded since (``pending``) is what a
checkpoint keeps, so a resumed run draws the same batches and moves the level at the same
steps. Metrics per step: ``curriculum/level`` (of the step's batch), ``curriculum/pass_rate``
(its episodes'), ``curriculum/window_pass_rate`` and ``curriculum/next_level``.
(reasoning-gym: ``CurriculumExperiment.update_difficulty`` moves one attribute by hand; verl and
TRL have no curriculum. Deliberate difference: one global level, moved by the pass rate.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from materl.errors import ConfigError

LEVEL, INDEX = "curriculum_level", "curriculum_index"  # columns a curriculum adds to its rows


@runtime_checkable
class Knobbed(Protocol):
    """A dataset that declares difficulty knobs: levels ``0 .. levels - 1``, easiest first."""

    @property
    def levels(self) -> int: ...

    @property
    def score_key(self) -> str: ...  # the episode metric whose value says whether an episode passed

    def rows_at(self, level: int, n: int, *, seed: int) -> list[dict]: ...


@dataclass(frozen=True)
class Curriculum:
    """When to move the level (see the module docstring)."""
    start_level: int = 0
    raise_above: float = 0.8
    lower_below: float = 0.2
    window: int = 32
    pass_score: float = 1.0
    pool_size: int = 256
    band: tuple[float, float] | None = None

    def __post_init__(self):
        if not 0.0 <= self.lower_below < self.raise_above <= 1.0:
            raise ConfigError(f"curriculum: lower_below={self.lower_below}, raise_above={self.raise_above}; accepted: "
                              f"0 <= lower_below < raise_above <= 1")
        for name in ("window", "pool_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"curriculum: {name}={getattr(self, name)!r}; accepted: an integer >= 1")
        if not isinstance(self.start_level, int) or self.start_level < 0:
            raise ConfigError(f"curriculum: start_level={self.start_level!r}; accepted: an integer >= 0")
        if self.band is not None:
            band = tuple(self.band)
            if len(band) != 2 or not 0.0 <= band[0] <= band[1] <= 1.0:
                raise ConfigError(f"curriculum: band={self.band!r}; accepted: [lo, hi] with 0 <= lo <= hi <= 1, or null")
            object.__setattr__(self, "band", (float(band[0]), float(band[1])))


def check_knobbed(dataset: Any, curriculum: Curriculum) -> Knobbed:
    """``dataset`` if it declares knobs (and ``start_level`` is one of them), else ConfigError."""
    if not isinstance(dataset, Knobbed):
        raise ConfigError(f"a curriculum needs a dataset that declares difficulty knobs (levels, score_key, "
                          f"rows_at(level, n, seed=)), e.g. a ReasoningGymTask; got {type(dataset).__name__}")
    if dataset.levels < 1:
        raise ConfigError(f"a curriculum needs difficulty levels; {dataset!r} declares none")
    if curriculum.start_level >= dataset.levels:
        raise ConfigError(f"curriculum: start_level={curriculum.start_level}; {dataset!r} has levels "
                          f"0..{dataset.levels - 1}")
    return dataset


class CurriculumSampler:
    """``Sampler``'s interface (``next_batch``, ``state_dict``, ``load_state_dict``) over a
    Knobbed dataset, plus ``observe(step, episodes)`` after each learned step."""

    def __init__(self, dataset: Knobbed, curriculum: Curriculum, *, batch_size: int, seed: int = 0,
                 max_staleness: int = 0, prepare: Callable[[list[dict], str], list[dict]] | None = None):
        self.dataset, self.c = check_knobbed(dataset, curriculum), curriculum
        self.prepare = prepare  # (rows, where) -> checked rows (``prepare_rows`` against the compiled step)
        self.batch_size, self.seed, self.S = batch_size, seed, max_staleness
        self._pools: dict[int, list[dict]] = {}
        self.outcomes: dict[int, list[list]] = {}  # step -> [[level, index, passed fraction, episodes]] per group
        self.step_metrics: dict[int, dict[str, float]] = {}
        self._reset()

    def _reset(self) -> None:
        self.level, self.window, self.drawn, self.applied = self.c.start_level, [], 0, -1
        self.positions: dict[str, list[int]] = {}  # level -> [epoch, index]
        self.rates: dict[str, float] = {}  # "level:index" -> last group pass rate
        self.fallbacks = 0

    # -- drawing -------------------------------------------------------------------------------

    def pool(self, level: int) -> list[dict]:
        if level not in self._pools:
            rows = self.dataset.rows_at(level, self.c.pool_size, seed=self.seed + level)
            rows = [{**r, LEVEL: level, INDEX: i} for i, r in enumerate(rows)]
            self._pools[level] = self.prepare(rows, f"curriculum level {level}") if self.prepare else rows
        return self._pools[level]

    def next_batch(self) -> list[dict]:
        """Batch ``self.drawn``: the outcomes of steps up to ``drawn - 1 - S`` applied, then
        ``batch_size`` prompts at the level they give."""
        for k in range(self.applied + 1, self.drawn - self.S):
            self._apply(k)
        self.applied = max(self.applied, self.drawn - 1 - self.S)
        rows = self.pool(self.level)
        epoch, index = self.positions.get(str(self.level), [0, 0])
        batch, skipped = [], 0
        while len(batch) < self.batch_size:
            if index >= len(rows):
                epoch, index = epoch + 1, 0
            i = self._order(self.level, epoch)[index]
            index += 1
            rate = self.rates.get(f"{self.level}:{i}")
            if self.c.band and rate is not None and not self.c.band[0] <= rate <= self.c.band[1] and skipped < len(rows):
                skipped += 1
                continue
            if skipped >= len(rows):
                self.fallbacks += 1
            skipped = 0
            batch.append(rows[i])
        self.positions[str(self.level)] = [epoch, index]
        self.drawn += 1
        return batch

    def _order(self, level: int, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + level * 10_007 + epoch)
        return torch.randperm(len(self.pool(level)), generator=g).tolist()

    # -- observing -----------------------------------------------------------------------------

    def observe(self, step: int, episodes: Sequence[Any]) -> None:
        """Record step ``step``'s outcomes (applied when batch ``step + 1 + S`` is drawn)."""
        groups: dict[tuple[int, int], list[float]] = {}
        key = self.dataset.score_key
        for e in episodes:
            if e.error is not None or LEVEL not in e.columns:
                continue
            score = e.metrics.get(key)
            if score is None:
                raise ConfigError(f"curriculum: episode metric {key!r} (the dataset's score_key) is missing; the "
                                  f"episode has: {', '.join(sorted(e.metrics)) or 'nothing'} (is the dataset's "
                                  f"reward in the recipe?)")
            groups.setdefault((int(e.columns[LEVEL]), int(e.columns[INDEX])), []).append(
                float(score >= self.c.pass_score))
        self.outcomes[step] = [[lv, i, sum(p) / len(p), len(p)] for (lv, i), p in groups.items()]
        for old in [s for s in self.outcomes if s < step - 2 * self.S - 2]:
            del self.outcomes[old]
        passed = sum(r * n for _, _, r, n in self.outcomes[step])
        total = sum(n for *_, n in self.outcomes[step])
        levels = [lv for lv, *_ in self.outcomes[step]]
        self.step_metrics[step] = {"curriculum/level": sum(levels) / len(levels) if levels else float(self.level),
                                   "curriculum/pass_rate": passed / total if total else 0.0}

    def metrics(self, step: int) -> dict[str, float]:
        """Step ``step``'s curriculum metrics (once; see the module docstring)."""
        m = self.step_metrics.pop(step, {})
        window = sum(self.window) / len(self.window) if self.window else 0.0
        return {**m, "curriculum/window_pass_rate": window, "curriculum/next_level": float(self.level),
                "curriculum/band_fallback": float(self.fallbacks)} if m else m

    def _apply(self, step: int) -> None:
        for level, index, rate, n in self.outcomes.get(step, ()):
            self.rates[f"{level}:{index}"] = rate
            if level != self.level:
                continue  # drawn before the last move
            self.window = (self.window + [1.0] * round(rate * n) + [0.0] * (n - round(rate * n)))[-self.c.window:]
        if len(self.window) < self.c.window:
            return
        rate = sum(self.window) / len(self.window)
        if rate >= self.c.raise_above and self.level < self.dataset.levels - 1:
            self.level, self.window = self.level + 1, []
        elif rate < self.c.lower_below and self.level > 0:
            self.level, self.window = self.level - 1, []

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"level": self.level, "window": list(self.window), "drawn": self.drawn, "applied": self.applied,
                "positions": {k: list(v) for k, v in self.positions.items()}, "rates": dict(self.rates),
                "fallbacks": self.fallbacks, "curriculum": asdict(self.c)}

    def checkpoint_state(self, before: dict, step: int) -> dict:
        """What a checkpoint after ``step`` steps keeps: the state before batch ``step``
        (``before``) and the outcomes recorded since that batch's draw applied them."""
        pending = {str(s): self.outcomes[s] for s in range(before["applied"] + 1, step) if s in self.outcomes}
        return {**before, "pending": pending}

    def load_state_dict(self, state: dict) -> None:
        self.level, self.window = int(state["level"]), [float(x) for x in state["window"]]
        self.drawn, self.applied = int(state["drawn"]), int(state["applied"])
        self.positions = {k: [int(a), int(b)] for k, (a, b) in state["positions"].items()}
        self.rates = {k: float(v) for k, v in state["rates"].items()}
        self.fallbacks = int(state.get("fallbacks", 0))
        self.outcomes = {int(s): [list(o) for o in v] for s, v in state.get("pending", {}).items()}
