"""Curriculum vs a fixed difficulty on a reasoning-gym task, SmolLM2-135M-Instruct, per seed.

    OMP_NUM_THREADS=2 python benchmarks/curriculum.py --probe basic_arithmetic,leg_counting   # pick a task
    OMP_NUM_THREADS=2 python benchmarks/curriculum.py --task basic_arithmetic --steps 30 --seeds 0,1,2
    OMP_NUM_THREADS=1 python benchmarks/curriculum.py --task basic_arithmetic --tools --steps 12 --batch 2 --window 8 --max-new-tokens 64
    OMP_NUM_THREADS=1 python benchmarks/curriculum.py --task basic_arithmetic --tools --steps 12 --batch 2 --group 4 \
        --window 8 --max-new-tokens 64 --test-size 32 --start-level 1 --raise-above 0.25 --lower-below 0 \
        --arms curriculum --seeds 0,1,2          # and --arms fixed in a second process (RESULTS.md)

``--probe``: greedy held-out accuracy of the untrained model at level 0 and at the hardest level
of each task (the benchmark wants a task that starts below 30% at the hardest level and is
learnable, i.e. clearly above 0 at level 0). Otherwise, per seed: the same model, steps, batch,
group and max_new_tokens, trained once with ``ml.Curriculum`` from ``--start-level`` and once at the
hardest level (the fixed difficulty), each evaluated greedily on the same held-out rows at the
hardest level before and after. Printed: one markdown row per run and the mean over seeds, with
the trained tokens of each arm (the budgets are equal in steps; tokens are reported, not forced).
``--tools``: the example's calculator variant (``grpo_tools``, two worked tool calls per prompt);
``--require-tool``: its score trained on, and passing the curriculum, only through a call that
worked (both arms; held-out accuracy is the plain score).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import materl as ml  # noqa: E402
from reasoning_gym_curriculum import ToolPrompted, build, run  # noqa: E402
from materl.runtime.evaluate import evaluate_compiled  # noqa: E402


def probe(tasks: list[str], *, n: int, max_new_tokens: int, shots: int, tools: bool) -> None:
    print("| task | levels | accuracy at level 0 | accuracy at the hardest level |")
    print("|---|---|---|---|")
    for name in tasks:
        task = (ml.ReasoningGymTask(name, seed=0, shots=0, instruction=None) if tools
                else ml.ReasoningGymTask(name, seed=0, shots=shots))
        step = build(task, model="smollm2-135m-instruct", group_size=1, max_new_tokens=max_new_tokens, lr=0.0, seed=0,
                     tools=tools)
        task = ToolPrompted(task) if tools else task
        try:
            acc = [evaluate_compiled(step, task.rows(n, seed=10_000, level=lv)).get("accuracy", 0.0)
                   for lv in (0, task.levels - 1)]
        finally:
            step.close()
        print(f"| {name} | {task.levels} | {acc[0]:.3f} | {acc[1]:.3f} |", flush=True)


@contextlib.contextmanager
def keep_or_delete(parent: str | None, name: str):
    """A run directory: ``parent/name``, kept, or a temporary one deleted afterwards."""
    if parent is not None:
        yield os.path.join(parent, name)
        return
    with tempfile.TemporaryDirectory(prefix=f"{name}-") as run_dir:
        yield run_dir


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--probe", default=None, help="comma-separated tasks: untrained accuracy at level 0 and hardest")
    p.add_argument("--task", default="basic_arithmetic")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--test-size", type=int, default=32)
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--shots", type=int, default=1, help="worked examples before each question (ReasoningGymTask)")
    p.add_argument("--tools", action="store_true", help="the calculator tool, grpo_tools (the example's --tools)")
    p.add_argument("--require-tool", action="store_true",
                   help="with --tools: the score counts in training only through a call that worked (both arms)")
    p.add_argument("--start-level", type=int, default=0, help="the curriculum's first level")
    p.add_argument("--raise-above", type=float, default=0.5, help="raise the level above this recent pass rate")
    p.add_argument("--lower-below", type=float, default=0.1, help="lower it below this one (0: never lower)")
    p.add_argument("--arms", default="curriculum,fixed", help="which arms to run (one per process on a 2-core machine)")
    p.add_argument("--keep-runs", default=None, help="keep each run's directory as DIR/ARM-SEED (e.g. a teacher for "
                                                     "distill_vs_grpo.py --task); default: deleted")
    args = p.parse_args()
    if unknown := set(args.arms.split(",")) - {"curriculum", "fixed"}:
        p.error(f"--arms {args.arms}: unknown {', '.join(sorted(unknown))}; accepted: curriculum, fixed")
    if args.require_tool and not args.tools:
        p.error("--require-tool needs --tools")
    if args.probe:
        probe(args.probe.split(","), n=args.test_size, max_new_tokens=args.max_new_tokens, shots=args.shots,
              tools=args.tools)
        return 0
    hardest = ml.ReasoningGymTask(args.task).levels - 1
    print(f"| seed | arm | accuracy before | accuracy after | trained tokens | last level | wall s |")
    print("|---|---|---|---|---|---|---|")
    after: dict[str, list[float]] = {"curriculum": [], "fixed": []}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for arm in args.arms.split(","):
            t0 = time.perf_counter()
            with keep_or_delete(args.keep_runs, f"{arm}-{seed}") as run_dir:  # ~2 GB of checkpoints a run
                r = run(task_name=args.task, steps=args.steps, batch_size=args.batch, group_size=args.group,
                        max_new_tokens=args.max_new_tokens, lr=args.lr, seed=seed, test_size=args.test_size,
                        shots=args.shots, tools=args.tools, require_tool=args.require_tool,
                        fixed_level=hardest if arm == "fixed" else None,
                        run_dir=run_dir, curriculum=ml.Curriculum(
                            start_level=args.start_level, raise_above=args.raise_above,
                            lower_below=args.lower_below, window=args.window))
            last = r["history"][-1].get("curriculum/level", float(hardest))
            after[arm].append(r["accuracy_after"])
            print(f"| {seed} | {arm} | {r['accuracy_before']:.3f} | {r['accuracy_after']:.3f} | "
                  f"{r['trained_tokens']:.0f} | {last:.0f} | {time.perf_counter() - t0:.0f} |", flush=True)
    mean = {k: sum(v) / len(v) for k, v in after.items() if v}
    print(f"\nmean held-out accuracy at level {hardest} after {args.steps} steps: "
          + ", ".join(f"{k} {v:.3f}" for k, v in mean.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
