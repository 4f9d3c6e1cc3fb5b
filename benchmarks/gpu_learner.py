"""GPU rows for long episodes and big models (issue #39), run by ``benchmarks/gpu_check.py``
(``scale_rows``; ``--skip scale`` leaves them out) or alone:

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/gpu_learner.py            # on the GPU machine
    python benchmarks/gpu_learner.py --dry-run                             # CPU, tiny shapes

Qwen2-shaped models from configs with random weights (seeded, built on the device: nothing is
downloaded), fp32 master weights, bf16 autocast, one GRPO learner step (prepare + update + one
optimizer step) on episodes made from random ids (``learner_packing.episodes``; no rollout):

1. 7B shape (hidden 3584, 28 layers, GQA 28/4, MLP 18944, vocab 152064), full fine-tuning, 8
   episodes of 4,096 tokens, gradient checkpointing + ``adamw_8bit`` + packing: fits? peak.
2. 1.5B shape (hidden 1536, 28 layers, GQA 12/2, MLP 8960, vocab 151936), episodes of 16,384
   tokens with gradient checkpointing and packing: fits? peak.
3. 1.5B, 32 episodes of 256..4,096 tokens: packed (16,384 tokens a micro-batch) vs padded (4 rows
   a micro-batch), time and peak each, one warm-up step each first.
4. 1.5B, 8 of those episodes: ``adamw_8bit`` vs ``adamw``, time (second step: torchao compiles
   its update in the first) and peak.

The 7B and 1.5B steps train without a reference (GRPO with beta 0, as DAPO and Dr. GRPO do), so
the peak is the policy's: weights 4 + gradients 4 + AdamW state 8 (or ~2 in 8 bits) bytes a
parameter, plus activations. Peak is ``torch.cuda.max_memory_allocated`` (CPU: peak RSS).
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learner_packing import episodes, run_learner  # noqa: E402

SHAPES = {
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
}
# (full, dry-run) sizes
LONG = {"7b": (8, 4096), "1.5b": (2, 16384)}
DRY_LONG = (4, 256)


def policy(shape: str, device: torch.device):
    """A trainable Agent around a random-weight Qwen2 of ``shape`` on ``device`` (fp32 weights)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import materl as ml
    from materl.engines.tiny import byte_tokenizer

    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    return ml.Agent(model, trainable=True, tokenizer=byte_tokenizer(config.vocab_size), device=device,
                    engine="transformers", name=f"qwen2-{shape}-random")


def peak_reset(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # process peak RSS


def step(agent, eps, device: torch.device, **options) -> tuple[float, float, float]:
    """(seconds, peak GiB, loss) of one learner step of ``agent`` over ``eps``."""
    peak_reset(device)
    seconds, metrics = run_learner({"policy": agent, "ref_policy": agent}, eps,
                                   dict(lr=1e-6, seed=0, group_size=4, **options), kl=False)
    return seconds, peak_gb(device), metrics["loss"]


def long_row(report, shape: str, device: torch.device, *, dry: bool, **options) -> None:
    s = "tiny" if dry else shape
    n, length = DRY_LONG if dry else LONG[shape]
    agent = policy(s, device)
    eps = episodes(n, [length] * n, SHAPES[s]["vocab_size"], 0)
    what = ", ".join(f"{k}={v}" for k, v in options.items())
    seconds, peak, loss = step(agent, eps, device, **options)
    report.add("scale", f"{shape}{' (tiny)' if dry else ''}: {n} x {length} tokens, full FT, {what}",
               f"fits: peak {peak:.1f} GiB, step {seconds:.1f} s (loss {loss:.4f})")
    del agent
    peak_reset(device)


def packed_vs_padded(report, agent, eps, device: torch.device, *, budget: int, label: str) -> None:
    out = {}
    for name, options in (("padded", {"micro_batch_size": 4}), ("packed", {"max_tokens_per_micro_batch": budget})):
        step(agent, eps[:4], device, **options)  # warm-up: allocator, kernels
        out[name] = step(agent, eps, device, **options)
        report.add("scale", f"{label}: {name} ({options})",
                   f"{out[name][0]:.2f} s, peak {out[name][1]:.1f} GiB (loss {out[name][2]:.6f})")
    report.add("scale", f"{label}: packed vs padded", f"{out['padded'][0] / out['packed'][0]:.2f}x faster, peak "
               f"{out['packed'][1] / out['padded'][1]:.2f}x")


def optimizer_rows(report, agent, eps, device: torch.device, *, label: str) -> None:
    out = {}
    for name in ("adamw", "adamw_8bit"):
        step(agent, eps, device, optimizer=name, max_tokens_per_micro_batch=16384)  # 8-bit: torchao compiles here
        out[name] = step(agent, eps, device, optimizer=name, max_tokens_per_micro_batch=16384)
        report.add("scale", f"{label}: optimizer={name}", f"{out[name][0]:.2f} s, peak {out[name][1]:.1f} GiB")
    report.add("scale", f"{label}: adamw_8bit vs adamw", f"time {out['adamw_8bit'][0] / out['adamw'][0]:.2f}x, "
               f"peak {out['adamw_8bit'][1] / out['adamw'][1]:.2f}x")


def scale_rows(report, device: torch.device, *, dry_run: bool) -> None:
    """Every row above (tiny shapes and short episodes under ``dry_run``)."""
    report.guarded("scale", "7b fits", lambda: long_row(
        report, "7b", device, dry=dry_run, gradient_checkpointing=True, optimizer="adamw_8bit",
        max_tokens_per_micro_batch=128 if dry_run else 8192))
    report.guarded("scale", "1.5b long episodes", lambda: long_row(
        report, "1.5b", device, dry=dry_run, gradient_checkpointing=True,
        max_tokens_per_micro_batch=256 if dry_run else 16384))

    def uneven():
        shape = "tiny" if dry_run else "1.5b"
        agent = policy(shape, device)
        gen = torch.Generator().manual_seed(0)
        low, high = (16, 128) if dry_run else (256, 4096)
        lengths = torch.randint(low, high + 1, (32,), generator=gen).tolist()
        eps = episodes(32, lengths, SHAPES[shape]["vocab_size"], 0)
        label = f"{shape}: 32 episodes {low}..{high} ({sum(lengths)} tokens)"
        packed_vs_padded(report, agent, eps, device, budget=4 * high, label=label)
        optimizer_rows(report, agent, eps[:8], device, label=f"{shape}: 8 episodes")

    report.guarded("scale", "1.5b packed vs padded, optimizers", uneven)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, short episodes")
    ap.add_argument("--budget-s", type=float, default=420.0)
    args = ap.parse_args()
    from gpu_check import Report

    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    report = Report(args.budget_s)
    scale_rows(report, device, dry_run=args.dry_run)
    print(report.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
