"""Reward shaping on the calculator task: outcome-only against outcome + a step reward for the
tool call, credited by each step-credit method (issue 27, item 5).

    OMP_NUM_THREADS=2 python benchmarks/reward_shaping.py                      # 4 methods x 3 seeds
    OMP_NUM_THREADS=1 python benchmarks/reward_shaping.py --methods outcome,turn --seeds 0 --steps 8

The demo's task and settings (``examples/calculator_tool_rl.py``: SmolLM2-135M-Instruct, full
fine-tune, two worked examples in the prompt, the calculator MCP server, 2 questions x 4 episodes
a step, temperature 0.7, the format reward paid only for a call that works), with the built-in
``grpo_tools`` recipe. Methods:

- ``outcome``: every reward term is an outcome (``format_as_step=False``; the demo's setting),
  GRPO over the summed reward (verl's).
- ``process``, ``turn``, ``gigpo``: the tool-call format reward is a STEP reward on turn 1
  (``format_as_step=True``) and ``grpo_tools(step_credit=...)`` credits it by DeepSeekMath's
  process supervision, turn-level GRPO, or GiGPO (docs/reward-shaping.md).

Each run is evaluated greedily on held-out questions before training and every
``--eval-every`` steps. Reported per run and per method (mean over seeds): the final held-out
accuracy, the first evaluated step at or above 0.9 accuracy ("-" if none), and the largest
|loss| and grad norm of any step (a spike is the symptom of the advantage blow-up this issue
fixed). ``--out`` writes every run's history and evals as JSON. A run takes about as long as the
demo (~8 steps in ~3 min on 2 idle cores, plus the evaluations); 12 runs are ~40 min or more.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
os.environ.setdefault("OMP_NUM_THREADS", "2")

import materl as ml  # noqa: E402
from arithmetic import train_test_split  # noqa: E402
from calculator_tool_rl import BATCH, GROUP, LR, MAX_NEW_TOKENS, SYSTEM, TEMPERATURE, TURNS, as_chat  # noqa: E402
from materl.recipes.grpo_tools import grpo_tools_recipe  # noqa: E402

METHODS = ("outcome", "process", "turn", "gigpo")


def recipe_for(method: str):
    """grpo_tools as the demo builds it; the format reward a step reward unless ``outcome``."""
    step = method != "outcome"
    return grpo_tools_recipe(ml.mcp_tools("python -m materl.tools.calculator"), turns=TURNS, show_schemas=False,
                             format_as_step=step, format_needs_success=True,
                             step_credit=method if step else "process")


def accuracy(result: dict) -> float:
    """Held-out accuracy of one evaluation (``ml.train``'s evals use metrics.jsonl's ``eval/`` keys)."""
    return float(result["eval/accuracy"])


def one_run(method: str, seed: int, args) -> dict:
    train_rows, test_rows = train_test_split(args.steps * BATCH, args.eval_questions, seed=seed)
    step = ml.compile(recipe_for(method), policy=ml.Agent(args.model, trainable=True), group_size=GROUP,
                      max_new_tokens=MAX_NEW_TOKENS, lr=LR, temperature=TEMPERATURE, system_prompt=SYSTEM,
                      max_turns=TURNS, seed=seed)
    t0 = time.perf_counter()
    try:
        result = ml.train(step, as_chat(train_rows), steps=args.steps, batch_size=BATCH,
                          eval_dataset=as_chat(test_rows), eval_every=args.eval_every, seed=seed,
                          run_dir=str(Path(args.run_dir) / f"{method}_seed{seed}"), progress=False, tensorboard=False)
    finally:
        step.close()
    evals = [(int(e["step"]), accuracy(e)) for e in result["evals"]]
    history = result["history"]
    return {
        "method": method, "seed": seed, "wall_s": time.perf_counter() - t0,
        "accuracy_before": evals[0][1], "accuracy": evals[-1][1],
        "steps_to_0.9": next((s for s, a in evals if a >= 0.9), None),
        "loss_max": max(abs(m["loss"]) for m in history), "grad_norm_max": max(m["grad_norm"] for m in history),
        "evals": evals, "history": [{k: v for k, v in m.items() if not k.startswith("time/")} for m in history],
    }


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def table(runs: list[dict]) -> str:
    lines = ["| method | seed | held-out accuracy (before -> after) | steps to 0.9 | max abs loss | max grad norm | "
             "wall s |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['method']} | {r['seed']} | {r['accuracy_before']:.3f} -> {r['accuracy']:.3f} | "
                     f"{_fmt(r['steps_to_0.9'], 'd')} | {r['loss_max']:.3g} | {r['grad_norm_max']:.3g} | "
                     f"{r['wall_s']:.0f} |")
    lines += ["", "| method | runs | mean held-out accuracy | runs reaching 0.9 (median step) | max abs loss | "
              "max grad norm |", "|---|---|---|---|---|---|"]
    for method in dict.fromkeys(r["method"] for r in runs):
        rs = [r for r in runs if r["method"] == method]
        reached = [r["steps_to_0.9"] for r in rs if r["steps_to_0.9"] is not None]
        median = _fmt(statistics.median(reached), "g") if reached else "-"
        lines.append(f"| {method} | {len(rs)} | {statistics.mean(r['accuracy'] for r in rs):.3f} | "
                     f"{len(reached)} of {len(rs)} ({median}) | {max(r['loss_max'] for r in rs):.3g} | "
                     f"{max(r['grad_norm_max'] for r in rs):.3g} |")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--steps", type=int, default=12, help="training steps per run (the demo's 12)")
    p.add_argument("--eval-every", type=int, default=4, help="held-out evaluation every this many steps")
    p.add_argument("--eval-questions", type=int, default=32, help="held-out questions")
    p.add_argument("--model", default="smollm2-135m-instruct", help="tiny-random for a smoke run")
    p.add_argument("--run-dir", default="runs/reward_shaping")
    p.add_argument("--out", default=None, help="write every run (history, evals) to this JSON file")
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        p.error(f"unknown method(s) {', '.join(unknown)}; valid: {', '.join(METHODS)}")
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.steps < 1 or args.eval_every < 1 or args.eval_questions < 1:
        p.error("--steps, --eval-every and --eval-questions must be at least 1")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse(argv)
    runs = []
    for seed in args.seeds:  # seeds outermost: a cut-short run still compares the methods
        for method in args.methods:
            runs.append(one_run(method, seed, args))
            r = runs[-1]
            print(f"{method} seed {seed}: accuracy {r['accuracy_before']:.3f} -> {r['accuracy']:.3f}, "
                  f"max |loss| {r['loss_max']:.3g}, max grad norm {r['grad_norm_max']:.3g}, {r['wall_s']:.0f}s",
                  flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(runs, indent=1))
    print(table(runs))
    return runs


if __name__ == "__main__":
    main()
