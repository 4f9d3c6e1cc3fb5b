"""The learner step on long, uneven episodes: packed vs padded micro-batches, and peak memory
with gradient checkpointing vs without (SmolLM2-135M-Instruct, full fine-tuning, GRPO loss with a
k3 KL to a frozen reference, so prepare runs the reference forward too).

    OMP_NUM_THREADS=2 python benchmarks/learner_packing.py --part time     # 32 episodes, 32..1024 tokens
    OMP_NUM_THREADS=2 python benchmarks/learner_packing.py --part memory   # 2048-token episodes, RSS
    python benchmarks/learner_packing.py --model tiny-random --episodes 8 --max-len 128 --long 256   # smoke run

The rollout is not run: episodes are made from random token ids of the drawn lengths (a
16-token prompt shared by each group of 4, the rest one model turn), so the figure is the
learner's alone. ``time``: one learner step (prepare + update, one optimizer step) per layout,
in one process, side by side. ``memory``: each configuration in its own process (peak RSS,
``ru_maxrss``, weights and AdamW state included), the same episodes, one row per micro-batch.
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import subprocess
import sys
import time

import torch

PROMPT, GROUP = 16, 4


def episodes(n: int, lengths: list[int], vocab: int, seed: int):
    """``n`` episodes whose prompt + completion lengths are ``lengths``, with random ids,
    sampling log-probs and per-token advantages: what the learner reads after a rollout."""
    from materl.compiler.episode import Episode, Outputs
    from materl.rollout.types import Rollout, Step

    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        if i % GROUP == 0:
            prompt = torch.randint(100, vocab, (PROMPT,), generator=gen).tolist()
        comp = torch.randint(100, vocab, (lengths[i] - PROMPT,), generator=gen).tolist()
        ep = Episode(i, i // GROUP, i // GROUP, "p", {}, seed=i)
        ep.store("prompts", "p")
        ep.store("completions", Rollout(prompt, [Step("generate", comp, [-2.0] * len(comp))]))
        ep.store("rewards", float(i % 3))
        adv = torch.full((len(comp),), float(i % 3) - 1.0)
        ep.store("advantages", Outputs({"advantages": adv, "returns": adv}))
        out.append(ep)
    return out


@functools.cache
def recipe(kl: bool = True):
    """GRPO's learner side: the policy's log-probs, the advantages, and (``kl``) a k3 KL to a frozen
    reference (prepare then runs the reference's forward)."""
    import materl as ml

    @ml.recipe
    def grpo(policy, ref_policy, prompts):
        completions = ml.generate(policy, prompts, name="completions")
        logp = ml.logprobs(policy, prompts, completions, name="policy_logprobs")
        ref = ml.logprobs(ref_policy, prompts, completions, name="ref_logprobs") if kl else None
        adv = ml.advantages(ml.reward("length", name="rewards"), name="advantages")
        ml.set_loss(ml.policy_loss(adv, logp, ref, kl="k3" if kl else None, kl_coef=0.04 if kl else 0.0))

    return grpo


def run_learner(agents: dict, eps, options: dict, *, kl: bool = True) -> tuple[float, dict]:
    """Seconds of one learner step (prepare + update + optimizer step) over ``eps`` and its metrics."""
    from materl.compiler.compiled import Compiled
    from materl.compiler.context import StageEnv
    from materl.compiler.learner import Learner
    from materl.compiler.options import CompileOptions

    compiled = Compiled(recipe(kl), agents, CompileOptions(**options))
    try:
        learner = Learner(StageEnv(compiled.context(), agents), eps, compiled.optimizer_set)
        t0 = time.perf_counter()
        compiled.call_blocking(learner.prepare)
        metrics = learner.run_updates()
        if agents["policy"].device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, metrics
    finally:
        agents["policy"].set_gradient_checkpointing(False)
        compiled.close()


_AGENTS: dict = {}


def learner_step(model: str, eps, options: dict) -> tuple[float, dict]:
    """``run_learner`` with the named model as policy and reference (loaded once per process)."""
    import materl as ml

    if model not in _AGENTS:
        _AGENTS[model] = {"policy": ml.Agent(model, trainable=True, engine="transformers"),
                          "ref_policy": ml.Agent(model, engine="transformers")}
    return run_learner(_AGENTS[model], eps, options)


def part_time(args) -> None:
    gen = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.episodes,), generator=gen).tolist()
    vocab = 49152 if "smollm2" in args.model else 512
    eps = episodes(args.episodes, lengths, vocab, args.seed)
    base = dict(lr=1e-6, seed=args.seed, group_size=GROUP)
    rows = {"padded": {**base, "micro_batch_size": args.micro},
            "packed": {**base, "max_tokens_per_micro_batch": args.budget}}
    print(f"{args.episodes} episodes, lengths {min(lengths)}..{max(lengths)} (mean {sum(lengths) / len(lengths):.0f}, "
          f"{sum(lengths)} tokens); padded: micro_batch_size={args.micro}; packed: max_tokens_per_micro_batch="
          f"{args.budget}")
    warm = episodes(GROUP, [PROMPT + 48] * GROUP, vocab, args.seed)
    for options in rows.values():  # first-call costs (model load, allocator growth) outside the figures
        learner_step(args.model, warm, options)
    seconds, losses = {}, {}
    for name, options in rows.items():
        seconds[name], m = learner_step(args.model, eps, options)
        losses[name] = m["loss"]
        print(f"  {name:7s} learner step {seconds[name]:8.2f} s   loss {m['loss']:.6f}")
    print(f"  packed vs padded: {seconds['padded'] / seconds['packed']:.2f}x faster (same loss to "
          f"{abs(losses['packed'] - losses['padded']):.1e})")


def part_memory(args) -> None:
    out = {}
    for ckpt in (False, True):
        cmd = [sys.executable, __file__, "--one-memory", json.dumps({"ckpt": ckpt, "model": args.model,
                                                                     "long": args.long, "n": args.long_episodes})]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise SystemExit(res.stderr[-3000:])
        out[ckpt] = json.loads(res.stdout.strip().splitlines()[-1])
        print(f"  gradient_checkpointing={ckpt!s:5s} peak RSS {out[ckpt]['peak_mb']:8.0f} MiB   step "
              f"{out[ckpt]['seconds']:7.2f} s   loss {out[ckpt]['loss']:.6f}")
    print(f"  {args.long_episodes} episodes of {args.long} tokens, one per micro-batch: peak RSS with checkpointing "
          f"{out[True]['peak_mb'] / out[False]['peak_mb']:.2f}x without; step time "
          f"{out[True]['seconds'] / out[False]['seconds']:.2f}x")


def one_memory(spec: dict) -> None:
    vocab = 49152 if "smollm2" in spec["model"] else 512
    eps = episodes(spec["n"], [spec["long"]] * spec["n"], vocab, 0)
    options = dict(lr=1e-6, seed=0, group_size=GROUP, micro_batch_size=1, gradient_checkpointing=spec["ckpt"])
    seconds, m = learner_step(spec["model"], eps, options)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"peak_mb": peak, "seconds": seconds, "loss": m["loss"]}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["time", "memory", "both"], default="both")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--micro", type=int, default=4, help="padded: rows per micro-batch")
    p.add_argument("--budget", type=int, default=4096, help="packed: tokens per micro-batch")
    p.add_argument("--long", type=int, default=2048, help="memory: tokens per episode")
    p.add_argument("--long-episodes", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--one-memory", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(int(__import__("os").environ.get("OMP_NUM_THREADS", "2")))
    if args.one_memory:
        return one_memory(json.loads(args.one_memory))
    if args.part in ("time", "both"):
        part_time(args)
    if args.part in ("memory", "both"):
        part_memory(args)


if __name__ == "__main__":
    main()
