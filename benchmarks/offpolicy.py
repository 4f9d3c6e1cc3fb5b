"""What an off-policy correction costs, and how large the engine-vs-learner mismatch is.

Two compiled GRPO steps in one process, stepped alternately on the same prompts: the plain recipe
(old log-probs = the engine's sampling log-probs) and the same recipe under
``ml.with_off_policy_correction(..., "tis", cap=2.0)`` (one more no-gradient forward of the policy
in learner prepare, the proximal log-probs, and weights in the fused loss). Prints medians of the
per-stage times after ``--warmup`` steps, their ratio, and the mismatch metrics each step reports
(``mismatch/*``: the learner's log-probs of the sampled tokens against the engine's). The recipe
is ``materl.recipes.grpo`` with a length reward and no reference term (as ``vs_trl.py``), so the
only difference between the two is the correction.

    OMP_NUM_THREADS=2 python benchmarks/offpolicy.py --model smollm2-135m-instruct --steps 6
    OMP_NUM_THREADS=1 python benchmarks/offpolicy.py --model tiny-random --steps 30
"""

from __future__ import annotations

import argparse
import statistics

import materl as ml
from materl.recipes import grpo

PROMPTS = ["Write a short poem about the sea.", "Explain what a CPU does.", "Give me three fruit names.",
           "Describe your favourite season.", "Tell me a fun fact about cats.", "What is a good breakfast?"]
STAGES = ("time/step", "time/stage/rollout", "time/stage/prepare", "time/stage/learner")
MISMATCH = ("mismatch/mean_abs", "mismatch/max_abs", "mismatch/kl", "mismatch/kl_k1", "policy_loss/is_weight",
            "policy_loss/is_truncated")


def length_reward(completions, **_) -> list[float]:
    return [len(c) / 100.0 for c in completions]


def build(model: str, correction: bool, args) -> ml.Compiled:
    recipe = ml.replace(grpo, "rewards", lambda g: ml.reward(length_reward))
    recipe = ml.replace(recipe, "policy_loss", lambda g: ml.grpo_loss(g.advantages, g.policy_logprobs))
    if correction:
        recipe = ml.with_off_policy_correction(recipe, "tis", cap=2.0)
    policy = ml.Agent(model, trainable=True)
    # ref_logprobs is pruned; binding the policy as ref_policy loads nothing more (see vs_trl.py)
    return ml.compile(recipe, policy=policy, ref_policy=policy, group_size=args.group,
                      max_new_tokens=args.new_tokens, lr=1e-6, seed=0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prompts", type=int, default=2, help="prompts per step (x group = episodes)")
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args()
    steps = {"plain": build(args.model, False, args), "tis": build(args.model, True, args)}
    seen: dict[str, list[dict]] = {k: [] for k in steps}
    for i in range(args.warmup + args.steps):
        prompts = [PROMPTS[(i * args.prompts + k) % len(PROMPTS)] for k in range(args.prompts)]
        for name, step in steps.items():
            metrics = step.run(prompts)
            if i >= args.warmup:
                seen[name].append(metrics)
    for step in steps.values():
        step.close()

    def med(name, key):
        values = [m[key] for m in seen[name] if key in m]
        return statistics.median(values) if values else float("nan")

    print(f"model {args.model}; {args.prompts} prompts x {args.group} = {args.prompts * args.group} episodes, "
          f"{args.new_tokens} new tokens; medians of {args.steps} steps after {args.warmup} warm-up\n")
    print("| stage | plain (s) | tis (s) | tis / plain | tis - plain (s) |\n|---|---|---|---|---|")
    for key in STAGES:
        a, b = med("plain", key), med("tis", key)
        print(f"| {key} | {a:.3f} | {b:.3f} | {b / a:.2f}x | {b - a:+.3f} |")
    print("\n| metric | plain (the update's forward) | tis (recomputed) |\n|---|---|---|")
    for key in MISMATCH:
        cells = [med(name, key) for name in ("plain", "tis")]
        print(f"| {key} | " + " | ".join("-" if v != v else f"{v:.3g}" for v in cells) + " |")  # nan: not reported


if __name__ == "__main__":
    main()
