"""Sentiment and toxicity rewards on 4,096 completions: the Mojo kernel vs the Python reference.

    python benchmarks/text_rewards.py [--n 4096] [--repeats 5]

Prints the best-of-repeats wall time and thread CPU time (``time.thread_time``: what the call
itself computed, without the time another process held the core) of each and their ratios (one
run, no averaging across runs); the repeats alternate Python and Mojo calls, so a change of
machine load falls on both. On a loaded machine the CPU ratio is the steadier one. The
kernel's time is the whole ``K.sentiment``/``K.toxicity`` call: packing the texts, the kernel,
the output tensor. Both give the same float64 numbers (checked here too).
"""

from __future__ import annotations

import argparse
import os
import random
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from materl.kernels import text_rewards as K  # noqa: E402
from materl.ops import text_rewards as T  # noqa: E402


def completions(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    table, _ = T.lexicon()
    words = sorted(w.decode() for w in table if w.isalpha())
    filler = ["the", "answer", "is", "we", "compute", "then", "so", "and", "it", "a", "of", "to", "not", "very"]
    out = []
    for _ in range(n):
        toks = [rng.choice(words) if rng.random() < 0.2 else rng.choice(filler) for _ in range(rng.randint(20, 120))]
        out.append(" ".join(toks) + rng.choice([".", "!", "?", "!!"]))
    return out


def best_interleaved(fns, repeats: int) -> list[tuple[float, float]]:
    """Best (wall, thread CPU) time of each of ``fns`` over ``repeats`` rounds, each round calling all of them."""
    wall, cpu = [float("inf")] * len(fns), [float("inf")] * len(fns)
    for _ in range(repeats):
        for k, fn in enumerate(fns):
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            cpu[k] = min(cpu[k], time.thread_time() - c0)
            wall[k] = min(wall[k], time.perf_counter() - t0)
    return list(zip(wall, cpu))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    texts = completions(args.n)
    K.table()
    for name, fn in (("sentiment", K.sentiment), ("toxicity", K.toxicity)):
        assert torch.equal(fn(texts, impl="mojo"), fn(texts, impl="python"))
        (py, py_cpu), (mojo, mojo_cpu) = best_interleaved(
            [lambda: fn(texts, impl="python"), lambda: fn(texts, impl="mojo")], args.repeats)
        print(f"{name:<10} {args.n} completions  wall: python {py * 1e3:7.1f} ms  mojo {mojo * 1e3:6.2f} ms  "
              f"ratio {py / mojo:5.1f}x   cpu: python {py_cpu * 1e3:7.1f} ms  mojo {mojo_cpu * 1e3:6.2f} ms  "
              f"ratio {py_cpu / mojo_cpu:5.1f}x")


if __name__ == "__main__":
    main()
