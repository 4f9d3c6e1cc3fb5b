"""On-policy distillation of a tool-using teacher into a student, on the calculator task.

    python examples/calculator_tool_rl.py && materl export runs/calculator_tool_rl teacher   # the teacher
    python examples/distill_calculator.py --teacher teacher                  # a trained SmolLM2 folder
    python examples/distill_calculator.py --tiny                             # tiny random models, 3 steps (CI)

The student (SmolLM2-135M-Instruct, or the tiny random model) runs the multi-turn calculator
recipe (``recipes/grpo_tools.py``: a tool call, the calculator's answer over MCP, a final
answer). The frozen teacher (a folder with the same tokenizer: the calculator demo's trained
policy, exported from its run directory) scores every token the student sampled
with its own log-prob of the exact ids; the calculator's output is never scored. Each token's
advantage is the recipe's GRPO advantage plus ``--weight`` times the negative reverse KL
(``ml.with_distillation``; Thinking Machines' "On-Policy Distillation"). ``--weight`` large
makes it mostly distillation; 0 would be plain GRPO.

Printed: one line per step (reward, the student's reverse KL to the teacher per trained token,
tool-call success) and, unless --tiny, greedy accuracy on held-out questions before and after.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", "2")

import materl as ml  # noqa: E402
from arithmetic import train_test_split  # noqa: E402
from calculator_tool_rl import LR, SYSTEM, TEMPERATURE, TURNS, as_chat  # noqa: E402
from materl.recipes.grpo_tools import grpo_tools_recipe  # noqa: E402


def distill_recipe(weight: float):
    """The calculator demo's recipe, with the teacher's reverse-KL term added to its advantages."""
    recipe = grpo_tools_recipe(ml.mcp_tools("python -m materl.tools.calculator"), turns=TURNS, show_schemas=False,
                               format_as_step=False, format_needs_success=True)
    return ml.with_distillation(recipe, "teacher", weight)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny random student and teacher, 3 short steps (CI)")
    p.add_argument("--teacher", help="the teacher: an HF folder with the student's tokenizer")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--weight", type=float, default=1.0, help="the reverse-KL term's weight")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.tiny:
        from materl.engines.tiny import build_tiny_random

        folder = tempfile.mkdtemp(prefix="teacher-")
        build_tiny_random(folder, seed=1)  # the same tokenizer, other weights
        student, teacher, steps, tokens = ml.Agent("tiny-random", trainable=True), ml.Agent(folder), 3, 8
    else:
        if not args.teacher:
            p.error("--teacher DIR is required (or --tiny)")
        student = ml.Agent("smollm2-135m-instruct", trainable=True)
        teacher, steps, tokens = ml.Agent(args.teacher), args.steps, 64
    step = ml.compile(distill_recipe(args.weight), policy=student, teacher=teacher, group_size=4,
                      max_new_tokens=tokens, lr=LR, temperature=TEMPERATURE, system_prompt=SYSTEM, max_turns=TURNS,
                      seed=args.seed)
    train, test = train_test_split(steps * 2, 4 if args.tiny else 32, seed=args.seed)

    def show(i: int, m: dict) -> None:
        print(f"step {i} reward {m['reward']:.3f} reverse_kl {m['advantages/reverse_kl']:.4f} "
              f"tool_success {m.get('reward/tool_success/mean', 0.0):.2f}", flush=True)

    try:
        result = ml.train(step, as_chat(train), steps=steps, batch_size=2, eval_dataset=as_chat(test),
                          eval_every=steps, seed=args.seed, run_dir=tempfile.mkdtemp(prefix="distill-"),
                          progress=False, tensorboard=False, on_step=show)
    finally:
        step.close()
    before, after = result["evals"]
    print(f"held-out accuracy (greedy, {len(test)} questions): {before['eval/accuracy']:.3f} -> "
          f"{after['eval/accuracy']:.3f}")


if __name__ == "__main__":
    main()
