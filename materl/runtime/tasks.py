"""Generated tasks (no downloads): arithmetic questions a small model cannot do in its head, and
an environment that lets the model verify arithmetic on a budget."""

from __future__ import annotations

import random
import re

from materl.rollout.env import EnvStep
from materl.rollout.multiturn import prompt_messages
from materl.tools.calculator import evaluate as evaluate_expression


def arithmetic_rows(n: int, *, seed: int = 0, ops: tuple[str, ...] = ("*", "+"),
                    digits: tuple[tuple[int, int], tuple[int, int]] = ((3, 4), (2, 3))) -> list[dict]:
    """``n`` rows ``{"prompt": "What is 4821 * 377?", "answer": "1817517"}``, seeded. ``digits`` gives
    the (min, max) digit counts of the two operands; sums use the larger range for both."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        op = rng.choice(ops)
        (a_lo, a_hi), (b_lo, b_hi) = digits if op == "*" else (digits[0], digits[0])
        a = rng.randint(10 ** (rng.randint(a_lo, a_hi) - 1), 10 ** a_hi - 1)
        b = rng.randint(10 ** (rng.randint(b_lo, b_hi) - 1), 10 ** b_hi - 1)
        answer = a * b if op == "*" else a + b
        rows.append({"prompt": f"What is {a} {op} {b}?", "answer": str(answer)})
    return rows


def arithmetic_split(train_size: int | None, test_size: int, *, seed: int = 0, **params) -> tuple[list, list]:
    """Disjoint train and held-out rows from one seeded stream (held-out first)."""
    rows = arithmetic_rows((train_size or 256) + test_size, seed=seed, **params)
    return rows[test_size:], rows[:test_size]


class ToolBudgetVerifyEnv:
    """Self-verification with a tool budget (self-verification RL): the model answers ``ANSWER: x`` or
    asks ``VERIFY: <arithmetic>``; each verification costs ``cost`` from ``budget`` and is answered
    by the calculator's parser. The final answer is rewarded 1 if it equals the ``answer`` column,
    minus the verification cost spent; running out of budget ends the episode with reward 0."""

    def __init__(self, *, budget: float = 3.0, cost: float = 1.0):
        self.budget0, self.cost = budget, cost
        self.spent, self.answer, self.done = 0.0, None, False

    async def reset(self, prompt, **columns):
        self.spent, self.answer, self.done = 0.0, str(columns.get("answer", "")), False
        return prompt_messages(prompt) if isinstance(prompt, list) else (
            f"{prompt}\nReply 'VERIFY: <expression>' to check arithmetic (costs {self.cost:g} of a "
            f"{self.budget0:g} budget) or 'ANSWER: <number>'.")

    async def step(self, text):
        if m := re.search(r"ANSWER:\s*(-?[\d.,]+)", text):
            self.done = True
            ok = m.group(1).replace(",", "").rstrip(".") == self.answer
            return EnvStep(None, float(ok) - self.spent * 0.1, True, {"correct": ok})
        if (m := re.search(r"VERIFY:\s*(.+)", text)) and self.spent + self.cost <= self.budget0:
            self.spent += self.cost
            try:
                result = str(evaluate_expression(m.group(1).strip()))
            except Exception as e:  # a bad expression is feedback, not a crash
                result = f"error: {e}"
            return EnvStep(f"VERIFY result: {result}", None, False, {"verified": True})
        self.done = True
        return EnvStep(None, 0.0, True, {"gave_up": True})

    def is_done(self):
        return self.done
