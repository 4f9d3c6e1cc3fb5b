"""Mojo kernels vs their alternatives, side by side. One run prints a markdown table of ratios:

1. reward kernels (repetition n=3, diversity n=1, length, pattern match) at B=64, T=256 vs the
   pure-Python built-ins (``materl.ops.reward_builtins``, on B lists) and vs vectorised torch;
2. the fused policy loss (forward + backward) vs the torch op path (loss op -> LOSS_AGG ->
   kl_penalty, autograd): time and peak memory (allocator events seen by the torch profiler,
   op granularity, inputs excluded, the (B,T) gradient included in both);
3. a fused reward chain (repetition + diversity + length + pattern) vs the same rewards called
   separately (Mojo each, torch each, Python built-ins).

    python benchmarks/kernels.py [--threads 1] [--loss-T 1024] [--repeat 30]

Times are medians. The Mojo kernels are single-threaded; torch runs with ``--threads`` threads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("MODULAR_TELEMETRY_ENABLED", "0")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from materl.kernels import loader  # noqa: E402
from materl.kernels import rewards as R  # noqa: E402
from materl.kernels.fusion import RewardChain  # noqa: E402
from materl.kernels.policy_loss import fused_policy_loss, policy_loss_torch  # noqa: E402
from materl.ops import reward_builtins as RB  # noqa: E402


def timeit(fn, *, repeat: int, min_s: float = 0.002) -> float:
    """Median seconds per call; each sample runs enough calls to last ``min_s``."""
    fn()
    n, t0 = 1, time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    n = max(1, int(min_s / once))
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n)
    return statistics.median(samples)


def peak_bytes(fn) -> int:
    """Peak extra bytes held during ``fn`` (CPU allocator events, op granularity)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage)
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def fmt_t(s: float) -> str:
    return f"{s * 1e6:.0f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def batch(B: int, T: int, vocab: int = 500, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    # Zipf-ish ids so n-grams do repeat
    ids = (torch.rand(B, T, generator=g) ** 3 * vocab).long()
    rows = [ids[b, : lengths[b]].tolist() for b in range(B)]
    return rows, ids, lengths


def python_pattern(rows, pattern):
    m = len(pattern)
    return [float(any(r[j:j + m] == pattern for j in range(len(r) - m + 1))) for r in rows]


def reward_rows(args, table):
    rows, ids, lengths = batch(args.B, args.T)
    pattern = rows[0][10:13]
    cases = {
        "repetition (n=3)": (lambda: RB.repetition(completion_ids=rows, n=3),
                             lambda impl: R.repetition(ids, lengths, n=3, impl=impl)),
        "diversity (n=1)": (lambda: RB.diversity(completion_ids=rows, n=1),
                            lambda impl: R.diversity(ids, lengths, n=1, impl=impl)),
        "length (target=128)": (lambda: RB.length(completion_ids=rows, target=128),
                                lambda impl: R.length(lengths, target=128, impl=impl)),
        "pattern match (3 tokens)": (lambda: python_pattern(rows, pattern),
                                     lambda impl: R.pattern_match(ids, lengths, pattern, impl=impl)),
    }
    for name, (py, kern) in cases.items():
        assert torch.equal(kern("mojo"), torch.tensor(py(), dtype=torch.float64)), name
        t_py = timeit(py, repeat=args.repeat)
        t_torch = timeit(lambda kern=kern: kern("torch"), repeat=args.repeat)
        t_mojo = timeit(lambda kern=kern: kern("mojo"), repeat=args.repeat)
        table.append((f"reward: {name}", f"B={args.B} T={args.T}", fmt_t(t_py), fmt_t(t_torch), fmt_t(t_mojo),
                      f"{t_py / t_mojo:.0f}x", f"{t_torch / t_mojo:.1f}x", ""))
    t_pad = timeit(lambda: R.pad_ids(rows), repeat=args.repeat)
    table.append(("(pad_ids: B lists -> tensors, paid once per batch)", "", "", "", fmt_t(t_pad), "", "", ""))


def chain_rows(args, table):
    rows, ids, lengths = batch(args.B, args.T, seed=1)
    pattern = rows[1][5:8]
    terms = [("repetition", {"n": 3}, -0.5), ("diversity", {"n": 1}, 0.3), ("length", {"target": 128}, 0.2),
             ("pattern_match", {"pattern": pattern}, 1.0)]
    chain = RewardChain(terms)
    fused_total, _ = chain(ids, lengths, impl="mojo")
    sep_total, _ = chain.separate(ids, lengths, impl="mojo")
    assert torch.equal(fused_total, sep_total)

    def python_chain():
        parts = [RB.repetition(completion_ids=rows, n=3), RB.diversity(completion_ids=rows, n=1),
                 RB.length(completion_ids=rows, target=128), python_pattern(rows, pattern)]
        return [sum(w * p[i] for (_, _, w), p in zip(terms, parts)) for i in range(len(rows))]

    t_py = timeit(python_chain, repeat=args.repeat)
    t_torch = timeit(lambda: chain.separate(ids, lengths, impl="torch"), repeat=args.repeat)
    t_sep = timeit(lambda: chain.separate(ids, lengths, impl="mojo"), repeat=args.repeat)
    t_fused = timeit(lambda: chain(ids, lengths, impl="mojo"), repeat=args.repeat)
    table.append(("reward chain: 4 rewards fused (1 call)", f"B={args.B} T={args.T}", fmt_t(t_py), fmt_t(t_torch),
                  fmt_t(t_fused), f"{t_py / t_fused:.0f}x", f"{t_torch / t_fused:.1f}x",
                  f"vs 4 Mojo calls {fmt_t(t_sep)}: {t_sep / t_fused:.1f}x"))


def loss_rows(args, table):
    B, T = args.B, args.loss_T
    g = torch.Generator().manual_seed(0)
    logp = (torch.randn(B, T, generator=g) * 0.5 - 1).requires_grad_()
    old = logp.detach() + 0.1 * torch.randn(B, T, generator=g)
    ref = logp.detach() + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    mask = (torch.arange(T)[None, :] < torch.randint(T // 4, T + 1, (B, 1), generator=g)).float()
    settings = {
        "ppo_clip + token_mean + k3 (GRPO/DAPO)": dict(loss="ppo_clip", agg="token_mean", kl="k3", kl_coef=0.04,
                                                       eps_high=0.28),
        "gspo + seq_mean_token_mean": dict(loss="gspo", agg="seq_mean_token_mean"),
        "cispo + token_mean + k1": dict(loss="cispo", agg="token_mean", kl="k1", kl_coef=0.01),
        "ppo_clip + k3 as TRL (no clamp, bias-corrected) + TIS weights": dict(
            loss="ppo_clip", agg="token_mean", kl="k3", kl_coef=0.04, kl_clamp=None, kl_bias_correction=True,
            weights=(torch.exp(old - logp.detach()).clamp(max=2.0) * mask)),
    }
    for name, kw in settings.items():
        def run(fn, extra, kw=kw):
            logp.grad = None
            value, _ = fn(logp, old, adv, mask, ref_logp=ref, **kw, **extra)
            value.backward()

        run(fused_policy_loss, {"impl": "mojo"})
        g_fused = logp.grad.clone()
        run(policy_loss_torch, {})
        assert torch.allclose(g_fused, logp.grad, rtol=1e-4, atol=1e-7), name
        t_torch = timeit(lambda: run(policy_loss_torch, {}), repeat=args.repeat)
        t_mojo = timeit(lambda: run(fused_policy_loss, {"impl": "mojo"}), repeat=args.repeat)
        logp.grad = None
        m_torch = peak_bytes(lambda: run(policy_loss_torch, {}))
        logp.grad = None
        m_mojo = peak_bytes(lambda: run(fused_policy_loss, {"impl": "mojo"}))
        table.append((f"loss fwd+bwd: {name}", f"B={B} T={T} fp32", "", fmt_t(t_torch), fmt_t(t_mojo), "",
                      f"{t_torch / t_mojo:.1f}x",
                      f"peak mem {m_torch / 2**20:.1f} -> {m_mojo / 2**20:.1f} MiB "
                      f"({m_torch / max(m_mojo, 1):.1f}x less)"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (Mojo kernels use one)")
    p.add_argument("--B", type=int, default=64)
    p.add_argument("--T", type=int, default=256, help="reward batch width")
    p.add_argument("--loss-T", type=int, default=1024, help="policy-loss sequence length")
    p.add_argument("--repeat", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(loader.status_table(), end="\n\n")
    table: list[tuple[str, ...]] = []
    reward_rows(args, table)
    chain_rows(args, table)
    loss_rows(args, table)
    head = ("benchmark", "shape", "python", "torch", "mojo", "vs python", "vs torch", "notes")
    print(f"torch {torch.__version__}, {args.threads} torch thread(s); medians of {args.repeat}\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for row in table:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
