"""A tiny model taught (by gradient descent, in a second or two) to answer given contexts with
given texts, so tests can drive real tool loops through a real engine: the random tiny model
never writes a tool call by itself.

    ids = teach(agent, [(context_ids, '<tool_call>...</tool_call>'), ...])

Each target ends with the end-of-turn token; training stops once greedy decoding of every
context gives its target exactly (checked through the agent's own engine)."""

from __future__ import annotations

import asyncio

import torch

from materl.engines.base import SamplingParams
from materl.rollout.multiturn import encode


def teach(agent, pairs: list[tuple[list[int], str]], *, max_steps: int = 600, lr: float = 3e-3) -> None:
    tok, model = agent.tokenizer, agent.model
    rows = [(list(ctx), encode(tok, text) + [tok.eos_token_id]) for ctx, text in pairs]
    model.requires_grad_(True)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for step in range(max_steps):
        opt.zero_grad()
        loss = 0.0
        for ctx, target in rows:
            ids = torch.tensor([ctx + target])
            logits = model(ids).logits[0, len(ctx) - 1:-1]
            loss = loss + torch.nn.functional.cross_entropy(logits, torch.tensor(target))
        loss.backward()
        opt.step()
        if step % 10 == 9 and _greedy_matches(model, rows):
            break
    else:
        raise AssertionError(f"teach: the tiny model did not learn its {len(rows)} targets in {max_steps} steps")
    model.requires_grad_(agent.trainable)
    agent.sync_engine()


@torch.no_grad()
def _greedy_matches(model, rows) -> bool:
    for ctx, target in rows:
        ids = torch.tensor([ctx + target])
        pred = model(ids).logits[0, len(ctx) - 1:-1].argmax(-1).tolist()
        if pred != target:
            return False
    return True


class Recording:
    """The agent's real engine, with every request's prompt ids and generation kept."""

    def __init__(self, engine):
        self.engine, self.requests = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate(self, prompt_ids, params: SamplingParams):
        gen = await self.engine.generate(prompt_ids, params)
        self.requests.append((list(prompt_ids), gen))
        return gen
