"""``ml.train``: the loop around a compiled algorithm — data, LR schedule, evaluation,
checkpoints (atomic, resumable bit-identically on CPU), logging.

    step = ml.compile(recipe, policy=policy, ref_policy=ref, group_size=4, lr=1e-5)
    ml.train(step, rows, steps=50, batch_size=4, eval_dataset=held_out, eval_every=10,
             save_every=10, run_dir="runs/demo")

What a run does (``materl.runtime.training_run.TrainingRun``):

- Seeds torch, Python's ``random`` and numpy's global RNG with ``seed`` (reward code that uses
  any of them reproduces). Every row of the dataset and the eval dataset is checked before
  anything runs (``materl.runtime.prompts.prepare_rows``): its prompt, the columns the step's
  rewards read, and the prompt's length in tokens against the model's context less
  ``max_new_tokens`` (and ``max_prompt_tokens``); an over-long prompt is a ``DataError`` naming
  the row, or cut with ``truncation="left"`` (keep the end) or ``"right"``.
- A step whose episodes fail too often raises ``StepFailedError`` (compile option
  ``max_failed_fraction``): nothing is saved for it, so the last checkpoint stays the last good
  one. A step that tool infrastructure failures left nothing to learn from (compile options
  ``infra_failures="mask"``, ``max_skipped_steps``) makes no update but is counted like any
  other: logged (``infra_failures/update_skipped`` = 1), the LR schedule advances, a checkpoint
  falls due as usual.
- Steps run through ``materl.distributed.pipeline.Pipeline``: with the compile option
  ``max_staleness=S > 0`` the rollouts of the next S batches run while the learner trains (the
  asynchronous pipeline); with S = 0 each step is ``compiled.run`` on its batch. ``workers``:
  0 samples in this process; N >= 1 in N Ray actors (``ray_address``: an existing cluster,
  default a local one; ``weight_transport``: ``object_store`` or ``disk``). ``learner_ranks``:
  1 learns in this process; R >= 2 on R data-parallel learner ranks as Ray actors
  (``learner_strategy``: ``ddp`` or ``fsdp2``; see ``materl.distributed.ranks``). A rank that
  dies stops the run with ``LearnerRankError``; the last checkpoint is intact.
- ``curriculum`` (``materl.runtime.curriculum``): the dataset is then one that declares
  difficulty knobs (a ``ReasoningGymTask``), drawn at a level the running pass rate moves;
  ``curriculum/*`` metrics per step, its state in checkpoints. ``early_stopping``
  (``materl.runtime.early_stop``, needs ``eval_every``): stop when the evaluation metric has not
  improved for ``patience`` evaluations; the best step is checkpointed and named
  ``checkpoints/best`` (``best_checkpoint`` and ``stopped_at`` in the summary).
- ``resume``: a checkpoint folder or a run dir (its latest). Every file is checked against the
  checkpoint's manifest first; a damaged latest of a run dir is skipped with a warning naming
  the file, for the newest intact one (``resume_fallback=False``: CheckpointError instead).
  SIGINT/SIGTERM under ``materl train`` (``materl.runtime.signals``) stop the run after the
  compute item in flight, a save in progress completes first.
- ``progress``: a bar over steps, and one over each step's episodes and each evaluation's.
  ``wandb``/``mlflow``: also send every metric there (ConfigError if the package is not
  installed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from materl.distributed.launch import rollout_side
from materl.errors import ConfigError
from materl.runtime import signals
from materl.runtime.build import build_from_config
from materl.runtime.config import config_to_dict, validate_config
from materl.runtime.curriculum import Curriculum
from materl.runtime.data import load_rows
from materl.runtime.early_stop import EarlyStopping
from materl.runtime.logging import wandb_login_problem
from materl.runtime.train_settings import TrainSettings
from materl.runtime.training_run import TrainingRun, lr_lambda, ray_running, train_result

__all__ = ["lr_lambda", "train", "train_from_config", "train_result", "train_rlhf"]


def train(compiled, dataset: Any, *, eval_dataset: Any = None, settings: TrainSettings | None = None,
          curriculum: Curriculum | None = None, early_stopping: EarlyStopping | None = None, on_step=None,
          config: dict | None = None, **keywords: Any) -> dict[str, Any]:
    """Train ``compiled`` for ``steps`` steps of ``batch_size`` prompts from ``dataset``; returns
    ``train_result``'s summary: ``history`` (every step's metrics.jsonl record), ``final`` (the
    last one's), ``evals`` (``{"step": 0, "eval/accuracy": ..., "eval/reward": ...}``), the last
    ``checkpoint``, ``run_dir`` (and ``best_checkpoint``, ``stopped_at`` with early stopping).

    ``settings``: a config's sections (``TrainSettings.of(cfg)``), or instead their fields as
    keywords (``materl.runtime.train_settings.KEYWORDS``): ``steps``, ``batch_size``,
    ``eval_every``, ``save_every``, ``keep_last``, ``run_dir``, ``resume``, ``resume_fallback``,
    ``lr_schedule``, ``warmup_steps``, ``seed``; ``progress``, ``samples_every``,
    ``tensorboard``, ``wandb``, ``mlflow``; ``workers``, ``ray_address``, ``weight_transport``,
    ``learner_ranks``, ``learner_strategy``; ``max_prompt_tokens``, ``truncation``, ``shuffle``.
    ``on_step(step, metrics)`` is called after each step; ``config`` (a dict) is saved in
    checkpoints and sent to W&B/MLflow. What happens, fault by fault: the module docstring."""
    if settings is not None and keywords:
        raise TypeError(f"ml.train() takes settings= or their keywords, not both (got {sorted(keywords)})")
    settings = settings or TrainSettings.from_keywords(keywords)
    run = TrainingRun(compiled, settings, config=config, on_step=on_step, early_stopping=early_stopping)
    run.prepare(dataset, eval_dataset, curriculum)
    d, ray_before, interrupted = settings.distributed, ray_running(), False
    store, rollout_workers = rollout_side(compiled, workers=d.workers, ray_address=d.ray_address,
                                          transport=d.weight_transport, folder=str(run.run_dir / "versions"))
    signals.rearm()  # ray.init installs a SIGTERM handler of its own
    try:
        if settings.train.resume:
            run.resume(store)
        run.open_logger()
        run.start_ranks()  # from the agents and optimizers as they are now (restored, on resume)
        compiled.call_blocking(run.loop, run.pipeline(rollout_workers, store, curriculum))
    except KeyboardInterrupt:  # SIGINT/SIGTERM (materl.runtime.signals): stop now, keep the last checkpoint
        interrupted = True
        raise
    finally:
        run.close(rollout_workers, plot=not interrupted, ray_before=ray_before)
    return run.result()


def train_from_config(cfg, rows: Any = None) -> dict[str, Any]:
    """What ``materl train CONFIG.yaml`` runs; returns the final metrics and evaluations.
    ``rows``: in-memory data (a list of rows or a ``datasets.Dataset``) instead of ``cfg.data.source``;
    the first ``cfg.data.test_size`` rows are held out. ``logging.wandb`` without a W&B login
    here is a ConfigError before anything loads (evaluation, which logs nowhere, does not care)."""
    if cfg.logging.wandb and (problem := wandb_login_problem()):
        raise ConfigError(problem)
    compiled, train_rows, test_rows = build_from_config(cfg, load_data=rows is None)
    curriculum = cfg.data.curriculum.curriculum() if cfg.data.curriculum is not None else None
    stopping = cfg.train.early_stopping.early_stopping() if cfg.train.early_stopping is not None else None
    if rows is not None:
        rows = load_rows(rows)
        test_rows, train_rows = rows[: cfg.data.test_size], rows[cfg.data.test_size:]
    eval_rows = (test_rows[: cfg.train.eval_size] if cfg.train.eval_size else test_rows) or None
    try:
        result = train(compiled, train_rows, eval_dataset=eval_rows, settings=TrainSettings.of(cfg),
                       curriculum=curriculum, early_stopping=stopping, config=config_to_dict(cfg))
    finally:
        compiled.close()
    return result


def train_rlhf(model_name: str = "smollm2-135m-instruct", *, algorithm: str = "grpo", dataset: Any = "arithmetic",
               reward_functions: Any = (), tools: Any = (), steps: int = 100, batch_size: int = 8,
               lora: dict | None = None, use_mojo: bool = True, test_size: int = 32, eval_every: int = 0,
               run_dir: str = "runs/materl", seed: int = 0, dataset_options: dict | None = None,
               level: int | None = None, curriculum: dict | None = None, early_stopping: dict | None = None,
               **compile_options: Any) -> dict[str, Any]:
    """Train in one call (TRL-style high-level API); the same validated path as ``materl train``.

        result = ml.train_rlhf("smollm2-135m-instruct", algorithm="grpo_tools", dataset="arithmetic",
                               tools=["python -m materl.tools.calculator"], steps=20, lr=3e-5)

    ``algorithm``: a built-in recipe (``materl recipes`` lists them). ``dataset``: ``"arithmetic"``
    (generated), ``"reasoning_gym:<task>"`` (its options in ``dataset_options``, a fixed ``level``
    or a ``curriculum`` dict as in a config's ``data.curriculum``; the task's scorer is the reward
    unless ``reward_functions`` are given), a ``.jsonl`` file, a folder saved by ``datasets``, or
    rows in memory (a list of dicts or a ``datasets.Dataset``); the first ``test_size`` rows are
    held out for evaluation. ``early_stopping``: a config's ``train.early_stopping`` dict.
    ``reward_functions``: names (``"length"``), ``"module:function"`` strings, ``(name, weight)``
    pairs or ``{"name", "weight", "params"}`` dicts, summed; empty keeps the recipe's rewards.
    ``use_mojo``: Mojo kernels where available (else the torch ops). Other keywords are compile
    options (``lr=``, ``group_size=``, ``max_new_tokens=`` ...). Bad values fail before anything
    loads, naming the field (``compile.group_size``, ``recipe`` ...). Returns what ``ml.train``
    does (``train_result``: ``history``, ``final``, ``evals``, ``checkpoint``, ``run_dir``; and
    ``best_checkpoint``, ``stopped_at`` with early stopping).
    """
    in_memory = not isinstance(dataset, (str, Path))
    specs = [_reward_spec(r) for r in ([reward_functions] if isinstance(reward_functions, str) else reward_functions)]
    cfg = validate_config({
        "model": {"name": model_name, "lora": lora}, "recipe": algorithm, "rewards": specs, "tools": list(tools),
        "data": {"source": "arithmetic" if in_memory else str(dataset), "test_size": test_size, "seed": seed,
                 **_given(params=dataset_options, level=level, curriculum=curriculum)},
        "compile": {"kernels": "auto" if use_mojo else "torch", **compile_options},
        "train": {"steps": steps, "batch_size": batch_size, "eval_every": eval_every, "run_dir": run_dir,
                  "seed": seed, **_given(early_stopping=early_stopping)},
    }, where="train_rlhf")
    return train_from_config(cfg, rows=dataset if in_memory else None)


def _given(**kwargs: Any) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if v is not None}


def _reward_spec(r: Any) -> dict[str, Any]:
    if isinstance(r, str):
        return {"name": r}
    if isinstance(r, dict):
        return r
    if isinstance(r, (tuple, list)) and 1 <= len(r) <= 3:
        return dict(zip(("name", "weight", "params"), r))
    raise ConfigError(f"reward_functions entry {r!r}: accepted: a name, 'module:function', (name, weight[, params]) "
                      f"or a dict with name/weight/params")
