"""Compare implementations of an op side by side , in one process, as ratios.

    from materl.benchmark import compare_implementations
    print(compare_implementations("repetition", implementations=["python", "torch", "mojo"],
                                  batch_sizes=[16, 64]))

``materl bench kernels`` prints the table for every kernel op. Times are medians of ``repeat``
runs; the machine is shared, so read the ratios, not the absolute times.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from materl.errors import ConfigError


def _reward_case(op: str, B: int, T: int):
    from materl.kernels import rewards as K
    from materl.ops import reward_builtins as P

    gen = torch.Generator().manual_seed(0)
    lists = [torch.randint(0, 64, (int(torch.randint(T // 2, T + 1, (1,), generator=gen)),), generator=gen).tolist()
             for _ in range(B)]
    ids, lengths = K.pad_ids(lists)
    kernel = {"repetition": lambda impl: K.repetition(ids, lengths, impl=impl),
              "diversity": lambda impl: K.diversity(ids, lengths, impl=impl),
              "pattern_match": lambda impl: K.pattern_match(ids, lengths, [1, 2, 3], impl=impl)}[op]
    python = {"repetition": lambda: P.repetition(completion_ids=lists),
              "diversity": lambda: P.diversity(completion_ids=lists),
              "pattern_match": lambda: [float(any(r[i:i + 3] == [1, 2, 3] for i in range(len(r)))) for r in lists]}[op]
    return {"python": python, "torch": lambda: kernel("torch"), "mojo": lambda: kernel("mojo")}


def _loss_case(B: int, T: int):
    from materl.kernels.policy_loss import fused_policy_loss

    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(B, T, generator=gen)
    adv = torch.randn(B, T, generator=gen)
    mask = (torch.rand(B, T, generator=gen) > 0.1).float()

    def run(impl):
        logp = (old + 0.05 * torch.randn(B, T, generator=gen)).requires_grad_()
        loss, _ = fused_policy_loss(logp, old, adv, mask, ref_logp=old, kl_coef=0.01, impl=impl)
        loss.backward()

    return {"torch": lambda: run("torch"), "mojo": lambda: run("mojo")}


CASES: dict[str, Callable] = {
    "repetition": lambda B, T: _reward_case("repetition", B, T),
    "diversity": lambda B, T: _reward_case("diversity", B, T),
    "pattern_match": lambda B, T: _reward_case("pattern_match", B, T),
    "policy_loss": _loss_case,
}


def _median_time(fn: Callable, repeat: int) -> float:
    fn()  # warm up (builds the kernel on first use)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compare_implementations(op: str, implementations: Sequence[str] = ("torch", "mojo"),
                            batch_sizes: Sequence[int] = (64,), *, length: int = 256, repeat: int = 20) -> str:
    """A markdown table: median time per implementation and batch size, and each one's speed-up
    over the first implementation listed."""
    if op not in CASES:
        raise ConfigError(f"compare_implementations: unknown op {op!r}; ops: {', '.join(CASES)}")
    rows = [f"| {op} | B | T | " + " | ".join(implementations) + " | " +
            " | ".join(f"{impl} vs {implementations[0]}" for impl in implementations[1:]) + " |",
            "|---" * (3 + 2 * len(implementations) - 1) + "|"]
    for B in batch_sizes:
        case = CASES[op](B, length)
        unknown = [i for i in implementations if i not in case]
        if unknown:
            raise ConfigError(f"{op}: no implementation {unknown}; available: {', '.join(case)}")
        times = [_median_time(case[impl], repeat) for impl in implementations]
        cells = " | ".join(f"{t * 1e6:.0f} us" for t in times)
        ratios = " | ".join(f"{times[0] / t:.1f}x" for t in times[1:])
        rows.append(f"| | {B} | {length} | {cells} | {ratios} |")
    return "\n".join(rows)


def main_kernels() -> int:
    """``materl bench kernels``: the status table, then each op's implementations side by side
    (without Mojo, the Python and torch columns only, and a line saying why)."""
    from materl.kernels import loader, status_table

    print(status_table())
    mojo = loader.load_or_reason("rewards")[0] is not None
    if not mojo:
        print("\nmojo is unavailable (see above): timing the python and torch implementations only")
    for op in ("repetition", "diversity", "pattern_match"):
        print(compare_implementations(op, ["python", "torch", "mojo"] if mojo else ["python", "torch"], [16, 64]))
        print()
    print(compare_implementations("policy_loss", ["torch", "mojo"] if mojo else ["torch"], [16, 64], length=1024))
    return 0
