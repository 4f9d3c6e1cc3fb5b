"""The scheduler's cost in instructions (deterministic, unlike times on a shared machine).

Runs ``overhead.py``'s scheduler micro-benchmark (K trivial async ``@ml.op`` nodes x E episodes,
rollout stage only) or the same awaits in bare anyio tasks, N rollouts, under callgrind; only
the measured rollouts are counted (they run inside a libc ``qsort`` comparator, and callgrind
collects inside ``qsort`` alone; instrumentation is switched on just before them).

    valgrind --tool=callgrind --instr-atstart=no --collect-atstart=no '--toggle-collect=*qsort*' \\
        --callgrind-out-file=/tmp/cg.out python benchmarks/scheduler_instructions.py sched 2
    grep totals /tmp/cg.out          # instructions of the N rollouts ("I refs" in valgrind's output)

Per node per episode, net of bare anyio: (sched - bare) / (N x K x E). ``K=1`` in the environment
gives the per-episode part (one node). Under plain Python (no valgrind) it just runs.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys

import anyio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead  # noqa: E402

from materl.compiler.compiled import Compiled  # noqa: E402
from materl.compiler.options import CompileOptions  # noqa: E402


def main() -> None:
    what, n = sys.argv[1], int(sys.argv[2])
    if what not in ("sched", "bare"):
        raise SystemExit(f"usage: scheduler_instructions.py sched|bare N (got {what!r})")
    k, e = int(os.environ.get("K", 16)), int(os.environ.get("E", 64))
    compiled = Compiled(overhead.trivial_recipe(k), {}, CompileOptions(), rollout_only=True)
    prompts = [f"p{i}" for i in range(e)]

    async def go(m: int) -> None:
        for _ in range(m):
            await (compiled.rollout(prompts) if what == "sched" else overhead.bare(prompts, k))

    anyio.run(go, 3)  # warm-up, not counted
    if shutil.which("callgrind_control"):  # under callgrind: instrument from here on
        subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], capture_output=True, timeout=120)

    def measured(a, b) -> int:
        anyio.run(go, n)
        return 0

    cmp = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(measured)
    pair = (ctypes.c_int * 2)(1, 2)
    ctypes.CDLL("libc.so.6").qsort(pair, 2, ctypes.sizeof(ctypes.c_int), cmp)
    compiled.close()
    print(f"{what}: {n} rollouts of {k} nodes x {e} episodes")


if __name__ == "__main__":
    main()
