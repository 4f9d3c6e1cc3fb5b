"""On-policy distillation vs GRPO on the calculator task, SmolLM2-135M-Instruct, from the same start.

    python examples/calculator_tool_rl.py                 # trains the teacher (runs/calculator_tool_rl)
    python benchmarks/distill_vs_grpo.py --teacher-run runs/calculator_tool_rl --steps 12 --seeds 0 1 2

The teacher is the calculator demo's trained policy (exported from its run directory to an HF
folder once). For each seed, two students start from the base model: one trains ``--steps`` steps
of the demo's GRPO recipe, the other the same recipe with the teacher's reverse-KL term
(``ml.with_distillation``, ``--weight``). Greedy held-out accuracy (32 questions, the demo's
split) is measured every ``--eval-every`` steps; printed: per seed and method, the accuracy
curve, and the first step at which each reaches the teacher's held-out accuracy, with the ratio
GRPO steps / distillation steps (the issue's goal: distillation needs at most half). A run stops
at the first evaluation that reaches the teacher (``EarlyStopping(stop_at=...)``) unless
``--full-curves``. ``--lr``: both methods' learning rate (default the demo's).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
os.environ.setdefault("OMP_NUM_THREADS", "2")

import materl as ml  # noqa: E402
from arithmetic import train_test_split  # noqa: E402
from calculator_tool_rl import BATCH, GROUP, LR, MAX_NEW_TOKENS, SYSTEM, TEMPERATURE, TURNS, as_chat  # noqa: E402
from distill_calculator import distill_recipe  # noqa: E402
from materl.recipes.grpo_tools import grpo_tools_recipe  # noqa: E402
from materl.runtime.evaluate import evaluate_compiled  # noqa: E402


def options(seed: int, lr: float = LR) -> dict:
    return dict(group_size=GROUP, max_new_tokens=MAX_NEW_TOKENS, lr=lr, temperature=TEMPERATURE, system_prompt=SYSTEM,
                max_turns=TURNS, seed=seed)


def teacher_accuracy(folder: str, test: list[dict]) -> float:
    recipe = grpo_tools_recipe(ml.mcp_tools("python -m materl.tools.calculator"), turns=TURNS, show_schemas=False,
                               format_as_step=False, format_needs_success=True)
    step = ml.compile(recipe, policy=ml.Agent(folder, trainable=True), **options(0))
    try:
        return evaluate_compiled(step, as_chat(test))["accuracy"]
    finally:
        step.close()


def curve(method: str, teacher: str, seed: int, args: argparse.Namespace, target: float) -> list[tuple[int, float]]:
    steps, train_rows = args.steps, args.train_rows
    train, test = train_test_split(train_rows, 32, seed=0)
    student = ml.Agent("smollm2-135m-instruct", trainable=True)
    if method == "distill":
        step = ml.compile(distill_recipe(args.weight), policy=student, teacher=ml.Agent(teacher),
                          **options(seed, args.lr))
    else:
        recipe = grpo_tools_recipe(ml.mcp_tools("python -m materl.tools.calculator"), turns=TURNS, show_schemas=False,
                                   format_as_step=False, format_needs_success=True)
        step = ml.compile(recipe, policy=student, **options(seed, args.lr))
    stopping = None if args.full_curves else ml.EarlyStopping(patience=steps + 1, stop_at=target)
    try:
        with tempfile.TemporaryDirectory(prefix=f"{method}-{seed}-") as run_dir:  # ~2 GB of checkpoints a run
            result = ml.train(step, as_chat(train), steps=steps, batch_size=BATCH, eval_dataset=as_chat(test),
                              eval_every=args.eval_every, seed=seed, run_dir=run_dir, progress=False,
                              tensorboard=False, early_stopping=stopping)
    finally:
        step.close()
    return [(e["step"], e["eval/accuracy"]) for e in result["evals"]]


def first_reaching(points: list[tuple[int, float]], target: float) -> int | None:
    return next((s for s, acc in points if acc >= target), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher-run", default="runs/calculator_tool_rl", help="the demo's run dir (or --teacher)")
    p.add_argument("--teacher", help="an exported HF folder of the teacher")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--eval-every", type=int, default=3)
    p.add_argument("--weight", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=LR, help="both methods' learning rate (default the demo's)")
    p.add_argument("--full-curves", action="store_true", help="train all --steps, not only until the teacher")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--train-rows", type=int, default=12 * BATCH,
                   help="the training questions (the demo's 24), the same whatever --steps is, so that runs with "
                        "different --steps or --eval-every train on the same data")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="teacher-") as tmp:
        compare(args, args.teacher or str(ml.export(args.teacher_run, tmp + "/policy")))


def compare(args: argparse.Namespace, teacher: str) -> None:
    _, test = train_test_split(args.train_rows, 32, seed=0)
    target = teacher_accuracy(teacher, test)
    print(f"teacher held-out accuracy {target:.3f} ({teacher}); lr {args.lr:g}", flush=True)
    needed: dict[str, list[int]] = {"distill": [], "grpo": []}  # steps to the teacher; steps + 1: not within them
    for seed in args.seeds:
        reached = {}
        for method in ("distill", "grpo"):
            t0 = time.perf_counter()
            points = curve(method, teacher, seed, args, target)
            reached[method] = first_reaching(points, target)
            shown = "  ".join(f"step {s}: {a:.3f}" for s, a in points)
            print(f"seed {seed} {method:>7}: {shown}  (reaches teacher at {reached[method]}; "
                  f"{time.perf_counter() - t0:.0f}s)", flush=True)
        d, g = reached["distill"], reached["grpo"]
        ratio = (f"{g / d:.2f}x" if d and g else f"> {args.steps / d:.2f}x (GRPO did not reach it in {args.steps} steps)"
                 if d else "n/a (distillation did not reach it within the steps)")
        print(f"seed {seed}: steps to the teacher's accuracy, GRPO / distillation = {ratio}", flush=True)
        for method in needed:
            needed[method].append(reached[method] or args.steps + 1)
    mean = {m: sum(v) / len(v) for m, v in needed.items()}
    bound = "at least " if any(v > args.steps for v in needed["grpo"]) else ""
    print(f"mean over seeds {args.seeds}: distillation {mean['distill']:.2f} steps, GRPO {bound}{mean['grpo']:.2f} "
          f"(a run that did not reach the teacher counts as {args.steps + 1}); GRPO / distillation "
          f"{bound}{mean['grpo'] / mean['distill']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
