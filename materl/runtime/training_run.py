"""One training run's bookkeeping (``TrainingRun``): the data it draws, the LR schedules,
evaluations, checkpoints, logs and early stopping around the pipeline's steps, and the workers,
learner ranks and Ray cluster it starts and stops. ``ml.train`` (``materl.runtime.train``) is
the entry point; see docs/concepts.md's glossary for "run" and "step"."""

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

from materl import compute
from materl.distributed.pipeline import Pipeline
from materl.errors import ConfigError
from materl.runtime import signals
from materl.runtime.checkpoint import (BEST, CHECKPOINTS, best_checkpoint, load_checkpoint, load_tensors,
                                       mark_best, restore, save_checkpoint)
from materl.runtime.curriculum import Curriculum, CurriculumSampler, Knobbed
from materl.runtime.data import Sampler
from materl.runtime.early_stop import EarlyStopping
from materl.runtime.evaluate import evaluate_async
from materl.runtime.logging import RunLogger, format_episode
from materl.runtime.prompts import prepare_rows
from materl.runtime.train_settings import TrainSettings

VERSIONS = "policy_versions"  # checkpoint tensors: the recent versions an asynchronous run still needs


class TrainingRun:
    """One ``ml.train`` call: set up (``prepare``, ``resume``), stepped by the pipeline
    (``loop``), closed (``close``), summarised (``result``)."""

    def __init__(self, compiled, settings: TrainSettings, *, config: dict | None, on_step,
                 early_stopping: EarlyStopping | None):
        t = settings.train
        if t.steps < 1 or t.batch_size < 1:
            raise ConfigError(f"train: steps and batch_size must be >= 1, got steps={t.steps}, "
                              f"batch_size={t.batch_size}")
        self.compiled, self.settings, self.config, self.on_step = compiled, settings, config, on_step
        self.run_dir, self.steps, self.keep_last = Path(t.run_dir), t.steps, t.keep_last
        self.eval_every, self.save_every = t.eval_every, t.save_every
        self.samples_every, self.early_stopping = settings.logging.samples_every, early_stopping
        self.start, self.history, self.evals, self.last_ckpt = 0, [], [], None
        self.best_ckpt, self.stopped_at, self.sampler, self.eval_rows = None, None, None, None
        self.schedulers: dict = {}
        self.ranks = None  # a RankedLearner when the learner runs on ranks
        self.logger: RunLogger | None = None
        self._states: dict[int, dict] = {}  # batch index -> data position before it

    def prepare(self, dataset: Any, eval_dataset: Any, curriculum: Curriculum | None) -> None:
        """Seed the global RNGs, check the rows, build the sampler and the LR schedules."""
        t, data = self.settings.train, self.settings.data
        torch.manual_seed(t.seed)
        random.seed(t.seed)
        np.random.seed(t.seed)
        if self.early_stopping is not None:
            if not (self.eval_every and eval_dataset is not None):
                given = "given" if eval_dataset is not None else None
                raise ConfigError(f"early_stopping ({self.early_stopping.metric}) needs evaluations: set eval_every >= 1 "
                                  f"and an eval_dataset (got eval_every={self.eval_every}, eval_dataset={given})")
            if not t.resume:
                (self.run_dir / CHECKPOINTS / BEST).unlink(missing_ok=True)  # a former run's best is not this one's
        fit = {"max_prompt_tokens": data.max_prompt_tokens, "truncation": data.truncation}
        self.sampler = _sampler(self.compiled, dataset, curriculum, batch_size=t.batch_size, seed=t.seed,
                                shuffle=data.shuffle, fit=fit)
        if eval_dataset is not None:
            self.eval_rows = prepare_rows(self.compiled, eval_dataset, where="eval_dataset", **fit)
        self.schedulers = {name: torch.optim.lr_scheduler.LambdaLR(
            opt, lr_lambda(t.lr_schedule, steps=t.steps, warmup_steps=t.warmup_steps))
            for name, opt in self.compiled.optimizers.items()}

    def resume(self, store) -> None:
        """Restore weights, optimizers, schedules, data position and policy versions from
        ``train.resume`` (``True``: this run dir's latest checkpoint)."""
        t = self.settings.train
        ckpt = load_checkpoint(t.run_dir if t.resume is True else t.resume, fallback=t.resume_fallback)
        restore(ckpt, agents=self.compiled.agents, optimizers=self.compiled.optimizers, schedulers=self.schedulers)
        self.sampler.load_state_dict(ckpt.data_state["sampler"])
        if self.early_stopping is not None and "early_stopping" in ckpt.data_state:
            self.early_stopping.load_state_dict(ckpt.data_state["early_stopping"])
        self.start = int(ckpt.step)
        self.compiled.restore(self.start)
        restore_versions(store, load_tensors(ckpt, VERSIONS))

    def open_logger(self) -> None:
        log = self.settings.logging
        self.logger = RunLogger(self.run_dir, progress=log.progress, total_steps=self.steps,
                                tensorboard=log.tensorboard, wandb=log.wandb, mlflow=log.mlflow, config=self.config)

    def start_ranks(self) -> None:
        """The learner on data-parallel ranks when ``distributed.learner_ranks`` >= 2."""
        d = self.settings.distributed
        self.ranks = learner_side(self.compiled, d.learner_ranks, strategy=d.learner_strategy,
                                  ray_address=d.ray_address)
        self.compiled.learn_on(self.ranks)
        signals.rearm()

    def pipeline(self, rollout_workers, store, curriculum: Curriculum | None) -> Pipeline:
        c = self.compiled
        return Pipeline(c, rollout_workers, store, next_batch=self.next_batch,
                        max_staleness=c.options.max_staleness, deterministic=c.options.deterministic,
                        progress=lambda k, total: self.logger.step_bar(k + 1, total),
                        learner=None if curriculum is None else _Observed(c, self.sampler.observe, self.start))

    def next_batch(self, k: int) -> list[dict]:
        self._states[k] = self.sampler.state_dict()  # the data position before batch k (a checkpoint after k - 1 resumes here)
        return self.sampler.next_batch()

    def data_position(self, k: int) -> dict:
        """The sampler state before batch ``k``: recorded if the producer already drew it, else now
        (a curriculum adds the outcomes recorded since, which that batch did not see)."""
        before = self._states.pop(k) if k in self._states else self.sampler.state_dict()
        return self.sampler.checkpoint_state(before, k) if isinstance(self.sampler, CurriculumSampler) else before

    def close(self, rollout_workers, *, plot: bool, ray_before: bool) -> None:
        """Stop what the run started: the logger, the learner ranks, the rollout workers (in
        process too: the services they started) and a local Ray cluster it brought up."""
        if self.logger is not None:
            self.logger.close(plot=plot)
        if self.ranks is not None:
            self.compiled.learn_on(None)
            self.ranks.shutdown()
        self.compiled.call_blocking(_close_workers, rollout_workers)
        if not ray_before and ray_running():
            import ray

            ray.shutdown()  # the local cluster (or the connection) this call started

    def result(self) -> dict[str, Any]:
        """``train_result``'s summary, with ``best_checkpoint`` and ``stopped_at`` under early stopping."""
        summary = train_result(self.history, self.evals, self.last_ckpt, self.run_dir)
        if self.early_stopping is None:
            return summary
        best = self.best_ckpt or best_checkpoint(self.run_dir)  # this call's, or a resumed run's earlier one
        return {**summary, "best_checkpoint": str(best) if best else None, "stopped_at": self.stopped_at}

    async def loop(self, pipeline: Pipeline) -> None:
        if self.eval_every and self.start == 0:
            if await self.evaluate(0):
                await self.save(0, {}, pipeline, self.data_position(0), best=True)
            if self.early_stopping is not None and self.early_stopping.reached:  # the start already meets stop_at
                self.stopped_at = 0
                return
        self._t0 = time.perf_counter()
        self._lrs = {self.start: self._lr()}
        try:
            await pipeline.run(self.start, self.steps, lambda k, metrics: self.after_step(k, metrics, pipeline))
        except _StopEarly:
            return
        if self.eval_every and self.steps % self.eval_every and await self.evaluate(self.steps):
            self._mark_best(self.steps)  # the last step is always saved

    async def after_step(self, k: int, metrics: dict, pipeline: Pipeline) -> None:
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
            await self.save(step, metrics, pipeline, self.data_position(step), best=improved)
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


def restore_versions(store, tensors: dict) -> None:
    """Publish the versions a checkpoint kept (``v<version>/<agent>/<parameter>``) into ``store``."""
    by_version: dict[int, dict] = {}
    for key, value in tensors.items():
        v, _, rest = key.partition("/")
        by_version.setdefault(int(v[1:]), {})[rest] = value
    for v, state in sorted(by_version.items()):
        store.publish(v, state)


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


def ray_running() -> bool:
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


async def _close_workers(workers) -> None:
    for w in workers:
        await w.aclose()


def _reward_terms(episode) -> dict[str, float]:
    """An episode's reward terms (``reward/<term>``) and the total it was trained on, and its
    judges' calls (``judge/<node>/calls``)."""
    return {k: v for k, v in episode.metrics.items() if k.startswith(("reward/", "judge/"))}
