"""A run described by a config, built: its recipe (with user rewards and recipes resolved), its
agents, the compiled step, and the train / held-out rows. ``materl train`` and ``materl eval``
both start here.

    compiled, train_rows, test_rows = build_from_config(load_config("run.yaml"))
"""

from __future__ import annotations

from pathlib import Path

import materl as ml
from materl.compiler.compiled import Compiled
from materl.errors import ConfigError
from materl.runtime.checkpoint_meta import is_checkpoint
from materl.runtime.config import eval_level
from materl.runtime.export import agent_from_checkpoint
from materl.runtime.data import load_rows
from materl.runtime.reasoning_tasks import REWARD, is_task_source, task_from_source
from materl.runtime.resolve import import_symbol, is_dotted, resolve_recipe
from materl.runtime.tasks import arithmetic_split


def build_from_config(cfg, *, load_data: bool = True):
    """Agents, recipe and compiled step from a TrainConfig; returns (compiled, train_rows, test_rows)
    (empty row lists when not ``load_data``; under ``data.curriculum`` the train "rows" are the
    task itself, which ``ml.train`` draws from). A ``reasoning_gym:<task>`` source replaces the
    recipe's rewards with the task's scorer unless ``rewards`` are given. User code named ``module:attribute`` (the recipe,
    rewards) is found on sys.path, next to the config file or in the working directory."""
    options = cfg.compile_options()
    recipe = resolve_recipe(cfg.recipe, tools=cfg.tools, tool_timeout_s=options.tool_timeout_s,
                            search=cfg.search_dirs)
    if not cfg.rewards and is_task_source(cfg.data.source):  # the task's own scorer, unless rewards are given
        recipe = ml.replace(recipe, "rewards", lambda graph: ml.reward(REWARD, name=REWARD))
    if cfg.rewards:
        fns = [import_symbol(spec.name, search=cfg.search_dirs, what=f"rewards[{i}].name")
               if is_dotted(spec.name) else spec.name for i, spec in enumerate(cfg.rewards)]

        def rewards(graph):
            total = None
            for fn, spec in zip(fns, cfg.rewards):
                term = ml.reward(fn, weight=spec.weight, **spec.params)
                total = term if total is None else total + term
            return total

        recipe = ml.replace(recipe, "rewards", rewards)
    if cfg.teacher is not None and "teacher" not in recipe.params:
        recipe = ml.with_distillation(recipe, "teacher", 1.0 if cfg.teacher.weight is None else cfg.teacher.weight,
                                      discount=cfg.teacher.discount or 0.0)
    elif cfg.teacher is None and "teacher" in recipe.params:  # a user recipe (built-in ones are checked on load)
        raise ConfigError(f"recipe {cfg.recipe!r} distils from a teacher, but the config has no teacher section; add "
                          f"one, e.g. teacher: {{name: runs/calculator}} (a model name, an HF folder or a checkpoint)")
    if cfg.distributed.correction is not None:
        hparams = dict(cfg.distributed.correction)
        recipe = ml.with_off_policy_correction(recipe, hparams.pop("method"), **hparams)
    placed = dict(device=cfg.model.device, compute_dtype=cfg.model.dtype)
    agents = {"policy": ml.Agent(cfg.model.name, trainable=True, lora=cfg.model.lora, **placed)}
    if cfg.teacher is not None:
        agents["teacher"] = teacher_agent(cfg.teacher, **placed)
    if "ref_policy" in recipe.agents:
        agents["ref_policy"] = ml.Agent(cfg.ref_model.name or cfg.model.name, **placed)
    if "value_model" in recipe.agents:
        agents["value_model"] = ml.Agent(cfg.model.name, head="value", trainable=True, **placed)
    compiled = Compiled(recipe, agents, options)
    train_rows, test_rows = _data_from_config(cfg) if load_data else ([], [])
    return compiled, train_rows, test_rows


def teacher_agent(spec, *, device=None, compute_dtype=None) -> ml.Agent:
    """The frozen teacher of a config's ``teacher`` section (``TeacherSection``): a named model or
    HF folder, or a checkpoint's agent rebuilt and its weights loaded (``rebuild_agent``);
    ``device``/``compute_dtype``: the model section's, unless the teacher sets its own."""
    options = dict(device=spec.device or device, compute_dtype=spec.dtype or compute_dtype, engine=spec.engine,
                   engine_options=spec.engine_options, trainable=False)
    if not is_checkpoint(spec.name):
        return ml.Agent(spec.name, **options)
    return agent_from_checkpoint(spec.name, spec.agent, **options)


def _data_from_config(cfg) -> tuple[list, list]:
    """(train rows, held-out rows); under a curriculum, (the task, held-out rows at its eval level)."""
    d = cfg.data
    if is_task_source(d.source):
        task = task_from_source(d.source, options=d.params, level=d.level, seed=d.seed)
        test = task.rows(d.test_size, seed=d.seed + 1, level=eval_level(d, task)) if d.test_size else []
        if d.curriculum is not None:
            return task, test
        return task.rows(d.train_size or 256, exclude=frozenset(r["rg_entry"]["question"] for r in test)), test
    if d.source == "arithmetic":
        return arithmetic_split(d.train_size, d.test_size, seed=d.seed, **d.params)
    if Path(d.source).suffix in (".jsonl", ".json"):
        rows = load_rows(d.source)
    else:
        import datasets

        rows = load_rows(datasets.load_from_disk(d.source), where=d.source)
    test, train_rows = rows[: d.test_size], rows[d.test_size:]
    return (train_rows[: d.train_size] if d.train_size else train_rows), test
