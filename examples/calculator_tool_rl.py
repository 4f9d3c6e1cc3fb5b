"""Tool-use RL on a CPU: SmolLM2-135M-Instruct learns to use a calculator MCP server.

    python examples/calculator_tool_rl.py            # minutes on 2 CPU cores (figures in the README)

The policy is the real SmolLM2-135M-Instruct (full fine-tune, AdamW), trained with multi-turn GRPO
(``recipes/grpo_tools.py``) against the shipped calculator server
(``python -m materl.tools.calculator``, spoken to over MCP stdio). Questions are generated in
code (``examples/arithmetic.py``) and said in words: "Subtract 9376 from 73691." and "What is
the sum of 56125 and 6306?", with numbers that a 135M model cannot add or subtract in its head.
Prompted, it answers every sum from memory, without the tool ("The sum of 58394 and 65987 is
14455."); RL teaches it to call ``calculate`` with the right expression and copy the result.

Each episode has two model turns: a tool call, then the answer after the tool's result. The
prompt is a system line with the exact call format plus two worked examples as chat turns (a
product in symbols, and a subtraction in words, which fixes the order of its operands: trained
in a run without it, the model learned to write "a - b" for "Subtract a from b."); episodes are sampled at
temperature 0.7. The format reward is paid only for a call that works
(``format_needs_success=True``): paid for any well-formed call, a run on these questions learned
well-formed calls that the tool rejected.

The tool schemas are kept out of the chat template (``show_schemas=False``): the system line
describes the one tool instead, which halves the tokens per row and so the learner's time.

Printed: one line per step, mean reward / answer / tool-call success over the first 5 and
the last 5 steps, and greedy accuracy and the fraction of episodes that call the tool on 32
held-out questions before and after training (the rows of the README's table).
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", "2")

import materl as ml  # noqa: E402
from arithmetic import train_test_split  # noqa: E402
from materl.recipes.grpo_tools import grpo_tools_recipe  # noqa: E402

SEED, STEPS, BATCH, GROUP = 0, 12, 2, 4  # 12 steps x 2 questions x 4 episodes each
LR, MAX_NEW_TOKENS, TURNS, TEMPERATURE = 3e-5, 64, 2, 0.7  # a 3-term call is ~46 tokens
SYSTEM = ('Use the calculate tool: reply with <tool_call>{"name": "calculate", "arguments": '
          '{"expression": "..."}}</tool_call>, then answer with its result.')


def call(expression: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "calculate", "arguments": {"expression": expression}}) + "\n</tool_call>"


def worked_example(question: str, expression: str, result: int) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": call(expression)},
            {"role": "tool", "content": str(result)}, {"role": "assistant", "content": f"The answer is {result}."}]


EXAMPLES = worked_example("What is 123 * 45?", "123 * 45", 5535) + worked_example(
    "Subtract 905 from 6324.", "6324 - 905", 5419)


def as_chat(rows: list[dict]) -> list[dict]:
    """Each question after the worked examples; ``answer`` stays a column for the reward."""
    return [{"prompt": EXAMPLES + [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows]


def mean(history: list[dict], key: str) -> float:
    return sum(m.get(key, 0.0) for m in history) / len(history)


def main() -> None:
    t0 = time.perf_counter()
    train_rows, test_rows = train_test_split(STEPS * BATCH, 32, seed=SEED)
    recipe = grpo_tools_recipe(ml.mcp_tools("python -m materl.tools.calculator"), turns=TURNS, show_schemas=False,
                               format_as_step=False, format_needs_success=True)
    policy = ml.Agent("smollm2-135m-instruct", trainable=True)
    step = ml.compile(recipe, policy=policy, group_size=GROUP, max_new_tokens=MAX_NEW_TOKENS, lr=LR,
                      temperature=TEMPERATURE, system_prompt=SYSTEM, max_turns=TURNS, seed=SEED)

    def show(i: int, m: dict) -> None:
        print(f"step {i:2d}  reward {m['reward']:.3f}  answer {m.get('reward/answer/mean', 0):.2f}  "
              f"tool success {m.get('reward/tool_success/mean', 0):.2f}  {m['time/step']:.0f}s", flush=True)

    try:
        result = ml.train(step, as_chat(train_rows), steps=STEPS, batch_size=BATCH, eval_dataset=as_chat(test_rows),
                          eval_every=STEPS, seed=SEED, run_dir="runs/calculator_tool_rl", progress=False,
                          tensorboard=False, on_step=show)
    finally:
        step.close()
    history, (before, after) = result["history"], result["evals"]
    for name, key in [("reward", "reward"), ("answer", "reward/answer/mean"),
                      ("tool success", "reward/tool_success/mean")]:
        print(f"{name:>13}: first 5 steps {mean(history[:5], key):.3f} -> last 5 steps {mean(history[-5:], key):.3f}")
    print(f"held-out, greedy ({len(test_rows)} questions), before training -> after {STEPS} steps:")
    for name, key in [("accuracy", "eval/accuracy"), ("episodes that call the tool", "eval/tool_call_rate")]:
        print(f"  {name}: {before[key]:.3f} -> {after[key]:.3f}")
    print(f"wall time {time.perf_counter() - t0:.0f}s; checkpoint {result['checkpoint']}")


if __name__ == "__main__":
    main()
