"""Seeded arithmetic questions in words, which a 135M model cannot answer in its head, with exact answers.

    train, test = train_test_split(24, 32, seed=0)
    arithmetic_rows(6, seed=0)[1]
    # {"prompt": "Subtract 9376 from 73691.", "answer": "64315", "expression": "73691 - 9376"}

Two kinds, equally likely, said in words rather than symbols, so the model has to turn the
sentence into an expression before it can call the calculator:

    Subtract a from b.                         b - a        (4 digits from 5 digits)
    What is the sum of a and b?                a + b        (4-5 digits each)

The few-shot prompted SmolLM2-135M-Instruct answers every sum from memory, without the tool (and
wrongly), while it calls the tool for most subtractions (the prompt has a worded subtraction as a
worked example); see the README's demo table. Harder than ``materl.runtime.tasks.arithmetic_rows``
(two operands in symbols, which a prompted SmolLM2-135M already solves with the calculator).
Same seed, same rows (``random.Random(seed)``; no global state).
"""

from __future__ import annotations

import random


def _question(rng: random.Random) -> tuple[str, str, int]:
    if rng.random() < 0.5:
        a, b = rng.randint(1000, 9999), rng.randint(10000, 99999)
        return f"Subtract {a} from {b}.", f"{b} - {a}", b - a
    a, b = rng.randint(1000, 99999), rng.randint(1000, 99999)
    return f"What is the sum of {a} and {b}?", f"{a} + {b}", a + b


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
