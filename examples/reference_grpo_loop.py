"""GRPO written by hand with materl.ops — no recipe, no compiler — so a reader sees every step.

The compiled ``recipes/grpo.py`` must give the same numbers: tests/compiler/test_reference_loop.py
feeds the same rollouts to ``grpo_update`` below and to the compiled learner and compares the
loss and the parameter update. Shapes live in names: B rows (prompts x group), T tokens.

    python examples/reference_grpo_loop.py          # a few steps on the tiny random model
"""

from __future__ import annotations

import anyio
import torch

from materl.engines.base import SamplingParams
from materl.ops.advantages import ADVANTAGES
from materl.ops.aggregate import LOSS_AGG
from materl.ops.kl import kl_penalty
from materl.ops.logprobs import token_logprobs
from materl.ops.losses import POLICY_LOSSES
from materl.ops.rewards import Reward
from materl.rollout.multiturn import EpisodeState


def pad(rows: list[list], value=0, dtype=torch.long) -> torch.Tensor:
    out = torch.full((len(rows), max(len(r) for r in rows)), value, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out


def completion_logprobs(agent, prompt_ids: list[list[int]], completion_ids: list[list[int]], *, temperature=1.0):
    """log pi(token) of every completion token (B,T): right-padded prompt+completion, and the hidden
    state that predicts completion token t of row i sits at len(prompt_i) - 1 + t."""
    seqs = [p + c for p, c in zip(prompt_ids, completion_ids)]
    input_ids = pad(seqs, agent.tokenizer.pad_token_id)
    attention = pad([[1] * len(s) for s in seqs])
    hidden_B_L_H = agent.hidden_states(input_ids, attention)
    where_B_T = pad([[len(p) - 1 + t for t in range(len(c))] for p, c in zip(prompt_ids, completion_ids)])
    hidden_B_T_H = hidden_B_L_H.gather(1, where_B_T[..., None].expand(-1, -1, hidden_B_L_H.shape[-1]))
    weight, bias = agent.output_embedding()
    return token_logprobs(hidden_B_T_H, weight, pad(completion_ids), bias=bias, temperature=temperature)


def grpo_update(policy, ref_policy, optimizer, prompt_ids, completion_ids, old_logp_rows, rewards_B, group_ids,
                *, clip=0.2, kl_coef=0.04, max_grad_norm=1.0) -> float:
    """One GRPO step on given rollouts: group advantages, clipped surrogate averaged per sequence,
    k3 KL to the reference, one optimizer step. Returns the loss."""
    mask_B_T = pad([[1] * len(c) for c in completion_ids], dtype=torch.float32)
    advantages_B_T, _ = ADVANTAGES.get("grpo")(rewards_B.double(), mask_B_T.double(), group_ids=group_ids)
    old_logp_B_T = pad(old_logp_rows, dtype=torch.float32)
    with torch.no_grad():
        ref_logp_B_T = completion_logprobs(ref_policy, prompt_ids, completion_ids)
    logp_B_T = completion_logprobs(policy, prompt_ids, completion_ids)
    per_token, _ = POLICY_LOSSES.get("ppo_clip")(logp_B_T, old_logp_B_T, advantages_B_T.float(), mask_B_T, eps_low=clip)
    agg = LOSS_AGG.get("seq_mean_token_mean")
    loss = agg(per_token, mask_B_T) + kl_coef * agg(kl_penalty(logp_B_T, ref_logp_B_T, estimator="k3"), mask_B_T)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(policy.parameters()), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


async def sample(policy, prompts: list[str], group_size: int, *, max_new_tokens: int, seed: int):
    """G completions per prompt, all requests in flight at once (the engine batches them)."""
    states = [EpisodeState.start(policy.tokenizer, p) for p in prompts for _ in range(group_size)]
    results: list = [None] * len(states)

    async def one(i: int) -> None:
        params = SamplingParams(max_new_tokens=max_new_tokens, seed=seed * 100_003 + i)
        results[i] = await policy.engine.generate(states[i].ids, params)

    async with anyio.create_task_group() as tg:
        for i in range(len(states)):
            tg.start_soon(one, i)
    return [s.ids for s in states], results


def main(steps: int = 5, group_size: int = 4) -> None:
    import materl as ml

    torch.manual_seed(0)
    policy, ref_policy = ml.Agent("tiny-random", trainable=True), ml.Agent("tiny-random")
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    reward = Reward.from_spec("length", target=8)
    prompts = ["Say something short.", "Answer briefly: 2+2?"]
    for step in range(steps):
        prompt_ids, gens = anyio.run(lambda: sample(policy, prompts, group_size, max_new_tokens=16, seed=step))
        completion_ids = [g.token_ids for g in gens]
        texts = [policy.tokenizer.decode(c, skip_special_tokens=True) for c in completion_ids]
        rewards_B = reward.score(completions=texts, completion_ids=completion_ids)
        group_ids = [i // group_size for i in range(len(gens))]
        loss = grpo_update(policy, ref_policy, optimizer, prompt_ids, completion_ids, [g.logprobs for g in gens],
                           rewards_B, group_ids)
        print(f"step {step}: reward {float(rewards_B.mean()):.3f} loss {loss:.4f}")


if __name__ == "__main__":
    main()
