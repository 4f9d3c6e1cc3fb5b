"""What ``ml.train`` is told: the config's ``train``, ``logging``, ``distributed`` and ``data``
sections (``materl.runtime.config``), as one ``TrainSettings``.

``materl train CONFIG.yaml`` passes the validated sections (``TrainSettings.of(cfg)``); a Python
caller writes keywords (``ml.train(step, rows, steps=50, eval_every=10, workers=2)``), each
routed to the section that holds it, so both ways of starting a run read the same fields.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from typing import Any

from materl.runtime.config import DataSection, DistributedSection, LoggingSection, TrainConfig, TrainSection

# the keywords ml.train takes, by section (the section's own field names)
KEYWORDS: dict[str, tuple[str, ...]] = {
    "train": ("steps", "batch_size", "eval_every", "save_every", "keep_last", "run_dir", "resume", "resume_fallback",
              "lr_schedule", "warmup_steps", "seed"),
    "logging": ("progress", "samples_every", "tensorboard", "wandb", "mlflow"),
    "distributed": ("workers", "ray_address", "weight_transport", "learner_ranks", "learner_strategy"),
    "data": ("max_prompt_tokens", "truncation", "shuffle"),
}
_SECTIONS = {"train": TrainSection, "logging": LoggingSection, "distributed": DistributedSection, "data": DataSection}
_PATHS = ("run_dir", "resume")  # keywords that may be os.PathLike


@dataclass(frozen=True)
class TrainSettings:
    """The sections one run reads: ``train`` (steps, evaluation, checkpoints, seed), ``logging``,
    ``distributed`` (rollout workers, learner ranks) and ``data`` (prompt fitting, order)."""

    train: TrainSection = field(default_factory=TrainSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    data: DataSection = field(default_factory=DataSection)

    @classmethod
    def of(cls, cfg: TrainConfig) -> TrainSettings:
        """A validated config's sections."""
        return cls(train=cfg.train, logging=cfg.logging, distributed=cfg.distributed, data=cfg.data)

    @classmethod
    def from_keywords(cls, keywords: dict[str, Any]) -> TrainSettings:
        """``ml.train``'s keywords, each into its section (TypeError for one it does not take).
        Values are checked where they are used, as they always were (``steps`` >= 1,
        ``learner_ranks``, ``lr_schedule`` ...), not here."""
        if "steps" not in keywords:
            raise TypeError("ml.train() missing required keyword argument: 'steps'")
        by_section: dict[str, dict[str, Any]] = {name: {} for name in KEYWORDS}
        for key, value in keywords.items():
            section = next((name for name, keys in KEYWORDS.items() if key in keys), None)
            if section is None:
                raise TypeError(f"ml.train() got an unexpected keyword argument {key!r}{_did_you_mean(key)}")
            by_section[section][key] = os.fspath(value) if key in _PATHS and isinstance(value, os.PathLike) else value
        return cls(**{name: _SECTIONS[name].model_construct(**values) for name, values in by_section.items()})


def _did_you_mean(key: str) -> str:
    known = [k for keys in KEYWORDS.values() for k in keys]
    close = difflib.get_close_matches(key, known, n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; accepted: {', '.join(known)}"
