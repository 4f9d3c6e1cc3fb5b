"""Training configuration: one typed, validated record read from YAML.

    cfg = load_config("examples/configs/tiny_grpo.yaml", overrides=["train.steps=3", "compile.lr=1e-5"])
    cfg.train.steps                    # 3
    cfg.compile_options()              # materl.compiler.options.CompileOptions
    config_to_dict(cfg)                # plain dict (saved into checkpoints)

Sections: ``model``, ``ref_model``, ``teacher``, ``recipe``, ``rewards``, ``tools``, ``data``, ``compile``,
``train``, ``logging``. Every key has one default, here. Unknown keys are errors (a typo is not
silently ignored). A bad value raises :class:`~materl.errors.ConfigError` naming the field path
(``train.steps``), the value received, the accepted range or choices and, for a file, the line
of the key (``run.yaml:12``). Reading the YAML itself (duplicate keys, overrides, key lines) is
``materl.runtime.config_yaml``.

Overrides are ``dotted.path=value``; the value is parsed as a YAML scalar (``3`` is an int,
``1e-5`` a float, ``true`` a bool, ``null`` None, ``[1, 2]`` a list); list items are addressed by
index (``rewards.0.weight=0.5``). (verl: Hydra/OmegaConf overrides; TRL: ``HfArgumentParser``
dataclasses. Deliberate difference: no interpolation, no config groups — one file, one record.)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

import materl.recipes
from materl.compiler.options import CompileOptions
from materl.engines.models import NAMED_MODELS, lora_options
from materl.errors import ConfigError, MaterlError
from materl.ops.offpolicy import correction_params
from materl.ops.rewards import REWARDS
from materl.runtime.config_yaml import apply_override, key_lines, read_config_data
from materl.runtime.curriculum import Curriculum, check_knobbed
from materl.runtime.early_stop import EarlyStopping
from materl.runtime.logging import require_backend
from materl.runtime.reasoning_tasks import is_task_source, task_from_source
from materl.runtime.resolve import is_dotted
from materl.runtime.teacher_config import TeacherSection, check_device, check_teacher, recipe_has_teacher
from materl.validation import describe, did_you_mean

DATA_GENERATORS = ("arithmetic",)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(_Section):
    """The trained policy: a named model (``tiny-random``, ``smollm2-135m-instruct``) or an
    HF folder; ``lora``: dict(r, alpha, dropout, targets) or None; ``head``: None or "value";
    ``device`` and ``dtype`` (compute dtype; weights and optimizer state stay fp32) apply to every
    agent of the run (``materl.device``)."""
    name: str = "tiny-random"
    lora: dict[str, Any] | None = None
    head: Literal["value"] | None = None
    device: str | None = None  # cpu, cuda, cuda:N; null: cuda when present (every agent of the run)
    dtype: Literal["float32", "bfloat16", "float16"] | None = None  # compute dtype; null: bf16 on CUDA, fp32 on CPU

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str | None) -> str | None:
        return check_device(v)

    @field_validator("name")
    @classmethod
    def _known_model(cls, v: str) -> str:
        return _check_model(v)

    @field_validator("lora")
    @classmethod
    def _lora_keys(cls, v: dict | None) -> dict | None:
        if v is not None:

            lora_options(v)
        return v


class RefModelSection(_Section):
    """The reference model; ``name: null`` means a frozen copy of ``model.name``."""
    name: str | None = None

    @field_validator("name")
    @classmethod
    def _known_model(cls, v: str | None) -> str | None:
        return None if v is None else _check_model(v)


class RewardSpec(_Section):
    """One reward term: a built-in reward name or ``package.module:function``."""
    name: str
    weight: float = 1.0
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _known_reward(cls, v: str) -> str:

        if v in REWARDS or is_dotted(v):
            return v
        raise ValueError(f"unknown reward {v!r}{did_you_mean(v, REWARDS.names())}; accepted: "
                         f"{', '.join(REWARDS.names())} or 'package.module:function'")


class CurriculumSection(_Section):
    """``materl.runtime.curriculum.Curriculum``'s fields, plus ``eval_level``: the level of the
    held-out rows (null: the hardest)."""
    start_level: int = Field(default=0, ge=0)
    raise_above: float = Field(default=0.8, ge=0.0, le=1.0)
    lower_below: float = Field(default=0.2, ge=0.0, le=1.0)
    window: int = Field(default=32, ge=1)
    pass_score: float = 1.0
    pool_size: int = Field(default=256, ge=1)
    band: tuple[float, float] | None = None
    eval_level: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _valid(self):
        try:
            self.curriculum()
        except ConfigError as e:
            raise ValueError(str(e).removeprefix("curriculum: ")) from None
        return self

    def curriculum(self) -> Curriculum:
        return Curriculum(**self.model_dump(exclude={"eval_level"}))


class EarlyStoppingSection(_Section):
    """``materl.runtime.early_stop.EarlyStopping``: stop when ``metric`` (an ``eval/`` metric) has
    not improved by more than ``min_delta`` for ``patience`` evaluations, or once it reaches ``stop_at``."""
    metric: str = "eval/accuracy"
    mode: Literal["max", "min"] = "max"
    patience: int = Field(default=3, ge=1)
    min_delta: float = Field(default=0.0, ge=0.0)
    stop_at: float | None = None

    def early_stopping(self) -> EarlyStopping:
        return EarlyStopping(**self.model_dump())


class DataSection(_Section):
    """Where prompts come from: ``arithmetic`` (a seeded generator), ``reasoning_gym:<task>``
    (a reasoning-gym task, ``materl.runtime.reasoning_tasks``: ``params`` its options, ``level``
    a fixed difficulty, ``curriculum`` a moving one), a JSONL file, or a ``datasets`` folder saved
    with ``save_to_disk``. ``train_size``/``test_size`` are the split sizes (``train_size: null`` =
    every row not held out); ``params`` go to the generator.
    A prompt longer than ``max_prompt_tokens`` (and than the model's context less
    ``compile.max_new_tokens``) is an error naming the row, or with ``truncation: left`` / ``right``
    cut to fit (verl: ``data.max_prompt_length``, ``data.truncation``)."""
    source: str = "arithmetic"
    train_size: int | None = Field(default=256, ge=1)
    test_size: int = Field(default=32, ge=0)
    seed: int = 0
    params: dict[str, Any] = Field(default_factory=dict)
    max_prompt_tokens: int | None = Field(default=None, ge=1)  # None: the model's context less max_new_tokens
    truncation: Literal["error", "left", "right"] = "error"  # an over-long prompt: an error, or cut (left keeps the end)
    shuffle: bool = True  # each pass over the training rows in a seeded random order (compile.shuffle: the learner's)
    level: int | None = Field(default=None, ge=0)  # reasoning_gym: a fixed difficulty level of the task's knobs
    curriculum: CurriculumSection | None = None  # reasoning_gym (a dataset with knobs): a level moved by the pass rate


class TrainSection(_Section):
    """The loop: ``steps`` optimizer steps of ``batch_size`` prompts each (x group_size episodes)."""
    steps: int = Field(default=100, ge=1)
    batch_size: int = Field(default=8, ge=1)
    eval_every: int = Field(default=0, ge=0)  # 0: never
    eval_size: int | None = Field(default=None, ge=1)  # held-out prompts per evaluation; None: all
    save_every: int = Field(default=0, ge=0)  # 0: only at the end
    keep_last: int = Field(default=3, ge=1)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(default=0, ge=0)
    seed: int = 0
    run_dir: str = "runs/materl"
    resume: str | bool | None = None  # a checkpoint/run dir, or true: this run_dir's latest
    resume_fallback: bool = True  # a damaged latest checkpoint: warn and resume from the newest intact one
    early_stopping: EarlyStoppingSection | None = None  # needs eval_every >= 1 and a held-out split

    @model_validator(mode="after")
    def _early_stopping_evaluates(self) -> TrainSection:
        if self.early_stopping is not None and not self.eval_every:
            raise ValueError("early_stopping needs evaluations: set eval_every >= 1 (evaluations are what it "
                             "compares), and data.test_size >= 1")
        return self

    @model_validator(mode="after")
    def _warmup_fits(self) -> TrainSection:
        if self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} is more than steps={self.steps}; "
                             f"accepted: 0 <= warmup_steps <= steps")
        return self


class LoggingSection(_Section):
    """Where metrics go besides ``run_dir/metrics.jsonl``; ``tensorboard: null`` = on if installed."""
    progress: bool = True
    tensorboard: bool | None = None
    wandb: bool = False
    mlflow: bool = False
    samples_every: int = Field(default=0, ge=0)  # write episode samples every N steps; 0: never

    @field_validator("wandb", "mlflow")
    @classmethod
    def _installed(cls, v: bool, info) -> bool:
        if v:

            try:
                require_backend(info.field_name)
            except ConfigError as e:
                raise ValueError(str(e).replace(f"logging.{info.field_name}=true but ", "")) from None
        return v


class DistributedSection(_Section):
    """Scale-out (see docs/scaling-out.md): rollout workers, how far rollouts may run ahead of
    the learner, where the Ray cluster is and how weights travel to the workers."""
    workers: int = Field(default=0, ge=0)  # Ray rollout actors; 0: sample in this process
    max_staleness: int = Field(default=0, ge=0)  # 0: lock-step
    partial_rollouts: bool = False
    deterministic: bool = False
    ray_address: str | None = None  # an existing cluster ("auto", "ray://head:10001"); None: a local one
    weight_transport: Literal["object_store", "disk"] = "object_store"
    correction: dict[str, Any] | None = None  # {method: tis|mis|decoupled, ...its keywords}: ml.with_off_policy_correction
    learner_ranks: int = Field(default=1, ge=1)  # data-parallel learner ranks; >= 2: Ray actors (gloo/NCCL)
    learner_strategy: Literal["ddp", "fsdp2"] = "ddp"  # how the ranks hold the model: replicas or shards

    @field_validator("correction")
    @classmethod
    def _known_correction(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        hparams = dict(v)
        method = hparams.pop("method", None)
        try:
            correction_params(method, hparams)
        except MaterlError as e:
            raise ValueError(f"{e} (write correction: {{method: tis, cap: 2.0}})") from None
        return v

    @model_validator(mode="after")
    def _needs_workers(self):
        if self.ray_address is not None and self.workers == 0 and self.learner_ranks == 1:
            raise ValueError(f"ray_address={self.ray_address!r} is given but workers=0 (sampling in this process) and "
                             f"learner_ranks=1 (learning in this process); set workers >= 1 or learner_ranks >= 2 to "
                             f"use the cluster")
        for key, value in (("workers", self.workers), ("learner_ranks", self.learner_ranks)):
            if value > (0 if key == "workers" else 1) and not _has_ray():
                raise ValueError(f"{key}={value} runs on Ray, which is not installed: pip install \"materl[ray]\" "
                                 f"(or set {key}={0 if key == 'workers' else 1} to stay in this process)")
        return self


def _has_ray() -> bool:
    try:
        return importlib.util.find_spec("ray") is not None
    except ImportError:
        return False


PIPELINE_OPTIONS = ("max_staleness", "partial_rollouts", "deterministic")  # compile options the section sets


class TrainConfig(_Section):
    """The whole run. ``compile`` is :class:`~materl.compiler.options.CompileOptions` itself."""
    model: ModelSection = Field(default_factory=ModelSection)
    ref_model: RefModelSection = Field(default_factory=RefModelSection)
    teacher: TeacherSection | None = None  # on-policy distillation (docs/recipes.md)
    recipe: str = "grpo"
    rewards: list[RewardSpec] = Field(default_factory=list)  # empty: the recipe's own rewards
    tools: list[str] = Field(default_factory=list)  # MCP server command lines or http(s) URLs
    data: DataSection = Field(default_factory=DataSection)
    compile: CompileOptions = Field(default_factory=CompileOptions)
    train: TrainSection = Field(default_factory=TrainSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    distributed: DistributedSection = Field(default_factory=DistributedSection)
    _base_dir: Path | None = PrivateAttr(default=None)  # the config file's folder (load_config)

    @property
    def search_dirs(self) -> list[Path]:
        """Where ``module:attribute`` names are looked up besides sys.path: the config file's
        folder, then the working directory."""
        return [p for p in (self._base_dir, Path.cwd()) if p is not None]

    @field_validator("recipe")
    @classmethod
    def _known_recipe(cls, v: str) -> str:
        choices = recipe_choices()
        if v not in choices and not is_dotted(v):
            raise ValueError(f"unknown recipe {v!r}{did_you_mean(v, choices)}; accepted: {', '.join(choices)} "
                             f"or 'package.module:recipe' (a module next to the config works)")
        return v

    @field_validator("tools")
    @classmethod
    def _tool_specs(cls, v: list[str]) -> list[str]:
        for i, spec in enumerate(v):
            if not spec.strip():
                raise ValueError(f"tools[{i}] is empty; accepted: an MCP server command line or an http(s) URL")
            if "://" in spec and not spec.startswith(("http://", "https://")):
                raise ValueError(f"tools[{i}]={spec!r} has an unsupported scheme; accepted: http://, https://")
        return v

    @model_validator(mode="after")
    def _pipeline_set_once(self):
        for name in PIPELINE_OPTIONS:
            if (name in self.compile.model_fields_set and name in self.distributed.model_fields_set
                    and getattr(self.compile, name) != getattr(self.distributed, name)):
                raise ValueError(f"{name} is set in both compile ({getattr(self.compile, name)!r}) and distributed "
                                 f"({getattr(self.distributed, name)!r}); set it in one place (they disagree)")
        return self

    def compile_options(self) -> CompileOptions:
        """The validated compile options (``seed`` defaults to ``train.seed`` unless set in
        ``compile``; the pipeline options come from the ``distributed`` section where it sets them)."""
        update = {name: getattr(self.distributed, name) for name in PIPELINE_OPTIONS
                  if name in self.distributed.model_fields_set}
        if "seed" not in self.compile.model_fields_set:
            update["seed"] = self.train.seed
        return self.compile.model_copy(update=update) if update else self.compile


def recipe_choices() -> list[str]:
    """Built-in recipe names a config may use (besides ``package.module:recipe``)."""
    return materl.recipes.names()


# ----------------------------------------------------------------------------- loading


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Read a YAML file, apply ``key.path=value`` overrides, validate.

    A relative ``data.source`` that is not found from the working directory is looked up next
    to the config file. Raises ConfigError (missing file, bad YAML, bad override, bad value).
    """
    path = Path(path)
    data = read_config_data(path)
    for item in overrides:
        apply_override(data, item)
    resolve_data_source(data, path.parent)
    lines = key_lines(path.read_text(encoding="utf-8"))
    for item in overrides:  # an overridden key's value is not the file's: no line (0) for it and what it holds
        key = tuple(int(p) if p.isdigit() else p for p in item.partition("=")[0].strip().split("."))
        lines = {**{k: v for k, v in lines.items() if k[:len(key)] != key}, key: 0}
    cfg = validate_config(data, where=str(path), lines=lines)
    cfg._base_dir = path.resolve().parent
    return cfg


def validate_config(data: dict[str, Any], *, where: str = "config", lines: dict[tuple, int] | None = None
                    ) -> TrainConfig:
    """A :class:`TrainConfig` from a plain dict; errors become one ConfigError per failure, each
    with the ``where:line`` of its key when ``lines`` (``key_lines``) has it."""
    lines = lines or {}

    def locate(loc: tuple) -> str | None:
        for n in range(len(loc), 0, -1):  # the key itself, else the nearest section written in the file
            if loc[:n] in lines:
                return f"{where}:{lines[loc[:n]]}" if lines[loc[:n]] else None
        return None

    try:
        cfg = TrainConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(describe(e, TrainConfig, where=f"config ({where})", locate=locate)) from None
    _check_data_source(cfg.data, where)
    check_teacher(cfg, recipe_has_teacher(cfg.recipe), where, lines)
    return cfg


def config_to_dict(cfg: TrainConfig | dict) -> dict[str, Any]:
    """Plain JSON/YAML-safe dict of a config (a dict passes through as a copy); ``compile`` holds
    the effective options (its seed resolved from ``train.seed``)."""
    if isinstance(cfg, dict):
        return dict(cfg)
    return {**cfg.model_dump(mode="json"), "compile": cfg.compile_options().model_dump(mode="json")}


# ----------------------------------------------------------------------------- checks and messages


def _check_model(name: str) -> str:

    if name in NAMED_MODELS or (Path(name).expanduser() / "config.json").is_file():
        return name
    raise ValueError(f"model {name!r} is neither a named model nor a folder with config.json"
                     f"{did_you_mean(name, NAMED_MODELS.names())}; named models: {', '.join(NAMED_MODELS.names())}")


def resolve_data_source(data: dict[str, Any], config_dir: Path) -> None:
    """A relative ``data.source`` not found from the working directory, made relative to ``config_dir``."""
    section = data.get("data")
    source = section.get("source") if isinstance(section, dict) else None
    if not isinstance(source, str) or source in DATA_GENERATORS or is_task_source(source) or Path(source).is_absolute():
        return
    if not Path(source).exists() and (config_dir / source).exists():
        section["source"] = str(config_dir / source)


def eval_level(data: DataSection, task: Any) -> int | None:
    """The difficulty level of the held-out rows: ``curriculum.eval_level`` (default the
    hardest) under a curriculum, else ``data.level`` (None: the task's own options)."""
    if data.curriculum is None:
        return data.level
    return data.curriculum.eval_level if data.curriculum.eval_level is not None else task.levels - 1


def _check_data_source(data: DataSection, where: str) -> None:
    source = data.source
    if is_task_source(source):
        try:
            task = task_from_source(source, options=data.params, level=data.level, seed=data.seed)
            if data.curriculum is not None:
                if data.level is not None:
                    raise ConfigError(f"data.level={data.level} fixes the difficulty and data.curriculum moves it; "
                                      f"set one (curriculum.start_level is where a curriculum starts)")
                check_knobbed(task, data.curriculum.curriculum())
                task.rows_at(eval_level(data, task), 1, seed=data.seed)
        except MaterlError as e:
            raise type(e)(f"data.source {source!r} ({where}): {e}") from None
        return
    if data.level is not None or data.curriculum is not None:
        raise ConfigError(f"data.level / data.curriculum need a dataset with difficulty knobs (reasoning_gym:<task>); "
                          f"data.source is {source!r} ({where})")
    if source in DATA_GENERATORS:
        return
    p = Path(source).expanduser()
    if (p.is_file() and p.suffix in (".jsonl", ".json")) or p.is_dir():
        return
    raise ConfigError(f"data.source: {source!r} is not a generator, a .jsonl file or a saved `datasets` folder "
                      f"({'not found' if not p.exists() else 'unsupported file type'}); accepted: "
                      f"{', '.join(DATA_GENERATORS)}, reasoning_gym:<task>, a path to a .jsonl file, "
                      f"a datasets.save_to_disk folder "
                      f"(in {where})")


