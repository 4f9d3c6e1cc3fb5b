"""The LM head's chunked log-probs (``materl.ops.logprobs.token_logprobs``), this checkout against
the same file at another git revision: forward + backward time alternating in one process (bit
equality of logp, entropy and gradients checked every round), and the peak RSS one call adds
(a fresh process per side, since glibc keeps freed memory).

Cases (trainable head, float32, one default 1,024-row chunk): ``none`` (no entropy), ``metric``
(entropy without a gradient: the learner's call), ``grad`` (an entropy bonus). Shapes: rows x
vocabulary x hidden; SmolLM2-135M's vocabulary is 49,152 (hidden 576), Qwen2.5-0.5B's 151,936
(hidden 896).

    OMP_NUM_THREADS=2 python benchmarks/logprobs_ab.py --against 5022ed2
    OMP_NUM_THREADS=2 python benchmarks/logprobs_ab.py --against 5022ed2 --memory --rows 1024 --vocab 151936 --hidden 896
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from materl import compute
from materl.ops import logprobs as current

CASES = {"none": {}, "metric": {"return_entropy": True, "entropy_grad": False}, "grad": {"return_entropy": True}}


def module_at(rev: str):
    """``materl/ops/logprobs.py`` as it was at ``rev``, imported under another name."""
    src = subprocess.run(["git", "show", f"{rev}:materl/ops/logprobs.py"], check=True, capture_output=True,
                         text=True, cwd=Path(__file__).resolve().parent.parent).stdout
    path = Path(tempfile.mkdtemp()) / "logprobs_at_rev.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("logprobs_at_rev", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def inputs(rows: int, vocab: int, hidden: int):
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(vocab, hidden) * 0.02)
    h = torch.randn(1, rows, hidden, requires_grad=True)
    return h, weight, torch.randint(0, vocab, (1, rows))


def call(module, h, weight, targets, case: str) -> list[torch.Tensor]:
    """One forward + backward; returns logp, the entropy (if any) and the two gradients."""
    h.grad = weight.grad = None
    out = module.token_logprobs(h, weight, targets, **CASES[case])
    logp, entropy = (out, None) if case == "none" else out
    loss = logp.sum() + (0.1 * entropy.sum() if case == "grad" else 0)
    loss.backward()
    return [logp.detach()] + ([entropy.detach()] if entropy is not None else []) + [h.grad, weight.grad]


def timing(old, a) -> None:
    h, weight, targets = inputs(a.rows, a.vocab, a.hidden)
    for case in CASES:
        times = {"old": [], "new": []}
        for r in range(a.rounds + 1):
            order = [("old", old), ("new", current)] if r % 2 else [("new", current), ("old", old)]
            results = {}
            for name, module in order:
                t0 = time.perf_counter()
                results[name] = call(module, h, weight, targets, case)
                if r:  # round 0 warms up
                    times[name].append(time.perf_counter() - t0)
            if not all(torch.equal(x, y) for x, y in zip(results["old"], results["new"])):
                raise SystemExit(f"{case}: the two revisions give different bits")
        o, n = statistics.median(times["old"]), statistics.median(times["new"])
        print(f"| {a.rows} x {a.vocab} x {a.hidden}, {case} | {o * 1e3:.0f} ms | {n * 1e3:.0f} ms | {o / n:.2f}x |",
              flush=True)


def peak_added_mib(side: str, case: str, a) -> float:
    """Run one call in a fresh process; the peak RSS above what the inputs took."""
    cmd = [sys.executable, __file__, "--against", a.against, "--rows", str(a.rows), "--vocab", str(a.vocab),
           "--hidden", str(a.hidden), "--_peak", side, case]
    return float(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", required=True, help="git revision of the old logprobs.py")
    ap.add_argument("--rows", type=int, default=248)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--memory", action="store_true", help="peak RSS per side instead of timing")
    ap.add_argument("--_peak", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    compute.tune_allocator()  # materl's allocator setting, as in training
    old = module_at(a.against)
    if a._peak:
        side, case = a._peak
        h, weight, targets = inputs(a.rows, a.vocab, a.hidden)
        base = psutil.Process().memory_info().rss
        call(old if side == "old" else current, h, weight, targets, case)
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base) / 2**20)
        return
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, old = {a.against}, new = this checkout\n")
    if a.memory:
        print("| shapes, case | old peak added MiB | new | new - old |\n|---|---|---|---|")
        for case in CASES:
            o, n = peak_added_mib("old", case, a), peak_added_mib("new", case, a)
            print(f"| {a.rows} x {a.vocab} x {a.hidden}, {case} | {o:.0f} | {n:.0f} | {n - o:+.0f} |", flush=True)
    else:
        print("| shapes, case | old fwd+bwd | new | old / new |\n|---|---|---|---|")
        timing(old, a)


if __name__ == "__main__":
    main()
