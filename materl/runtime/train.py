"""``ml.train``: the loop around a compiled algorithm — data, LR schedule, evaluation,
checkpoints (atomic, resumable bit-identically on CPU), logging.

    step = ml.compile(recipe, policy=policy, ref_policy=ref, group_size=4, lr=1e-5)
    ml.train(step, rows, steps=50, batch_size=4, eval_dataset=held_out, eval_every=10,
             save_every=10, run_dir="runs/demo")
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from materl.errors import ConfigError
from materl.runtime.build import build_from_config
from materl.runtime.checkpoint import load_checkpoint, restore, save_checkpoint
from materl.runtime.config import config_to_dict, validate_config
from materl.runtime.data import Sampler, load_rows, split_columns
from materl.runtime.evaluate import evaluate_compiled
from materl.runtime.logging import RunLogger, format_episode


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


def run_step(compiled, rows: list[dict], *, on_episode=None) -> dict[str, float]:
    inputs = [n.name for n in compiled.recipe.nodes if n.op == "input"]
    if inputs == ["prompts"]:
        prompts, columns = split_columns(rows)
        return compiled.run(prompts, on_episode=on_episode, **columns)
    return compiled.run(on_episode=on_episode, **{inputs[0]: rows})


def train(compiled, dataset: Any, *, steps: int, batch_size: int = 8, eval_dataset: Any = None,
          eval_every: int = 0, save_every: int = 0, keep_last: int = 3, run_dir: str | Path = "runs/materl",
          resume: str | Path | None = None, lr_schedule: str = "constant", warmup_steps: int = 0,
          seed: int = 0, shuffle: bool = True, progress: bool = True, samples_every: int = 0,
          tensorboard: bool | None = None, wandb: bool = False, mlflow: bool = False, config: dict | None = None,
          on_step=None) -> dict[str, Any]:
    """Train for ``steps`` steps of ``batch_size`` prompts; returns a summary with the per-step
    history, evaluations and the last checkpoint path.

    Seeds torch, Python's ``random`` and numpy's global RNG with ``seed`` (reward code that uses
    any of them reproduces). A step whose episodes fail too often raises ``StepFailedError``
    (compile option ``max_failed_fraction``): nothing is saved for it, so the last checkpoint
    stays the last good one. ``progress``: a bar over steps, and one over each step's episodes
    and each evaluation's. ``wandb``/``mlflow``: also send every metric there (ConfigError if
    the package is not installed)."""
    if steps < 1 or batch_size < 1:
        raise ConfigError(f"train: steps and batch_size must be >= 1, got steps={steps}, batch_size={batch_size}")
    run_dir = Path(run_dir)
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    sampler = Sampler(load_rows(dataset), batch_size=batch_size, seed=seed, shuffle=shuffle)
    eval_rows = load_rows(eval_dataset) if eval_dataset is not None else None
    schedulers = {name: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(lr_schedule, steps=steps,
                                                                          warmup_steps=warmup_steps))
                  for name, opt in compiled.optimizers.items()}
    start = 0
    if resume:
        ckpt = load_checkpoint(resume)
        restore(ckpt, agents=compiled.agents, optimizers=compiled.optimizers, schedulers=schedulers)
        sampler.load_state_dict(ckpt.data_state["sampler"])
        compiled.step_count = start = int(ckpt.step)
    logger = RunLogger(run_dir, progress=progress, total_steps=steps, tensorboard=tensorboard, wandb=wandb,
                       mlflow=mlflow, config=config)
    history, evals, last_ckpt = [], [], None

    def evaluate(step: int) -> None:
        if eval_rows is not None:
            with logger.episode_bar(len(eval_rows), f"eval @ step {step}") as tick:
                result = evaluate_compiled(compiled, eval_rows, on_episode=tick)
            evals.append({"step": step, **result})
            logger.log(step, {f"eval/{k}": v for k, v in result.items() if isinstance(v, (int, float))})

    try:
        if eval_every and start == 0:
            evaluate(0)
        for step in range(start + 1, steps + 1):
            t0 = time.perf_counter()
            batch = sampler.next_batch()
            lr = next(iter(schedulers.values())).get_last_lr()[0] if schedulers else 0.0  # what this step uses
            with logger.episode_bar(len(batch) * compiled.episodes_per_prompt, f"step {step}") as tick:
                metrics = run_step(compiled, batch, on_episode=tick)
            for s in schedulers.values():
                s.step()
            metrics["lr"] = lr
            metrics["time/wall"] = time.perf_counter() - t0
            history.append({"step": step, **metrics})
            logger.log(step, metrics)
            if samples_every and step % samples_every == 0:
                tok = next(iter(compiled.agents.values())).tokenizer
                logger.log_samples(step, [format_episode(compiled.episode_rollout(e), tok, metrics=_reward_terms(e))
                                          for e in compiled.last_episodes[:4]])
            if on_step is not None:
                on_step(step, metrics)
            if eval_every and step % eval_every == 0:
                evaluate(step)
            if (save_every and step % save_every == 0) or step == steps:
                last_ckpt = save_checkpoint(run_dir, step, agents=compiled.agents, optimizers=compiled.optimizers,
                                            schedulers=schedulers, data_state={"sampler": sampler.state_dict()},
                                            config=config, metrics=metrics, keep_last=keep_last)
        if eval_every and steps % eval_every:
            evaluate(steps)
    finally:
        logger.close()
    return {"history": history, "evals": evals, "checkpoint": str(last_ckpt) if last_ckpt else None,
            "run_dir": str(run_dir)}


def _reward_terms(episode) -> dict[str, float]:
    """An episode's reward terms (``reward/<term>``) and the total it was trained on."""
    return {k: v for k, v in episode.metrics.items() if k.startswith("reward/")}


def train_from_config(cfg, rows: Any = None) -> dict[str, Any]:
    """What ``materl train CONFIG.yaml`` runs; returns the final metrics and evaluations.
    ``rows``: in-memory data (a list of rows or a ``datasets.Dataset``) instead of ``cfg.data.source``;
    the first ``cfg.data.test_size`` rows are held out."""
    compiled, train_rows, test_rows = build_from_config(cfg, load_data=rows is None)
    if rows is not None:
        rows = load_rows(rows)
        test_rows, train_rows = rows[: cfg.data.test_size], rows[cfg.data.test_size:]
    t = cfg.train
    resume = str(Path(t.run_dir)) if t.resume is True else (t.resume or None)
    try:
        result = train(compiled, train_rows, steps=t.steps, batch_size=t.batch_size,
                       eval_dataset=(test_rows[: t.eval_size] if t.eval_size else test_rows) or None,
                       eval_every=t.eval_every, save_every=t.save_every, keep_last=t.keep_last, run_dir=t.run_dir,
                       resume=resume, lr_schedule=t.lr_schedule, warmup_steps=t.warmup_steps, seed=t.seed,
                       progress=cfg.logging.progress, samples_every=cfg.logging.samples_every,
                       tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb, mlflow=cfg.logging.mlflow,
                       config=config_to_dict(cfg))
    finally:
        compiled.close()
    last = result["history"][-1] if result["history"] else {}
    return {"final": {k: v for k, v in last.items() if not k.startswith("time/node")}, "evals": result["evals"],
            "checkpoint": result["checkpoint"], "run_dir": result["run_dir"]}


def train_rlhf(model_name: str = "smollm2-135m-instruct", *, algorithm: str = "grpo", dataset: Any = "arithmetic",
               reward_functions: Any = (), tools: Any = (), steps: int = 100, batch_size: int = 8,
               lora: dict | None = None, use_mojo: bool = True, test_size: int = 32, eval_every: int = 0,
               run_dir: str = "runs/materl", seed: int = 0, **compile_options: Any) -> dict[str, Any]:
    """Train in one call (TRL-style high-level API); the same validated path as ``materl train``.

        result = ml.train_rlhf("smollm2-135m-instruct", algorithm="grpo_tools", dataset="arithmetic",
                               tools=["python -m materl.tools.calculator"], steps=20, lr=3e-5)

    ``algorithm``: a built-in recipe (``materl recipes`` lists them). ``dataset``: ``"arithmetic"``
    (generated), a ``.jsonl`` file, a folder saved by ``datasets``, or rows in memory (a list of
    dicts or a ``datasets.Dataset``); the first ``test_size`` rows are held out for evaluation.
    ``reward_functions``: names (``"length"``), ``"module:function"`` strings, ``(name, weight)``
    pairs or ``{"name", "weight", "params"}`` dicts, summed; empty keeps the recipe's rewards.
    ``use_mojo``: Mojo kernels where available (else the torch ops). Other keywords are compile
    options (``lr=``, ``group_size=``, ``max_new_tokens=`` ...). Bad values fail before anything
    loads, naming the field (``compile.group_size``, ``recipe`` ...). Returns ``{"final",
    "evals", "checkpoint", "run_dir"}``.
    """
    in_memory = not isinstance(dataset, (str, Path))
    specs = [_reward_spec(r) for r in ([reward_functions] if isinstance(reward_functions, str) else reward_functions)]
    cfg = validate_config({
        "model": {"name": model_name, "lora": lora}, "recipe": algorithm, "rewards": specs, "tools": list(tools),
        "data": {"source": "arithmetic" if in_memory else str(dataset), "test_size": test_size, "seed": seed},
        "compile": {"kernels": "auto" if use_mojo else "torch", **compile_options},
        "train": {"steps": steps, "batch_size": batch_size, "eval_every": eval_every, "run_dir": run_dir,
                  "seed": seed},
    }, where="train_rlhf")
    return train_from_config(cfg, rows=dataset if in_memory else None)


def _reward_spec(r: Any) -> dict[str, Any]:
    if isinstance(r, str):
        return {"name": r}
    if isinstance(r, dict):
        return r
    if isinstance(r, (tuple, list)) and 1 <= len(r) <= 3:
        return dict(zip(("name", "weight", "params"), r))
    raise ConfigError(f"reward_functions entry {r!r}: accepted: a name, 'module:function', (name, weight[, params]) "
                      f"or a dict with name/weight/params")
