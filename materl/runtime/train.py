"""``ml.train``: the loop around a compiled algorithm — data, LR schedule, evaluation,
checkpoints (atomic, resumable bit-identically on CPU), logging.

    step = ml.compile(recipe, policy=policy, ref_policy=ref, group_size=4, lr=1e-5)
    ml.train(step, rows, steps=50, batch_size=4, eval_dataset=held_out, eval_every=10,
             save_every=10, run_dir="runs/demo")
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch

from materl.errors import ConfigError
from materl.runtime.build import build_from_config
from materl import compute
from materl.distributed.launch import rollout_side
from materl.distributed.pipeline import Pipeline
from materl.runtime.checkpoint import (BEST, CHECKPOINTS, best_checkpoint, load_checkpoint, load_tensors,
                                       mark_best, restore, save_checkpoint)
from materl.runtime.config import config_to_dict, validate_config
from materl.runtime.curriculum import Curriculum, CurriculumSampler, Knobbed
from materl.runtime.data import Sampler, load_rows
from materl.runtime.early_stop import EarlyStopping
from materl.runtime.prompts import prepare_rows
from materl.runtime.evaluate import evaluate_async
from materl.runtime import signals
from materl.runtime.logging import RunLogger, format_episode, wandb_login_problem


def lr_lambda(schedule: str, *, steps: int, warmup_steps: int):
    if schedule not in ("constant", "linear", "cosine"):
        raise ConfigError(f"lr_schedule={schedule!r}; accepted: constant, linear, cosine")

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, steps - warmup_steps))
        return 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def train(compiled, dataset: Any, *, steps: int, batch_size: int = 8, eval_dataset: Any = None,
          eval_every: int = 0, save_every: int = 0, keep_last: int = 3, run_dir: str | Path = "runs/materl",
          resume: str | Path | None = None, resume_fallback: bool = True, lr_schedule: str = "constant", warmup_steps: int = 0,
          seed: int = 0, shuffle: bool = True, progress: bool = True, samples_every: int = 0,
          tensorboard: bool | None = None, wandb: bool = False, mlflow: bool = False, config: dict | None = None,
          on_step=None, workers: int = 0, ray_address: str | None = None, weight_transport: str = "object_store",
          learner_ranks: int = 1, learner_strategy: str = "ddp", max_prompt_tokens: int | None = None,
          truncation: str = "error", curriculum: Curriculum | None = None,
          early_stopping: EarlyStopping | None = None) -> dict[str, Any]:
    """Train for ``steps`` steps of ``batch_size`` prompts; returns a summary (``train_result``)
    with the per-step history, the last step's metrics, evaluations and the last checkpoint path
    (and ``best_checkpoint``, ``stopped_at`` with early stopping). Every record has metrics.jsonl's
    keys: ``history`` the steps' metrics, ``final`` the last one's, ``evals`` ``{"step": 0,
    "eval/accuracy": ..., "eval/reward": ...}``.

    Seeds torch, Python's ``random`` and numpy's global RNG with ``seed`` (reward code that uses
    any of them reproduces). A step whose episodes fail too often raises ``StepFailedError``
    (compile option ``max_failed_fraction``): nothing is saved for it, so the last checkpoint
    stays the last good one. A step that tool infrastructure failures left nothing to learn from
    (compile options ``infra_failures="mask"``, ``max_skipped_steps``) makes no update but is
    counted like any other: logged (``infra_failures/update_skipped`` = 1), the LR schedule
    advances, a checkpoint falls due as usual. ``progress``: a bar over steps, and one over each
    step's episodes and each evaluation's. ``wandb``/``mlflow``: also send every metric there
    (ConfigError if the package is not installed).

    Steps run through ``materl.distributed.pipeline.Pipeline``: with the compile option
    ``max_staleness=S > 0`` the rollouts of the next S batches run while the learner trains (the
    asynchronous pipeline); with S = 0 each step is ``compiled.run`` on its batch. ``workers``:
    0 samples in this process; N >= 1 in N Ray actors (``ray_address``: an existing cluster,
    default a local one; ``weight_transport``: ``object_store`` or ``disk``). ``learner_ranks``:
    1 learns in this process; R >= 2 on R data-parallel learner ranks as Ray actors
    (``learner_strategy``: ``ddp`` or ``fsdp2``; see ``materl.distributed.ranks``). A rank that
    dies stops the run with ``LearnerRankError``; the last checkpoint is intact.

    Every row of ``dataset`` and ``eval_dataset`` is checked before anything runs
    (``materl.runtime.prompts.prepare_rows``): its prompt, the columns the step's rewards read,
    and the prompt's length in tokens against the model's context less ``max_new_tokens`` (and
    ``max_prompt_tokens``); an over-long prompt is a ``DataError`` naming the row, or cut with
    ``truncation="left"`` (keep the end) or ``"right"``.

    ``curriculum`` (``materl.runtime.curriculum``): ``dataset`` is then a dataset that declares
    difficulty knobs (a ``ReasoningGymTask``), drawn at a level the running pass rate moves;
    ``curriculum/*`` metrics per step, its state in checkpoints. ``early_stopping``
    (``materl.runtime.early_stop``, needs ``eval_every``): stop when the evaluation metric has not
    improved for ``patience`` evaluations; the best step is checkpointed and named
    ``checkpoints/best`` (``best_checkpoint`` and ``stopped_at`` in the summary).

    ``resume``: a checkpoint folder or a run dir (its latest). Every file is checked against the
    checkpoint's manifest first; a damaged latest of a run dir is skipped with a warning naming
    the file, for the newest intact one (``resume_fallback=False``: CheckpointError instead).
    SIGINT/SIGTERM under ``materl train`` (``materl.runtime.signals``) stop the run after the
    compute item in flight, a save in progress completes first."""
    if steps < 1 or batch_size < 1:
        raise ConfigError(f"train: steps and batch_size must be >= 1, got steps={steps}, batch_size={batch_size}")
    run = _Run(compiled, Path(run_dir), steps=steps, keep_last=keep_last, config=config)
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    fit = {"max_prompt_tokens": max_prompt_tokens, "truncation": truncation}
    if early_stopping is not None:
        if not (eval_every and eval_dataset is not None):
            given = "given" if eval_dataset is not None else None
            raise ConfigError(f"early_stopping ({early_stopping.metric}) needs evaluations: set eval_every >= 1 and "
                              f"an eval_dataset (got eval_every={eval_every}, eval_dataset={given})")
        if not resume:
            (Path(run_dir) / CHECKPOINTS / BEST).unlink(missing_ok=True)  # a former run's best is not this one's
    sampler = _sampler(compiled, dataset, curriculum, batch_size=batch_size, seed=seed, shuffle=shuffle, fit=fit)
    eval_rows = prepare_rows(compiled, eval_dataset, where="eval_dataset", **fit) if eval_dataset is not None else None
    run.schedulers = {name: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(lr_schedule, steps=steps,
                                                                              warmup_steps=warmup_steps))
                      for name, opt in compiled.optimizers.items()}
    ray_before = _ray_running()
    store, rollout_workers = rollout_side(compiled, workers=workers, ray_address=ray_address,
                                          transport=weight_transport, folder=str(Path(run_dir) / "versions"))
    signals.rearm()  # ray.init installs a SIGTERM handler of its own
    if resume:
        ckpt = load_checkpoint(resume, fallback=resume_fallback)
        restore(ckpt, agents=compiled.agents, optimizers=compiled.optimizers, schedulers=run.schedulers)
        sampler.load_state_dict(ckpt.data_state["sampler"])
        if early_stopping is not None and "early_stopping" in ckpt.data_state:
            early_stopping.load_state_dict(ckpt.data_state["early_stopping"])
        run.start = int(ckpt.step)
        compiled.restore(run.start)
        restore_versions(store, load_tensors(ckpt, VERSIONS))
    run.logger = RunLogger(run_dir, progress=progress, total_steps=steps, tensorboard=tensorboard, wandb=wandb,
                           mlflow=mlflow, config=config)
    run.eval_rows = eval_rows
    run.eval_every, run.save_every, run.samples_every, run.on_step = eval_every, save_every, samples_every, on_step
    run.sampler, run.early_stopping = sampler, early_stopping
    states: dict[int, dict] = {}  # batch index -> data position before it

    def next_batch(k: int) -> list[dict]:
        states[k] = sampler.state_dict()  # the data position before batch k (a checkpoint after k - 1 resumes here)
        return sampler.next_batch()

    def data_position(k: int) -> dict:
        """The sampler state before batch ``k``: recorded if the producer already drew it, else now
        (a curriculum adds the outcomes recorded since, which that batch did not see)."""
        before = states.pop(k) if k in states else sampler.state_dict()
        return sampler.checkpoint_state(before, k) if curriculum is not None else before

    interrupted = False
    try:  # the ranks start from the agents and optimizers as they are now (restored, on resume)
        run.ranks = learner_side(compiled, learner_ranks, strategy=learner_strategy, ray_address=ray_address)
        compiled.learn_on(run.ranks)
        signals.rearm()
        pipeline = Pipeline(compiled, rollout_workers, store, next_batch=next_batch,
                            max_staleness=compiled.options.max_staleness, deterministic=compiled.options.deterministic,
                            progress=lambda k, total: run.logger.step_bar(k + 1, total),
                            learner=None if curriculum is None else _Observed(compiled, sampler.observe, run.start))
        compiled.call_blocking(run.loop, pipeline, data_position)
    except KeyboardInterrupt:  # SIGINT/SIGTERM (materl.runtime.signals): stop now, keep the last checkpoint
        interrupted = True
        raise
    finally:
        run.logger.close(plot=not interrupted)
        if run.ranks is not None:
            compiled.learn_on(None)
            run.ranks.shutdown()
        compiled.call_blocking(_close_workers, rollout_workers)  # in process too: the services it started
        if not ray_before and _ray_running():
            import ray

            ray.shutdown()  # the local cluster (or the connection) this call started
    stopped = {"best_checkpoint": _best(run, early_stopping), "stopped_at": run.stopped_at} if early_stopping else {}
    return {**train_result(run.history, run.evals, run.last_ckpt, run_dir), **stopped}


def _sampler(compiled, dataset: Any, curriculum: Curriculum | None, *, batch_size: int, seed: int, shuffle: bool,
             fit: dict) -> Sampler | CurriculumSampler:
    """Batches over ``dataset``'s checked rows, or drawn by ``curriculum`` from a Knobbed dataset."""
    if curriculum is not None:
        return CurriculumSampler(dataset, curriculum, batch_size=batch_size, seed=seed,
                                 max_staleness=compiled.options.max_staleness,
                                 prepare=lambda rows, where: prepare_rows(compiled, rows, where=where, **fit))
    if isinstance(dataset, Knobbed) and not isinstance(dataset, (list, tuple)):
        raise ConfigError(f"{dataset!r} is a dataset with difficulty knobs, drawn from by a curriculum: pass "
                          f"curriculum=ml.Curriculum(...), or rows (e.g. task.split(256, 32)[0], task.rows(256))")
    return Sampler(prepare_rows(compiled, dataset, **fit), batch_size=batch_size, seed=seed, shuffle=shuffle)


def _best(run: _Run, early_stopping: EarlyStopping | None) -> str | None:
    """The best checkpoint's folder (this call's, or a resumed run's earlier one)."""
    best = run.best_ckpt or (best_checkpoint(run.run_dir) if early_stopping is not None else None)
    return str(best) if best else None


class _Observed:
    """The learner, with ``observe(step, episodes)`` called before each step learns (a
    curriculum's outcomes are then recorded before the next batch may be drawn)."""

    def __init__(self, learner, observe, start: int):
        self.learner, self.observe, self.step = learner, observe, start

    async def learn(self, episodes, **kwargs):
        self.observe(self.step, episodes)
        self.step += 1
        return await self.learner.learn(episodes, **kwargs)


class _StopEarly(Exception):
    """Raised by a step's bookkeeping when early stopping's patience ran out (after its save)."""


def train_result(history: list[dict], evals: list[dict], checkpoint: Any, run_dir: Any) -> dict[str, Any]:
    """What ``ml.train``, ``ml.train_rlhf`` and ``materl train`` return, one shape for all:
    ``history`` (every step's metrics), ``final`` (the last step's, without per-node times),
    ``evals``, ``checkpoint`` (the last saved, or None) and ``run_dir``."""
    last = history[-1] if history else {}
    return {"history": history, "final": {k: v for k, v in last.items() if not k.startswith("time/node")},
            "evals": evals, "checkpoint": str(checkpoint) if checkpoint else None, "run_dir": str(run_dir)}


class _Run:
    """One ``ml.train`` call's bookkeeping around the pipeline's steps."""

    def __init__(self, compiled, run_dir: Path, *, steps: int, keep_last: int, config: dict | None):
        self.compiled, self.run_dir, self.steps, self.keep_last, self.config = compiled, run_dir, steps, keep_last, config
        self.start, self.history, self.evals, self.last_ckpt = 0, [], [], None
        self.best_ckpt, self.stopped_at, self.early_stopping, self.sampler = None, None, None, None
        self.schedulers: dict = {}
        self.ranks = None  # a RankedLearner when the learner runs on ranks

    async def loop(self, pipeline: Pipeline, data_position) -> None:
        if self.eval_every and self.start == 0:
            if await self.evaluate(0):
                await self.save(0, {}, pipeline, data_position(0), best=True)
        self._t0 = time.perf_counter()
        self._lrs = {self.start: self._lr()}
        try:
            await pipeline.run(self.start, self.steps, lambda k, metrics: self.after_step(k, metrics, pipeline,
                                                                                          data_position))
        except _StopEarly:
            return
        if self.eval_every and self.steps % self.eval_every and await self.evaluate(self.steps):
            self._mark_best(self.steps)  # the last step is always saved

    async def after_step(self, k: int, metrics: dict, pipeline: Pipeline, data_position) -> None:
        """Step ``k``'s bookkeeping: LR schedule, logs, samples, evaluation, checkpoint."""
        step = k + 1
        self.logger.end_step_bar(step)
        if isinstance(self.sampler, CurriculumSampler):
            metrics.update(self.sampler.metrics(k))
        with warnings.catch_warnings():  # with learner ranks, or on a skipped step, the optimizers did not step
            if self.ranks is not None or metrics.get("infra_failures/update_skipped"):
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            for s in self.schedulers.values():
                s.step()
        self._lrs[step] = self._lr()
        metrics["lr"] = self._lrs.pop(k)  # what this step trained with
        metrics["time/wall"], self._t0 = time.perf_counter() - self._t0, time.perf_counter()
        metrics["time/step"] = metrics["time/wall"]  # wall time per step of the run (rollouts overlap it)
        metrics["tokens_per_s"] = metrics["tokens"] / metrics["time/wall"]
        self.history.append({"step": step, **metrics})
        self.logger.log(step, metrics)
        self._samples(step)
        if self.on_step is not None:
            self.on_step(step, metrics)
        improved = bool(self.eval_every and step % self.eval_every == 0 and await self.evaluate(step))
        stop = self.early_stopping is not None and self.early_stopping.should_stop
        if (self.save_every and step % self.save_every == 0) or step == self.steps or improved or stop:
            await self.save(step, metrics, pipeline, data_position(step), best=improved)
        if stop:
            self.stopped_at = step
            self.logger.log(step, {"early_stopping/stopped": 1.0})
            raise _StopEarly(step)

    def _lr(self) -> float:
        return next(iter(self.schedulers.values())).get_last_lr()[0] if self.schedulers else 0.0

    def _samples(self, step: int) -> None:
        if self.samples_every and step % self.samples_every == 0:
            tok = next(iter(self.compiled.agents.values())).tokenizer
            self.logger.log_samples(step, [format_episode(self.compiled.episode_rollout(e), tok,
                                                          metrics=_reward_terms(e), notes=e.notes)
                                           for e in self.compiled.last_episodes[:4]])

    async def evaluate(self, step: int) -> bool:
        """Evaluate at ``step``; True when early stopping's metric improved on its best."""
        if self.eval_rows is None:
            return False
        with self.logger.episode_bar(len(self.eval_rows), f"eval @ step {step}") as tick:
            result = await evaluate_async(self.compiled, self.eval_rows, on_episode=tick)
        record = {f"eval/{k}": v for k, v in result.items() if isinstance(v, (int, float))}
        self.evals.append({"step": step, **record})  # the keys metrics.jsonl has
        self.logger.log(step, record)
        return self.early_stopping is not None and self.early_stopping.update(step, record)

    def _mark_best(self, step: int) -> None:
        self.best_ckpt = mark_best(self.run_dir, step)

    async def save(self, step: int, metrics: dict, pipeline: Pipeline, sampler_state: dict | None, *,
                   best: bool = False) -> None:
        """A checkpoint after ``step``: weights, optimizers, schedulers, the data position of the
        next batch, and the policy versions the next batches may still sample from."""
        versions = {f"v{v}/{k}": t for v in pipeline.needed_versions(step) if v < step
                    for k, t in pipeline.store.get(v).items()}
        c = self.compiled
        if self.ranks is not None:
            await anyio.to_thread.run_sync(self.ranks.pull_state)  # the ranks' optimizer states
        self.last_ckpt = await compute.acall(
            save_checkpoint, self.run_dir, step, agents=c.agents, optimizers=c.optimizers, schedulers=self.schedulers,
            data_state=self._data_state(sampler_state), config=self.config, metrics=metrics, keep_last=self.keep_last,
            tensors={VERSIONS: versions} if versions else None)
        if best:
            self._mark_best(step)

    def _data_state(self, sampler_state: dict | None) -> dict:
        state = {"sampler": sampler_state}
        if self.early_stopping is not None:
            state["early_stopping"] = self.early_stopping.state_dict()
        return state


VERSIONS = "policy_versions"  # checkpoint tensors: the recent versions an asynchronous run still needs


def restore_versions(store, tensors: dict) -> None:
    """Publish the versions a checkpoint kept (``v<version>/<agent>/<parameter>``) into ``store``."""
    by_version: dict[int, dict] = {}
    for key, value in tensors.items():
        v, _, rest = key.partition("/")
        by_version.setdefault(int(v[1:]), {})[rest] = value
    for v, state in sorted(by_version.items()):
        store.publish(v, state)


def learner_side(compiled, ranks: int, *, strategy: str, ray_address: str | None):
    """None (``compiled`` learns in this process) or a ``RankedLearner`` on ``ranks`` Ray actors,
    started from ``compiled``'s weights and optimizer states (restored ones on resume)."""
    if not isinstance(ranks, int) or ranks < 1:
        raise ConfigError(f"learner_ranks must be an int >= 1, got {ranks!r}")
    if ranks == 1:
        return None
    from materl.distributed.ranks import RankedLearner
    from materl.distributed.ray_group import require_ray
    from materl.distributed.ray_workers import connect

    require_ray()  # ExtraNotInstalledError naming the extra, before anything starts
    connect(ray_address, num_cpus=max(ranks + 2, os.cpu_count() or 1))  # no-op when the workers connected
    return RankedLearner(compiled, ranks, strategy=strategy)


def _ray_running() -> bool:
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


async def _close_workers(workers) -> None:
    for w in workers:
        await w.aclose()


def _reward_terms(episode) -> dict[str, float]:
    """An episode's reward terms (``reward/<term>``) and the total it was trained on, and its
    judges' calls (``judge/<node>/calls``)."""
    return {k: v for k, v in episode.metrics.items() if k.startswith(("reward/", "judge/"))}


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
    t = cfg.train
    resume = str(Path(t.run_dir)) if t.resume is True else (t.resume or None)
    try:
        result = train(compiled, train_rows, steps=t.steps, batch_size=t.batch_size,
                       eval_dataset=(test_rows[: t.eval_size] if t.eval_size else test_rows) or None,
                       eval_every=t.eval_every, save_every=t.save_every, keep_last=t.keep_last, run_dir=t.run_dir,
                       resume=resume, resume_fallback=t.resume_fallback, lr_schedule=t.lr_schedule, warmup_steps=t.warmup_steps, seed=t.seed,
                       progress=cfg.logging.progress, samples_every=cfg.logging.samples_every,
                       tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb, mlflow=cfg.logging.mlflow,
                       config=config_to_dict(cfg), workers=cfg.distributed.workers,
                       ray_address=cfg.distributed.ray_address, weight_transport=cfg.distributed.weight_transport,
                       learner_ranks=cfg.distributed.learner_ranks, learner_strategy=cfg.distributed.learner_strategy,
                       max_prompt_tokens=cfg.data.max_prompt_tokens, truncation=cfg.data.truncation,
                       curriculum=curriculum, early_stopping=stopping)
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
