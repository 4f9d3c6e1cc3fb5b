"""Seeded arithmetic questions in words, which a 135M model cannot answer in its head, with exact answers.

    train, test = train_test_split(24, 32, seed=0)
    arithmetic_rows(6, seed=0)[5]
    # {"prompt": "Subtract 5104 from 79804.", "answer": "74700", "expression": "79804 - 5104"}

Three kinds, equally likely, said in words rather than symbols, so the model has to turn the
sentence into an expression before it can call the calculator:

    Subtract a from b.                         b - a        (4 digits from 5 digits)
    What is the sum of a and b?                a + b        (4-5 digits each)
    Multiply a by b, then subtract c.          a * b - c    (3 digits, 2 digits, 4 digits)

The few-shot prompted SmolLM2-135M-Instruct often answers the first two from memory, without the
tool (and wrongly); see the README's demo table. Harder than
``materl.runtime.tasks.arithmetic_rows`` (two operands in symbols, which a prompted SmolLM2-135M
already solves with the calculator). Same seed, same rows (``random.Random(seed)``; no global state).
"""

from __future__ import annotations

import random


def _question(rng: random.Random) -> tuple[str, str, int]:
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randint(1000, 9999), rng.randint(10000, 99999)
        return f"Subtract {a} from {b}.", f"{b} - {a}", b - a
    if kind == 1:
        a, b = rng.randint(1000, 99999), rng.randint(1000, 99999)
        return f"What is the sum of {a} and {b}?", f"{a} + {b}", a + b
    a, b, c = rng.randint(100, 999), rng.randint(10, 99), rng.randint(1000, 9999)
    return f"Multiply {a} by {b}, then subtract {c}.", f"{a} * {b} - {c}", a * b - c


def arithmetic_rows(n: int, *, seed: int = 0, exclude: frozenset[str] = frozenset()) -> list[dict]:
    """``n`` rows ``{"prompt", "answer", "expression"}``; expressions in ``exclude`` are skipped."""
    rng = random.Random(seed)
    seen = set(exclude)
    rows: list[dict] = []
    while len(rows) < n:
        question, expr, value = _question(rng)
        if expr in seen:
            continue
        seen.add(expr)
        rows.append({"prompt": question, "answer": str(value), "expression": expr})
    return rows


def train_test_split(n_train: int, n_test: int, *, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Disjoint train and held-out rows (the held-out set is drawn from ``seed + 1``)."""
    test = arithmetic_rows(n_test, seed=seed + 1)
    train = arithmetic_rows(n_train, seed=seed, exclude=frozenset(r["expression"] for r in test))
    return train, test


if __name__ == "__main__":
    for row in arithmetic_rows(6):
        print(row)
