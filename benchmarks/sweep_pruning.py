"""A sweep of 8 trials on the tiny model with Optuna's MedianPruner vs the same 8 trials unpruned.

    python benchmarks/sweep_pruning.py [--trials 8] [--steps 8] [--out /tmp/sweep_bench]

The random sampler with one seed gives both sweeps the same 8 parameter sets (RandomSampler
draws independently of the results), so the only difference is pruning. Prints each sweep's wall
time, how many trials were pruned, the steps trained in all, and the best value each found
(one run; the machine's load moves the times).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from materl.runtime.sweep import run_sweep  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny_sweep.yaml"


def one(out: Path, pruner: str, trials: int, steps: int) -> dict:
    if out.exists():
        shutil.rmtree(out)
    t0 = time.perf_counter()
    result = run_sweep(EXAMPLE, [f"train.steps={steps}", "train.save_every=0"], sweep_overrides=[
        f"sweep.dir={out}", f"sweep.n_trials={trials}", "sweep.sampler=random", f"sweep.pruner={pruner}",
        "sweep.pruner_params={}" if pruner == "none" else "sweep.pruner_params={n_startup_trials: 2, n_warmup_steps: 1}",
    ], say=lambda line: print(f"  [{pruner}] {line}", flush=True))
    wall = time.perf_counter() - t0
    trained = 0
    for row in result["trials"]:
        lines = (Path(row["run_dir"]) / "metrics.jsonl").read_text().splitlines()
        trained += sum("loss" in json.loads(x) for x in lines)
    pruned = sum(r["state"] == "pruned" for r in result["trials"])
    return {"wall": wall, "pruned": pruned, "steps": trained, "best": result["best"]["value"],
            "params": [r["params"] for r in result["trials"]]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default="/tmp/materl_sweep_bench")
    args = p.parse_args()
    out = Path(args.out)
    pruned = one(out / "median", "median", args.trials, args.steps)
    full = one(out / "none", "none", args.trials, args.steps)
    assert pruned["params"] == full["params"], "the two sweeps drew different parameters"
    for name, r in (("median pruner", pruned), ("no pruning", full)):
        print(f"{name:<14} wall {r['wall']:7.1f} s  pruned {r['pruned']}/{args.trials}  steps trained {r['steps']:3d}  "
              f"best eval/reward {r['best']:.4f}")
    print(f"ratio (unpruned / pruned wall): {full['wall'] / pruned['wall']:.2f}x")


if __name__ == "__main__":
    main()
