"""Generated tasks (no downloads): arithmetic questions a small model cannot do in its head."""

from __future__ import annotations

import random


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
