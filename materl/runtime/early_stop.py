"""Early stopping on an evaluation metric, with patience and a minimum change.

    ml.train(step, rows, steps=500, eval_dataset=held_out, eval_every=10,
             early_stopping=ml.EarlyStopping(metric="eval/accuracy", patience=3, min_delta=0.01))

After every evaluation the metric is compared with the best so far: it improves when it beats
the best by more than ``min_delta`` (``mode="max"``: larger is better; ``"min"``: smaller). The
step of each improvement is saved as a checkpoint (unless one is saved there anyway) and named
``checkpoints/best`` (never pruned by ``keep_last``); after ``patience`` evaluations in a row
without one, the run stops after a final checkpoint and reports ``stopped_at`` and
``best_checkpoint``. ``stop_at``: also stop as soon as an evaluation reaches this value (``>=``
with ``mode="max"``, ``<=`` with ``"min"``): a target met, not a plateau. The first evaluation
(step 0 included) sets the best. The tracker's state is saved in checkpoints, so a resumed run
counts on. (Keras ``EarlyStopping(monitor, min_delta, patience, mode, restore_best_weights,
baseline)``; Lightning's ``EarlyStopping`` likewise, whose ``stopping_threshold`` is ``stop_at``;
TRL uses the transformers callback. Deliberate difference: the best weights are kept on disk and named, not
restored into the model.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from materl.errors import ConfigError

MODES = ("max", "min")


@dataclass
class EarlyStopping:
    """The rule (``metric``, ``mode``, ``patience``, ``min_delta``, ``stop_at``) and its running state."""
    metric: str = "eval/accuracy"
    mode: Literal["max", "min"] = "max"
    patience: int = 3
    min_delta: float = 0.0
    stop_at: float | None = None
    best: float | None = field(default=None, repr=False)
    best_step: int | None = field(default=None, repr=False)
    bad_evals: int = field(default=0, repr=False)
    reached: bool = field(default=False, repr=False)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ConfigError(f"early_stopping.mode={self.mode!r}; accepted: {', '.join(MODES)}")
        if not isinstance(self.patience, int) or isinstance(self.patience, bool) or self.patience < 1:
            raise ConfigError(f"early_stopping.patience={self.patience!r}; accepted: an integer >= 1 (evaluations)")
        if not isinstance(self.min_delta, (int, float)) or not math.isfinite(self.min_delta) or self.min_delta < 0:
            raise ConfigError(f"early_stopping.min_delta={self.min_delta!r}; accepted: a number >= 0")
        if self.stop_at is not None and (isinstance(self.stop_at, bool) or not isinstance(self.stop_at, (int, float))
                                         or not math.isfinite(self.stop_at)):
            raise ConfigError(f"early_stopping.stop_at={self.stop_at!r}; accepted: a finite number, or null")
        if not self.metric.startswith("eval/"):
            self.metric = f"eval/{self.metric}"

    def update(self, step: int, record: dict[str, float]) -> bool:
        """Take an evaluation ``record`` (``eval/...`` keys) at ``step``; True if it improved."""
        if self.metric not in record:
            have = ", ".join(sorted(k for k in record if k.startswith("eval/"))) or "none"
            raise ConfigError(f"early_stopping.metric={self.metric!r} is not among the evaluation's metrics "
                              f"(step {step}): {have}")
        value = float(record[self.metric])
        better = self.best is None or (value > self.best + self.min_delta if self.mode == "max"
                                       else value < self.best - self.min_delta)
        if better:
            self.best, self.best_step, self.bad_evals = value, step, 0
        else:
            self.bad_evals += 1
        if self.stop_at is not None:
            self.reached = value >= self.stop_at if self.mode == "max" else value <= self.stop_at
        return better

    @property
    def should_stop(self) -> bool:
        return self.bad_evals >= self.patience or self.reached

    def state_dict(self) -> dict:
        return {"best": self.best, "best_step": self.best_step, "bad_evals": self.bad_evals, "reached": self.reached}

    def load_state_dict(self, state: dict) -> None:
        self.best = None if state.get("best") is None else float(state["best"])
        self.best_step = None if state.get("best_step") is None else int(state["best_step"])
        self.bad_evals = int(state.get("bad_evals", 0))
        self.reached = bool(state.get("reached", False))
