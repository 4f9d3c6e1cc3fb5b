"""The config's ``teacher`` section: the frozen teacher of on-policy distillation
(``recipes/distill.py``, ``ml.with_distillation``), named by a model, an HF folder or a materl
checkpoint, with its own device/dtype/engine options, and the checks that tie it to the recipe
(docs/configs-and-cli.md, "A teacher for distillation"). ``materl.runtime.build.teacher_agent``
builds it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

import materl.recipes
from materl.engines.models import NAMED_MODELS
from materl.errors import ConfigError
from materl.runtime.checkpoint_meta import is_checkpoint
from materl.validation import did_you_mean


class TeacherSection(BaseModel):
    """The frozen teacher of on-policy distillation (docs/recipes.md): a named model, an HF folder,
    or a materl checkpoint (a ``step-NNNNNN`` folder or a run dir, whose ``agent`` is rebuilt
    from its agent.json and loaded). ``device``/``dtype`` null: the model section's;
    ``engine``/``engine_options`` as ``ml.Agent``'s (null: the default engine for the device).
    A recipe with a ``teacher`` parameter (``distill``) gets it there; any other recipe becomes
    ``ml.with_distillation(recipe, "teacher", weight, discount=discount)``."""
    model_config = ConfigDict(extra="forbid", validate_assignment=True)  # as every config section

    name: str
    agent: str = "policy"  # the checkpoint's agent (a checkpoint teacher only)
    weight: float | None = Field(default=None, ge=0.0)  # with_distillation's weight; null: 1.0
    discount: float | None = Field(default=None, ge=0.0, le=1.0)  # with_distillation's discount; null: 0.0
    device: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    engine: str | None = None
    engine_options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _known_teacher(cls, v: str) -> str:
        if v in NAMED_MODELS or (Path(v).expanduser() / "config.json").is_file() or is_checkpoint(v):
            return v
        raise ValueError(f"teacher {v!r} is neither a named model, a folder with config.json nor a materl checkpoint "
                         f"(a step-NNNNNN folder or a run dir with checkpoints/){did_you_mean(v, NAMED_MODELS.names())}"
                         f"; named models: {', '.join(NAMED_MODELS.names())}")

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str | None) -> str | None:
        return check_device(v)

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, v: str | None) -> str | None:
        from materl.engines import ENGINES

        if v is not None and v not in ENGINES:
            raise ValueError(f"unknown engine {v!r}{did_you_mean(v, ENGINES.names())}; accepted: "
                             f"{', '.join(ENGINES.names())} or null (the default for the device)")
        return v

    @model_validator(mode="after")
    def _agent_of_a_checkpoint(self):
        if "agent" in self.model_fields_set and not is_checkpoint(self.name):
            raise ValueError(f"teacher.agent={self.agent!r} picks an agent of a checkpoint, but teacher.name "
                             f"{self.name!r} is a model, not a checkpoint; remove teacher.agent")
        return self


def check_device(v: str | None) -> str | None:
    if v is not None:
        import torch

        try:
            torch.device(v)
        except (RuntimeError, TypeError):
            raise ValueError(f"device {v!r} is not a torch device; valid: cpu, cuda, cuda:N or null") from None
    return v


def recipe_has_teacher(recipe: str) -> bool | None:
    """Whether the built-in ``recipe`` takes a ``teacher`` agent (None: a user recipe, known at build)."""
    found = materl.recipes.RECIPES.get(recipe)
    if found is not None:
        return "teacher" in found.params
    return False if recipe in materl.recipes.FACTORIES else None


def check_teacher(cfg: Any, has_teacher: bool | None, where: str, lines: dict[tuple, int]) -> None:
    """A recipe with a ``teacher`` parameter needs the teacher section; ``teacher.weight`` and
    ``teacher.discount`` set with_distillation's terms, which such a recipe sets itself."""
    def at(*path: str) -> str:
        return f"{where}:{lines[path]}" if path in lines else where

    if has_teacher and cfg.teacher is None:
        raise ConfigError(f"recipe {cfg.recipe!r} distils from a teacher, but the config has no teacher section "
                          f"({at('recipe')}); add one, e.g. teacher: {{name: runs/calculator}} (a model name, an HF "
                          f"folder or a checkpoint)")
    if has_teacher and cfg.teacher is not None:
        for key in ("weight", "discount"):
            if getattr(cfg.teacher, key) is not None:
                raise ConfigError(f"teacher.{key}={getattr(cfg.teacher, key)!r} ({at('teacher', key)}) applies "
                                  f"ml.with_distillation to a recipe without a teacher, but recipe {cfg.recipe!r} has "
                                  f"its own teacher term; remove teacher.{key} (or use its recipe's coefficients)")
