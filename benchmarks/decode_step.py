"""One decode step of the Mojo engine's forward alone (``MojoForward.logits``), SmolLM2-135M on CPU,
against the time to read the weights once.

For each row count (``--rows``, default 1 and 8: one decode row per request, each request with
its own KV cache prefilled to 64 positions) and thread count (1 and ``--threads``), the median and
the minimum of ``--calls`` forward calls at consecutive positions; the configurations alternate
for ``--rounds`` rounds. The floor: torch's ``sum`` over a float32 tensor as large as the model's
weights (what streaming them from memory costs on ``--threads`` threads). No sampling, no Python
engine around the call: this is the kernel (``kernels/llama_engine.mojo``, ``kernels/llama/gemm.mojo``).

    python benchmarks/decode_step.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from materl.engines.mojo_forward import MojoForward, Row, new_cache
from materl.engines.mojo_model import ModelTable
from materl.engines.models import load_model
from materl.kernels.loader import load_or_reason

MODEL = "smollm2-135m-instruct"
PREFILL = 64


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernel, why = load_or_reason("llama_engine")
    if kernel is None:
        raise SystemExit(f"the Mojo engine's kernel is unavailable: {why}")
    model, _ = load_model(MODEL)
    table = ModelTable(model)
    forward = MojoForward(kernel, threads=args.threads)
    caches = [new_cache(table.shape, PREFILL + args.calls + 1) for _ in range(max(args.rows))]
    for cache in caches:
        forward.logits(table, [Row(1 + i, i, cache) for i in range(PREFILL)], [PREFILL - 1])
    weights = sum(p.numel() for p in model.parameters())
    stream = torch.ones(weights)
    times: dict[tuple[int, int], list[float]] = {}
    floor: list[float] = []
    for _ in range(args.rounds):
        for rows in args.rows:
            for threads in sorted({1, args.threads}):
                forward.chooser.pick = lambda _rows=1, t=threads: t  # this configuration's thread count
                for step in range(args.calls):
                    batch = [Row(5 + r, PREFILL + step, caches[r]) for r in range(rows)]
                    t0 = time.perf_counter()
                    forward.logits(table, batch, list(range(rows)))
                    times.setdefault((rows, threads), []).append(time.perf_counter() - t0)
        for _ in range(5):
            t0 = time.perf_counter()
            stream.sum()
            floor.append(time.perf_counter() - t0)
    print(f"torch {torch.__version__}, SmolLM2-135M: {weights * 4 / 1e6:.0f} MB of float32 weights\n")
    print("| rows | threads | ms per step, median | min | weights read, GB/s |")
    print("|---|---|---|---|---|")
    for (rows, threads), ts in sorted(times.items()):
        med = statistics.median(ts)
        print(f"| {rows} | {threads} | {med * 1e3:.1f} | {min(ts) * 1e3:.1f} | {weights * 4 / med / 1e9:.1f} |")
    med = statistics.median(floor)
    print(f"| torch sum of the weights' size | {args.threads} | {med * 1e3:.1f} | {min(floor) * 1e3:.1f} "
          f"| {weights * 4 / med / 1e9:.1f} |")


if __name__ == "__main__":
    main()
