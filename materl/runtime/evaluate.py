"""Evaluation: greedy rollouts scored by rewards, with accuracy, reward components, tool-use
statistics and mean turns.

    ml.evaluate(agent, rows, rewards=["exact_match"], tools=toolbox)    # any agent
    evaluate_compiled(step, rows)                                       # a compiled recipe's rollout
"""

from __future__ import annotations

from typing import Any

import torch

import materl as ml
from materl.compiler.compiled import Compiled
from materl.compiler.options import CompileOptions
from materl.ops.rewards import Reward
from materl.errors import ConfigError
from materl.runtime.build import build_from_config
from materl.runtime.checkpoint import load_checkpoint, restore
from materl.runtime.config import TrainConfig, validate_config
from materl.runtime.config_yaml import apply_override
from materl.runtime.data import split_columns
from materl.runtime.prompts import prepare_rows

ACCURACY_COMPONENTS = ("answer", "exact_match", "math_answer", "reasoning_gym")


def summarize(compiled, episodes) -> dict[str, float]:
    ok = [e for e in episodes if e.error is None]
    out: dict[str, float] = {"episodes": float(len(episodes)), "failed": float(len(episodes) - len(ok))}
    comps = sorted({k for e in ok for k in e.metrics if k.startswith("reward/")})
    for k in comps:
        out[k] = float(torch.tensor([e.metrics.get(k, 0.0) for e in ok]).mean()) if ok else 0.0
    reward_nodes = [n for n in compiled.plan.order if compiled.plan.nodes[n].op == "rewards"]
    if reward_nodes and ok:
        out["reward"] = float(torch.tensor([float(torch.as_tensor(e.values[reward_nodes[0]]).sum()) for e in ok]).mean())
    acc = [k for k in comps if k.split("/", 1)[1] in ACCURACY_COMPONENTS]
    if acc and ok:
        out["accuracy"] = float(torch.tensor([float(e.metrics.get(acc[0], 0.0) > 0.5) for e in ok]).mean())
    rollouts = [r for r in (compiled.episode_rollout(e) for e in ok) if r is not None]
    if rollouts:
        calls = [len(r.tool_calls) for r in rollouts]
        results = [x for r in rollouts for x in r.tool_results]
        out["tool_calls"] = sum(calls) / len(rollouts)
        out["tool_call_rate"] = sum(c > 0 for c in calls) / len(rollouts)
        if results:  # undefined without tool calls (not 0: nothing failed)
            out["tool_success"] = sum(not x.is_error for x in results) / len(results)
        out["turns"] = sum(r.num_turns for r in rollouts) / len(rollouts)
        out["completion_tokens"] = sum(len(r.completion_ids) for r in rollouts) / len(rollouts)
    return out


def evaluate_compiled(compiled, rows: list[dict], *, on_episode=None) -> dict[str, float]:
    """Greedy, one episode per prompt, through the compiled recipe's rollout stage;
    ``on_episode(episode)`` as each finishes (a progress bar). Blocking; ``evaluate_async`` in
    the step's event loop."""
    return compiled.call_blocking(evaluate_async, compiled, rows, on_episode=on_episode)


async def evaluate_async(compiled, rows: list[dict], *, on_episode=None) -> dict[str, float]:
    prompts, columns = split_columns(rows)
    episodes = await compiled.rollout(prompts, group_size=1, greedy=True, on_episode=on_episode, **columns)
    return summarize(compiled, episodes)


def evaluate(agent, dataset: Any, rewards: list, *, tools=None, max_turns: int = 3, max_new_tokens: int = 64,
             system_prompt: str | None = None) -> dict[str, float]:
    """Score ``agent`` greedily on ``dataset`` (rows with 'prompt' and the columns the rewards
    read). ``rewards``: names, callables, ``(name, weight)`` pairs or ops ``Reward`` objects.
    With ``tools`` (a Toolbox), episodes are multi-turn with up to ``max_turns`` model turns."""
    terms = [_term(r) for r in rewards]

    @ml.recipe
    def evaluation(policy, prompts):
        if tools is None:
            rollout = ml.generate(policy, prompts, name="completions")
        else:
            step = ml.generate_step(policy, prompts, tools=tools, name="turn_1")
            for t in range(2, max_turns + 1):
                step = ml.generate_step(policy, step.history, ml.call_tools(step, tools=tools), tools=tools,
                                        name=f"turn_{t}")
            rollout = ml.structure_rollout(step, name="rollout")
        total = None
        for spec, weight, params in terms:
            term = ml.reward(spec, weight=weight, rollout=rollout, **params)
            total = term if total is None else total + term

    options = CompileOptions(group_size=1, max_new_tokens=max_new_tokens, max_turns=max_turns,
                             system_prompt=system_prompt)
    compiled = Compiled(evaluation, {"policy": agent}, options, rollout_only=True)
    try:
        return evaluate_compiled(compiled, prepare_rows(compiled, dataset))
    finally:
        compiled.close()


def _term(r) -> tuple[Any, float, dict]:

    if isinstance(r, Reward):
        return r.fn, r.weight, dict(r.params)
    if isinstance(r, tuple):
        return r[0], float(r[1]), dict(r[2]) if len(r) > 2 else {}
    return r, 1.0, {}


def checkpoint_config(checkpoint: str, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """The config a checkpoint was trained with (its ``config.yaml``; ``checkpoint`` a checkpoint
    folder or a run dir, its latest), with ``overrides`` applied: what ``materl eval --checkpoint
    RUN`` uses when no config file is given. ConfigError when the checkpoint has none (``ml.train``
    called without ``config=``)."""
    ckpt = load_checkpoint(checkpoint)
    if not isinstance(ckpt.config, dict):
        raise ConfigError(f"checkpoint {str(ckpt.path)!r} has no config.yaml (saved by ml.train without config=); "
                          f"give the config file: materl eval CONFIG.yaml --checkpoint {checkpoint}")
    data = dict(ckpt.config)
    for item in overrides:
        apply_override(data, item)
    return validate_config(data, where=str(ckpt.path / "config.yaml"))


def evaluate_from_config(cfg, checkpoint: str | None = None) -> dict[str, float]:
    """What ``materl eval CONFIG.yaml [--checkpoint PATH]`` runs: the held-out split, greedy, its
    rows checked as ``ml.train`` checks them (``data.max_prompt_tokens``, ``data.truncation``)."""
    compiled, _, test_rows = build_from_config(cfg)
    try:
        if checkpoint:
            restore(load_checkpoint(checkpoint), agents=compiled.agents, rng=False)
        if test_rows:
            test_rows = prepare_rows(compiled, test_rows, max_prompt_tokens=cfg.data.max_prompt_tokens,
                                     truncation=cfg.data.truncation)
        return evaluate_compiled(compiled, test_rows)
    finally:
        compiled.close()
