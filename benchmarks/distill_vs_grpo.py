"""On-policy distillation vs GRPO from the same start, SmolLM2-135M-Instruct: the calculator task, or ``--task``.

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

``--task NAME``: a reasoning-gym task with the calculator instead, the setting of
``curriculum.py --tools`` (two worked calls per prompt, reward = the task's score + 0.2 for a
call that works; students train at the hardest level, GRPO being that benchmark's fixed arm);
held-out: each seed's 32 questions at the hardest level, and the teacher's accuracy is measured
on the same questions. A teacher for it: a curriculum run kept by ``curriculum.py --keep-runs``.

    OMP_NUM_THREADS=1 python benchmarks/curriculum.py --task basic_arithmetic --tools --steps 12 --batch 2 --group 4 \
        --window 8 --max-new-tokens 64 --test-size 32 --start-level 1 --raise-above 0.25 --lower-below 0 \
        --arms curriculum --seeds 0 --keep-runs /tmp/teach
    OMP_NUM_THREADS=1 python benchmarks/distill_vs_grpo.py --task basic_arithmetic --teacher-run /tmp/teach/curriculum-0 \
        --steps 12 --eval-every 1 --just-decide --seeds 0 1 2

``--just-decide``: GRPO trains at most twice the steps distillation needed on that seed (enough
to decide the goal; its curve is then cut there). ``--methods grpo`` (or ``distill``) runs one arm
only, e.g. the two arms in two processes (GRPO alone trains ``--steps``: ``--just-decide`` needs
distillation's steps from the same process); ``--target`` then gives the teacher's held-out
accuracy where an earlier run measured it, and with ``--methods grpo`` no teacher is loaded at all.
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
from reasoning_gym_curriculum import ToolPrompted, build  # noqa: E402
from materl.recipes.grpo_tools import grpo_tools_recipe  # noqa: E402
from materl.runtime.evaluate import evaluate_compiled  # noqa: E402


def options(seed: int, lr: float = LR) -> dict:
    return dict(group_size=GROUP, max_new_tokens=MAX_NEW_TOKENS, lr=lr, temperature=TEMPERATURE, system_prompt=SYSTEM,
                max_turns=TURNS, seed=seed)


class Calculator:
    """The calculator demo's task: its questions, recipe and options."""

    batch = BATCH

    def __init__(self, args: argparse.Namespace):
        self.lr = args.lr or LR
        self.train, self.test = (as_chat(rows) for rows in train_test_split(args.train_rows, 32, seed=0))

    def held_out(self, seed: int) -> list[dict]:
        return self.test

    def training_rows(self, seed: int) -> list[dict]:
        return self.train

    def step(self, model: str, seed: int, *, teacher: str | None = None, weight: float = 1.0):
        policy = ml.Agent(model, trainable=True)
        if teacher is not None:
            return ml.compile(distill_recipe(weight), policy=policy, teacher=ml.Agent(teacher), **options(seed, self.lr))
        recipe = grpo_tools_recipe(ml.mcp_tools("python -m materl.tools.calculator"), turns=TURNS, show_schemas=False,
                                   format_as_step=False, format_needs_success=True)
        return ml.compile(recipe, policy=policy, **options(seed, self.lr))


class ReasoningGym:
    """A reasoning-gym task with the calculator at its hardest level (``curriculum.py --tools``)."""

    batch, group, max_new_tokens = 2, 4, 64

    def __init__(self, args: argparse.Namespace):
        self.name, self.lr = args.task, args.lr or 2e-5

    def _task(self, seed: int) -> ml.ReasoningGymTask:
        return ml.ReasoningGymTask(self.name, seed=seed, shots=0, instruction=None)

    def held_out(self, seed: int) -> list[dict]:  # the curriculum benchmark's held-out questions for this seed
        task = ToolPrompted(self._task(seed))
        return task.rows(32, seed=seed + 10_000, level=task.levels - 1)

    def training_rows(self, seed: int) -> list[dict]:  # the curriculum benchmark's fixed arm
        task = ToolPrompted(self._task(seed))
        return task.rows_at(task.levels - 1, 256, seed=seed + task.levels - 1)

    def step(self, model: str, seed: int, *, teacher: str | None = None, weight: float = 1.0):
        return build(self._task(seed), model=model, group_size=self.group, max_new_tokens=self.max_new_tokens,
                     lr=self.lr, seed=seed, tools=True, teacher=teacher, distill_weight=weight)


def accuracy(step, rows: list[dict]) -> float:
    try:
        return evaluate_compiled(step, rows)["accuracy"]
    finally:
        step.close()


def curve(method: str, setup, teacher: str, seed: int, args: argparse.Namespace, target: float, *,
          steps: int) -> list[tuple[int, float]]:
    student = "smollm2-135m-instruct"
    step = (setup.step(student, seed, teacher=teacher, weight=args.weight) if method == "distill"
            else setup.step(student, seed))
    stopping = None if args.full_curves else ml.EarlyStopping(patience=steps + 1, stop_at=target)
    try:
        with tempfile.TemporaryDirectory(prefix=f"{method}-{seed}-") as run_dir:  # ~2 GB of checkpoints a run
            result = ml.train(step, setup.training_rows(seed), steps=steps, batch_size=setup.batch,
                              eval_dataset=setup.held_out(seed), eval_every=args.eval_every, seed=seed,
                              run_dir=run_dir, progress=False, tensorboard=False, early_stopping=stopping)
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
    p.add_argument("--lr", type=float, default=None, help="both methods' learning rate (default: the demo's 3e-5; "
                                                          "2e-5 with --task, curriculum.py's)")
    p.add_argument("--task", default=None, help="a reasoning-gym task with the calculator instead of the demo's task")
    p.add_argument("--just-decide", action="store_true",
                   help="GRPO trains at most twice the steps distillation needed (enough to decide the goal)")
    p.add_argument("--full-curves", action="store_true", help="train all --steps, not only until the teacher")
    p.add_argument("--methods", nargs="+", choices=("distill", "grpo"), default=["distill", "grpo"],
                   help="the arms to run (distillation runs first when both are given)")
    p.add_argument("--target", type=float, default=None,
                   help="the teacher's held-out accuracy, measured by an earlier run (not measured again)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--train-rows", type=int, default=12 * BATCH,
                   help="the training questions (the demo's 24), the same whatever --steps is, so that runs with "
                        "different --steps or --eval-every train on the same data")
    args = p.parse_args()
    if set(args.methods) == {"grpo"} and args.target is not None:
        return compare(args, None)
    with tempfile.TemporaryDirectory(prefix="teacher-") as tmp:
        compare(args, args.teacher or str(ml.export(args.teacher_run, tmp + "/policy")))


def compare(args: argparse.Namespace, teacher: str | None) -> None:
    setup = ReasoningGym(args) if args.task else Calculator(args)
    print(f"teacher {teacher}; task {args.task or 'the calculator demo'}; lr {setup.lr:g}", flush=True)
    needed: dict[str, list[int]] = {"distill": [], "grpo": []}  # steps to the teacher; steps + 1: not within them
    censored = False  # a GRPO run that did not reach the teacher: its count is a lower bound
    targets: dict[str, float] = {}  # the teacher's accuracy by held-out questions (the calculator's: one set)
    methods = [m for m in ("distill", "grpo") if m in args.methods]
    for seed in args.seeds:
        held_out = setup.held_out(seed)
        key = repr([row["prompt"] for row in held_out])
        if key not in targets:
            targets[key] = args.target if args.target is not None else accuracy(setup.step(teacher, seed), held_out)
        target = targets[key]
        reached, budget = {}, {}
        for method in methods:  # distillation first: --just-decide sizes GRPO's run by its steps
            t0 = time.perf_counter()
            d = reached.get("distill")
            budget[method] = min(args.steps, 2 * d) if method == "grpo" and args.just_decide and d else args.steps
            points = curve(method, setup, teacher, seed, args, target, steps=budget[method])
            reached[method] = first_reaching(points, target)
            shown = "  ".join(f"step {s}: {a:.3f}" for s, a in points)
            print(f"seed {seed} {method:>7}: {shown}  (teacher {target:.3f}; reaches it at {reached[method]}; "
                  f"{time.perf_counter() - t0:.0f}s)", flush=True)
        for method in methods:  # a run that did not reach the teacher counts as its steps + 1
            needed[method].append(reached[method] or budget[method] + 1)
        censored |= "grpo" in reached and reached["grpo"] is None
        if len(reached) < 2:
            continue
        d, g = reached["distill"], reached["grpo"]
        ratio = (f"{g / d:.2f}x" if d and g else f"> {budget['grpo'] / d:.2f}x (GRPO did not reach it in "
                 f"{budget['grpo']} steps)" if d else "n/a (distillation did not reach it within the steps)")
        print(f"seed {seed}: steps to the teacher's accuracy, GRPO / distillation = {ratio}", flush=True)
    mean = {m: sum(v) / len(v) for m, v in needed.items() if v}
    bound = "at least " if censored else ""
    shown = ", ".join(f"{m} {bound if m == 'grpo' else ''}{v:.2f} steps" for m, v in mean.items())
    ratio = f"; GRPO / distillation {bound}{mean['grpo'] / mean['distill']:.2f}x" if len(mean) == 2 else ""
    print(f"mean over seeds {args.seeds}: {shown} (a run that did not reach the teacher counts as its steps + 1)"
          f"{ratio}", flush=True)


if __name__ == "__main__":
    main()
