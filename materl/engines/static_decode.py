"""Static-KV-cache decoding for the transformers engine: fixed shapes, so decode steps can be
captured as CUDA graphs and replayed.

    decoder = StaticDecoder(capture=True)                 # the engine makes one (static_cache=True)
    gens = decoder.decode(engine, lm, batch, version)      # same contract as the dynamic loop

A batch of B requests decodes in a slot of ``Bb = bucket(B)`` rows (powers of two: 1, 2, 4, ...)
and ``Lb = bucket(prompt + max_new_tokens)`` positions: HF's ``StaticCache`` (keys/values
preallocated, written in place at the cache's own position counter), and static input buffers
(the fed token, its position, the (Bb, Lb) attention mask). The prefill runs eagerly (prompts vary);
every decode step calls one function over the static buffers, which on CUDA is
``torch.compile(mode="reduce-overhead", dynamic=False)``: torch's CUDA-graph trees record it
once per (Bb, Lb) slot and replay it every step after (HF ``generate`` with
``cache_implementation="static"`` does the same). Slots, with their caches and graphs, are kept
for the next batches of the same bucket.

What the dynamic loop (``transformers_engine._decode``) keeps is kept here: left padding with
positions ``cumsum(mask) - 1``, per-row stop rules and per-request seeded sampling through the
engine's own ``_step``, exact token ids and their log-probs. What differs: identical prompts are
prefilled per row (the slot's rows are fixed), finished rows stay in the slot (fed a pad token,
their logits ignored) instead of leaving the batch, and attention reads the whole static cache
with the unfilled part masked. On a CPU the same path runs without capture; its tokens equal the
dynamic loop's and its log-probs agree to float32 rounding (``tests/engines/test_static_decode.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from materl.device import cuda_graph_thread
from materl.engines.hf import cache_kwargs


def bucket_rows(n: int) -> int:
    """Rows of the slot a batch of ``n`` decodes in: the next power of two (1, 2, 4, 8, ...)."""
    return 1 << max(0, n - 1).bit_length()


def bucket_length(n: int, *, minimum: int = 64) -> int:
    """Positions of the slot: the next power of two, at least ``minimum``."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


@dataclass
class _Slot:
    cache: object  # transformers.StaticCache
    tokens: Tensor  # (Bb, 1) the token fed this step
    positions: Tensor  # (Bb, 1) its position (real tokens before it)
    mask: Tensor  # (Bb, Lb) 1 = a real token at that cache position
    step: Callable[[], Tensor]  # one decode step over the buffers -> logits (Bb, V)


class StaticDecoder:
    """Decodes batches in static slots (module docstring); ``capture``: record CUDA graphs."""

    def __init__(self, *, capture: bool):
        self.capture = capture
        self.slots: dict[tuple[int, int, int], _Slot] = {}  # (id(lm), Bb, Lb) -> slot

    def slot(self, lm, rows: int, length: int, device: torch.device) -> _Slot:
        key = (id(lm), rows, length)
        if key not in self.slots:
            from transformers import StaticCache

            s = _Slot(StaticCache(config=lm.config, max_cache_len=length),
                      torch.zeros(rows, 1, dtype=torch.long, device=device),
                      torch.zeros(rows, 1, dtype=torch.long, device=device),
                      torch.zeros(rows, length, dtype=torch.long, device=device), step=lambda: None)

            def step() -> Tensor:
                out = lm(input_ids=s.tokens, attention_mask=s.mask, position_ids=s.positions, use_cache=True,
                         **cache_kwargs(lm, s.cache))
                return out.logits[:, -1, :]

            s.step = torch.compile(step, mode="reduce-overhead", dynamic=False) if self.capture else step
            self.slots[key] = s
        return self.slots[key]

    def decode(self, engine, lm, batch: list, version: int) -> list:
        """The engine's ``_decode`` contract on a static slot: one Generation per request."""
        device = next(lm.parameters()).device
        rows = [engine._new_row(r) for r in batch]
        prompts = [list(r.prompt_ids) for r in batch]
        width = max(len(p) for p in prompts)
        new = max(r.params.max_new_tokens for r in batch)
        slot = self.slot(lm, bucket_rows(len(batch)), bucket_length(width + new), device)
        if self.capture:
            cuda_graph_thread()
        slot.cache.reset()
        logits, lengths = self._prefill(engine, lm, slot, prompts, width, device)
        active = list(range(len(rows)))  # rows[active[j]] is live row j
        t = 0
        while True:
            live = [rows[i] for i in active]
            tokens = engine._step(logits[torch.tensor(active, device=device)], live)
            keep = [j for j, row in enumerate(live) if row.finish is None]
            if not keep:
                break
            active = [active[j] for j in keep]
            slot.tokens.fill_(engine.pad_id)
            slot.tokens[torch.tensor(active, device=device), 0] = tokens[torch.tensor(keep, device=device)]
            slot.positions.copy_((lengths + t)[:, None])
            slot.mask[:, width + t] = 1
            if self.capture:
                torch.compiler.cudagraph_mark_step_begin()
            logits = slot.step()
            t += 1
        return [engine._finish(row, len(batch), version) for row in rows]

    @staticmethod
    def _prefill(engine, lm, slot: _Slot, prompts: list[list[int]], width: int, device) -> tuple[Tensor, Tensor]:
        """Left-padded prompts (and one-token filler rows up to the slot's size) into the cache;
        the last prompt position's logits (Bb, V) and each row's number of real tokens (Bb,)."""
        filler = [[engine.pad_id]] * (slot.tokens.shape[0] - len(prompts))
        ids, mask = left_pad(prompts + filler, engine.pad_id, device)
        slot.mask.zero_()
        slot.mask[:, :width] = mask
        out = lm(input_ids=ids, attention_mask=slot.mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                 use_cache=True, logits_to_keep=1, **cache_kwargs(lm, slot.cache))
        return out.logits[:, -1, :], mask.sum(-1)


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[Tensor, Tensor]:
    """(B, P) ids and mask with each prompt right-aligned (left padding)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)
