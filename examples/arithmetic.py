"""Seeded arithmetic questions a 135M model cannot answer in its head, with exact answers.

    train, test = train_test_split(256, 32, seed=0)
    # {"prompt": "What is 4821 * 37?", "answer": "178377", "expression": "4821 * 37"}

Three kinds, equally likely: a product of a 3-4 digit and a 2-3 digit number, a sum of three
3-5 digit numbers, and ``a * b + c``; four wordings ("What is ...?", "Compute ...", ...). A
harder mix than ``materl.runtime.tasks.arithmetic_rows`` (two operands, one wording): a prompted
SmolLM2-135M already calls the calculator for that one, so there is little left to learn.
Same seed, same rows (``random.Random(seed)``; no global state).
"""

from __future__ import annotations

import random

TEMPLATES = ("What is {q}?", "Compute {q}.", "Calculate {q}.", "What is the value of {q}?")


def _expression(rng: random.Random) -> tuple[str, int]:
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randint(100, 9999), rng.randint(10, 999)
        return f"{a} * {b}", a * b
    if kind == 1:
        a, b, c = (rng.randint(100, 99999) for _ in range(3))
        return f"{a} + {b} + {c}", a + b + c
    a, b, c = rng.randint(100, 999), rng.randint(10, 99), rng.randint(100, 9999)
    return f"{a} * {b} + {c}", a * b + c


def arithmetic_rows(n: int, *, seed: int = 0, exclude: frozenset[str] = frozenset()) -> list[dict]:
    """``n`` rows ``{"prompt", "answer", "expression"}``; expressions in ``exclude`` are skipped."""
    rng = random.Random(seed)
    seen = set(exclude)
    rows: list[dict] = []
    while len(rows) < n:
        expr, value = _expression(rng)
        if expr in seen:
            continue
        seen.add(expr)
        rows.append({"prompt": rng.choice(TEMPLATES).format(q=expr), "answer": str(value), "expression": expr})
    return rows


def train_test_split(n_train: int, n_test: int, *, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Disjoint train and held-out rows (the held-out set is drawn from ``seed + 1``)."""
    test = arithmetic_rows(n_test, seed=seed + 1)
    train = arithmetic_rows(n_train, seed=seed, exclude=frozenset(r["expression"] for r in test))
    return train, test


if __name__ == "__main__":
    for row in arithmetic_rows(6):
        print(row)
