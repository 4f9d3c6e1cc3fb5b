"""What one GRPO step of ``vs_trl.py``'s materl side allocates, by the allocator's live bytes:
the peak of (allocated - freed) within the step, when it happens, and which ops' blocks are live
then; for the learner's decoder forward (``materl.engines.decoder_forward``: lean activations,
the shared prompt interleaved) and for HF's plain decoder calls, side by side in one process.
RSS adds the allocator's own keeping on top (see RESULTS.md); this counts tensors only.

    OMP_NUM_THREADS=2 python benchmarks/learner_memory.py --mode full [--warmup 2] [--top 12] [--time-steps 6]

``--time-steps N`` then runs 2N more steps alternating the two forwards and prints the medians
of the learner stage's time (the rollout does not depend on it).

torch.profiler's CPU memory events (``profile_memory=True``) give every allocation and free with
its op and Python frame; pairing them by address gives the live set at each moment. Blocks
allocated before the profiled step (weights, optimizer moments, the engine's caches) are not
counted: the figure is what the step adds on top of them.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
from contextlib import contextmanager

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from materl.engines import decoder_forward

sys.path.insert(0, os.path.dirname(__file__))
import vs_trl  # the same materl step as the TRL comparison

LEAN_SUPPORTS = decoder_forward.supports


@contextmanager
def forward(lean: bool):
    """The learner's decoder forward (``lean``) or HF's plain decoder calls."""
    decoder_forward.supports = LEAN_SUPPORTS if lean else (lambda lm: False)
    try:
        yield
    finally:
        decoder_forward.supports = LEAN_SUPPORTS


def allocations(prof) -> list[tuple[int, int, int, object]]:
    """(time ns, address, signed bytes, event) of every allocation (+) and free (-), in time order."""
    out = []

    def walk(event):
        if event.tag == _EventType.Allocation:
            f = event.extra_fields
            out.append((event.start_time_ns, f.ptr, f.alloc_size, event))
        for child in event.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    return sorted(out, key=lambda a: a[0])


def site(event) -> str:
    """The op that allocated, and the nearest materl / transformers / autograd frame above it."""
    names, parent = [], event.parent
    while parent is not None and len(names) < 40:
        names.append(parent.name)
        parent = parent.parent
    frames = [n for n in names if "materl/" in n or "transformers/models" in n or "torch/optim" in n
              or "autograd::engine" in n]
    return f"{names[0] if names else '?'} <- {frames[0] if frames else (names[-1] if names else '')}"


def peak_of_step(ours, top: int) -> tuple[float, float, list[tuple[str, int]]]:
    """Profile one step: (peak MiB of live bytes allocated in it, where in the step, top sites)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
        ours.step()
    events = allocations(prof)
    live, now, peak, peak_t, peak_live = {}, 0, 0, 0, {}
    for t, ptr, size, event in events:
        if size > 0:
            live[ptr] = (size, event)
            now += size
        else:
            now -= live.pop(ptr, (-size, None))[0]  # a block from before the step: freed here
        if now > peak:
            peak, peak_t, peak_live = now, t, dict(live)
    by_site = collections.Counter()
    for size, event in peak_live.values():
        by_site[site(event)] += size
    t0, t1 = events[0][0], events[-1][0]
    return peak / 2**20, (peak_t - t0) / (t1 - t0), by_site.most_common(top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["full", "lora"], default="full")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--time-steps", type=int, default=0)
    a = ap.parse_args()
    torch.manual_seed(vs_trl.SEED)
    ours = vs_trl.Materl(a.mode == "lora")
    for _ in range(a.warmup):
        ours.step()
    peaks = {}
    for lean in (False, True):
        with forward(lean):
            peak, when, sites = peak_of_step(ours, a.top)
        peaks[lean] = peak
        print(f"[{a.mode}] {'decoder_forward' if lean else 'HF decoder calls'}: peak of live bytes allocated in "
              f"the step {peak:.1f} MiB, at {when:.0%} of the step")
        for name, size in sites:
            print(f"{size / 2**20:8.1f} MiB  {name}")
    print(f"\n[{a.mode}] peak, HF decoder calls / decoder_forward: {peaks[False]:.1f} / {peaks[True]:.1f} MiB "
          f"({peaks[True] - peaks[False]:+.1f} MiB)")
    if a.time_steps:
        times = {False: [], True: []}
        for i in range(2 * a.time_steps):
            lean = i % 2 == 1
            with forward(lean):
                times[lean].append(ours.step()["time/stage/learner"])
        plain, lean = (statistics.median(times[k]) for k in (False, True))
        print(f"[{a.mode}] learner stage, median of {a.time_steps} alternating steps: HF decoder calls {plain:.3f} s, "
              f"decoder_forward {lean:.3f} s (HF / decoder_forward {plain / lean:.3f}x)")


if __name__ == "__main__":
    main()
