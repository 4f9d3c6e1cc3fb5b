"""GRPO toward friendly, clean text: the sentiment and toxicity rewards (packaged lexicons, Mojo
kernels where Mojo is installed) on the tiny random model, or on SmolLM2 with --model.

    python examples/text_rewards_rl.py                    # 2 steps on tiny-random (seconds; CI runs this)
    python examples/text_rewards_rl.py --model smollm2-135m-instruct --steps 20

Each step prints the mean of each reward term: ``sentiment`` is 1 - |c - 1| = c, VADER's compound
score in [-1, 1]; ``toxicity`` is minus the share of words on better-profanity's list, in [-1, 0].
"""

from __future__ import annotations

import argparse

import materl as ml

PROMPTS = ["Write one sentence about your day.", "Describe the weather.", "Say something to a friend.",
           "Review the last film you saw."]


@ml.recipe
def friendly_grpo(policy, ref_policy, prompts):
    completions = ml.generate(policy, prompts, name="completions")
    policy_logprobs = ml.logprobs(policy, prompts, completions, name="policy_logprobs")
    ref_logprobs = ml.logprobs(ref_policy, prompts, completions, name="ref_logprobs")
    rewards = ml.reward("sentiment", target="positive", weight=0.7) + ml.reward("toxicity", weight=0.3)
    advantages = ml.advantages(rewards, name="advantages")
    ml.set_loss(ml.grpo_loss(advantages, policy_logprobs, ref_logprobs))


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args(argv)
    step = ml.compile(friendly_grpo, policy=ml.Agent(args.model, trainable=True), ref_policy=ml.Agent(args.model),
                      group_size=4, max_new_tokens=24, lr=1e-5, seed=0)
    print(step.explain().splitlines()[0])
    history = []
    for k in range(args.steps):
        m = step.run(prompts=PROMPTS[:2])
        history.append(m)
        print(f"step {k} reward {m['reward']:.4f} sentiment {m['reward/sentiment/mean']:.4f} "
              f"toxicity {m['reward/toxicity/mean']:.4f}")
    step.close()
    return history


if __name__ == "__main__":
    main()
