"""Curriculum RL on a reasoning-gym task: SmolLM2-135M-Instruct, GRPO, the task's own scorer.

    python examples/reasoning_gym_curriculum.py                  # SmolLM2 on 2 CPU cores (minutes)
    python examples/reasoning_gym_curriculum.py --fixed-level 4  # the same budget at one fixed level
    python examples/reasoning_gym_curriculum.py --tools          # the same with the calculator tool (grpo_tools)
    python examples/reasoning_gym_curriculum.py --tools --require-tool  # a right answer counts only through the tool
    python examples/reasoning_gym_curriculum.py --tiny           # the tiny random model, 2 steps (CI)

The task (``basic_arithmetic`` by default, any name from ``reasoning_gym`` works) comes from
reasoning-gym's generators, offline and seeded; its difficulty knobs are the task's own
curriculum attributes (for basic_arithmetic: 2..6 terms and 1..4 digits, five levels). The
curriculum (``ml.Curriculum``) starts at level 0 and raises the level when the pass rate of the
last ``window`` episodes at that level reaches ``raise_above`` (lowers it below
``lower_below``). The reward is the task's ``score_answer`` on the text between the answer
tags (``reward/reasoning_gym``). Each prompt starts with one worked example of the task
(``shots=1``): without it SmolLM2 never writes the answer tags (0 of 32 held-out questions
scored at level 0, measured), with it 1 of 16 was answered right at level 0 before training. Held-out questions are drawn at the hardest level from another
seed and scored greedily before and after training.

``--require-tool`` (with ``--tools``): the task's score is trained on, and passes the
curriculum, only in an episode with a call that worked (``reward/reasoning_gym_via_tool``); the
plain score stays in the metrics at weight 0, and held-out accuracy is still the plain score.
Without it, the easy levels pay a right answer given from memory like one computed with the tool,
and one such episode in the first step can push the model off the tool format for good
(benchmarks/RESULTS.md, "24 steps and 64 held-out questions", seed 11).

Printed: one line per step (level, pass rate, reward), then held-out accuracy at the hardest
level before and after, as JSON on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "2")

import materl as ml  # noqa: E402
from materl.recipes import grpo  # noqa: E402
from materl.recipes.grpo_tools import grpo_tools_recipe  # noqa: E402
from materl.runtime.evaluate import evaluate_compiled  # noqa: E402
from materl.runtime.reasoning_tasks import reasoning_gym_score  # noqa: E402

TOOL_SYSTEM = ('Use the calculate tool: reply with <tool_call>{"name": "calculate", "arguments": '
               '{"expression": "..."}}</tool_call>, then give its result between <answer> and </answer>.')


def _tool_example(question: str, expression: str, result: str) -> list[dict]:
    call = json.dumps({"name": "calculate", "arguments": {"expression": expression}})
    return [{"role": "user", "content": question}, {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
            {"role": "tool", "content": result}, {"role": "assistant", "content": f"<answer>{result}</answer>"}]


VIA_TOOL = "reasoning_gym_via_tool"


def reasoning_gym_via_tool(*, completions, rg_entry, rollouts, **_) -> list[float]:
    """reasoning-gym's score of the answer (``reward/reasoning_gym``), or 0 when the episode has no
    tool result that is not an error: a right answer counts only if a call worked."""
    scores = reasoning_gym_score(completions=completions, rg_entry=rg_entry)
    return [s if any(not res.is_error for res in r.tool_results) else 0.0 for s, r in zip(scores, rollouts)]


class ToolPrompted:
    """A knobbed task whose questions follow two worked tool calls (``calculate``) instead of the
    task's own worked answers and instruction; levels, scorer and rows are the task's (a
    ``Knobbed`` dataset). ``require_tool``: an episode passes (``score_key``) only on
    ``reward/reasoning_gym_via_tool``, the score counted through a call that worked."""

    def __init__(self, task: ml.ReasoningGymTask, *, require_tool: bool = False):
        if task.shots or task.instruction:
            raise ValueError("ToolPrompted replaces the worked examples and the instruction (the system prompt "
                             "asks for the call and the tags): build the task with shots=0, instruction=None")
        self.task, self.levels = task, task.levels
        self.score_key = f"reward/{VIA_TOOL}" if require_tool else task.score_key
        self.example = (_tool_example("Calculate -( 12 * 7 ) + 5.", "-( 12 * 7 ) + 5", "-79")
                        + _tool_example("Calculate ( 8 - 23 ) * -4 + 615.", "( 8 - 23 ) * -4 + 615", "675"))

    def rows(self, n: int, **kw) -> list[dict]:
        return [self._prompted(r) for r in self.task.rows(n, **kw)]

    def rows_at(self, level: int, n: int, *, seed: int) -> list[dict]:
        return [self._prompted(r) for r in self.task.rows_at(level, n, seed=seed)]

    def _prompted(self, row: dict) -> dict:
        return {**row, "prompt": [*self.example, {"role": "user", "content": row["prompt"]}]}

    def __repr__(self) -> str:
        return f"ToolPrompted({self.task!r})"


def build(task: ml.ReasoningGymTask, *, model: str, group_size: int, max_new_tokens: int, lr: float, seed: int,
          tools: bool = False, require_tool: bool = False, teacher: str | None = None, distill_weight: float = 1.0):
    """The compiled step; ``teacher`` (a model name or HF folder): on-policy distillation from it
    added to the recipe (``ml.with_distillation``, ``distill_weight``). ``require_tool`` (with
    ``tools``): the task's score is trained on only through a call that worked (module docstring)."""
    if require_tool and not tools:
        raise ValueError("require_tool needs tools=True: without the calculator no call can work")
    if not tools:
        recipe = ml.replace(grpo, "rewards", lambda g: task.reward())
        agents = {"policy": ml.Agent(model, trainable=True), "ref_policy": ml.Agent(model)}
        options = dict(temperature=1.0)
    else:
        recipe = grpo_tools_recipe(ml.mcp_tools("python -m materl.tools.calculator"), turns=2, show_schemas=False,
                                   format_as_step=False, format_needs_success=True)
        score = (task.reward(weight=0.0) + ml.reward(reasoning_gym_via_tool, name=VIA_TOOL) if require_tool
                 else task.reward())
        recipe = ml.replace(recipe, "rewards", lambda g: score + ml.reward("tool_success", weight=0.2))
        agents = {"policy": ml.Agent(model, trainable=True)}
        options = dict(temperature=0.7, system_prompt=TOOL_SYSTEM, max_turns=2)
    if teacher is not None:
        recipe, agents["teacher"] = ml.with_distillation(recipe, "teacher", distill_weight), ml.Agent(teacher)
    return ml.compile(recipe, **agents, group_size=group_size, max_new_tokens=max_new_tokens, lr=lr, seed=seed,
                      **options)


def run(*, task_name: str = "basic_arithmetic", model: str = "smollm2-135m-instruct", steps: int = 30,
        batch_size: int = 4, group_size: int = 4, max_new_tokens: int = 24, lr: float = 2e-5, seed: int = 0,
        fixed_level: int | None = None, test_size: int = 32, curriculum: ml.Curriculum | None = None,
        run_dir: str = "runs/reasoning_gym_curriculum", progress: bool = False, shots: int = 1,
        tools: bool = False, require_tool: bool = False) -> dict:
    """Train with the curriculum (or at ``fixed_level``) and return held-out accuracy at the
    hardest level before and after, with the per-step history."""
    task = (ml.ReasoningGymTask(task_name, seed=seed, shots=0, instruction=None) if tools
            else ml.ReasoningGymTask(task_name, seed=seed, shots=shots))
    step = build(task, model=model, group_size=group_size, max_new_tokens=max_new_tokens, lr=lr, seed=seed,
                 tools=tools, require_tool=require_tool)
    if tools:
        task = ToolPrompted(task, require_tool=require_tool)
    hardest = task.levels - 1
    held_out = task.rows(test_size, seed=seed + 10_000, level=hardest)
    try:
        before = evaluate_compiled(step, held_out)
        if fixed_level is None:
            result = ml.train(step, task, steps=steps, batch_size=batch_size, seed=seed, run_dir=run_dir,
                              progress=progress, tensorboard=False, on_step=_print_step,
                              curriculum=curriculum or ml.Curriculum(raise_above=0.5, lower_below=0.1, window=16))
        else:
            rows = task.rows_at(fixed_level, 256, seed=seed + fixed_level)
            result = ml.train(step, rows, steps=steps, batch_size=batch_size, seed=seed, run_dir=run_dir,
                              progress=progress, tensorboard=False, on_step=_print_step)
        after = evaluate_compiled(step, held_out)
    finally:
        step.close()
    tokens = sum(h["tokens"] for h in result["history"])
    return {"task": task_name, "hardest_level": hardest, "fixed_level": fixed_level, "steps": steps,
            "trained_tokens": tokens, "accuracy_before": before.get("accuracy", 0.0),
            "accuracy_after": after.get("accuracy", 0.0), "history": result["history"]}


def _print_step(step: int, m: dict) -> None:
    level = f"level {m['curriculum/level']:.0f} pass {m['curriculum/pass_rate']:.2f} " if "curriculum/level" in m else ""
    print(f"step {step - 1} {level}reward {m['reward']:.3f} tokens {m['tokens']:.0f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="basic_arithmetic")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fixed-level", type=int, default=None, help="train at this level instead of the curriculum")
    p.add_argument("--run-dir", default="runs/reasoning_gym_curriculum")
    p.add_argument("--tools", action="store_true", help="the calculator tool and the multi-turn tool recipe")
    p.add_argument("--require-tool", action="store_true",
                   help="with --tools: a right answer is rewarded, and passes the curriculum, only through a call "
                        "that worked")
    p.add_argument("--tiny", action="store_true", help="the tiny random model, 2 steps (a smoke run for CI)")
    args = p.parse_args(argv)
    if args.require_tool and not args.tools:
        p.error("--require-tool needs --tools")
    kw = dict(task_name=args.task, steps=args.steps, seed=args.seed, fixed_level=args.fixed_level,
              run_dir=args.run_dir, tools=args.tools, require_tool=args.require_tool)
    if args.tiny:
        kw.update(model="tiny-random", steps=2, batch_size=2, group_size=2, max_new_tokens=6, lr=1e-3, test_size=4,
                  curriculum=ml.Curriculum(raise_above=0.5, lower_below=0.1, window=2, pool_size=16))
    result = run(**kw)
    print(json.dumps({k: v for k, v in result.items() if k != "history"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
