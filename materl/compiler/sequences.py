"""Learner tensors for (prompt, completion) rows, and the hidden states that predict them.

Sequences are right-padded ``prompt + completion``; the hidden state that predicts completion
token t of row i sits at ``len(prompt_i) - 1 + t`` and is gathered, so rows with prompts of
different lengths need no position-id juggling. Rows that share a prompt (a GRPO group) run it
once: a prefix pass fills a KV cache that their completions attend to (``completion_hidden``;
``share_prompts=False`` turns it off, and so does gradient checkpointing: HF's checkpointed layers
run without a cache).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from materl.compiler.episode import as_rollout, pad_rows
from materl.rollout.multiturn import EpisodeState, encode


MIN_BUCKET = 16


def bucket(n: int, *, minimum: int = MIN_BUCKET) -> int:
    """The static size ``n`` is padded to under ``cuda_graphs``: the next power of two, at least
    ``minimum`` (1 -> 16, 16 -> 16, 17 -> 32, 100 -> 128)."""
    if n < 1:
        raise ValueError(f"bucket needs a size >= 1, got {n}")
    return max(minimum, 1 << (n - 1).bit_length())


@dataclass
class SeqBatch:
    input_ids: Tensor  # (B, L) right-padded prompt + completion
    attention_mask: Tensor  # (B, L)
    gather_idx: Tensor  # (B, T) position of the hidden state that predicts completion token t
    completion_ids: Tensor  # (B, T)
    mask: Tensor  # (B, T) float, 1 = trained token (tool output and padding are 0)
    old_logprobs: Tensor  # (B, T) sampling log-probs
    lengths: Tensor  # (B,) prompt + completion length
    prompt_lens: Tensor  # (B,)
    prompt_group: Tensor  # (B,) rows with equal ids have identical prompts
    static: bool = False  # rows() keeps lengths on power-of-two buckets (captured CUDA graphs)

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def rows(self, idx: Tensor) -> SeqBatch:
        """Rows ``idx``, cut to their longest sequence (``static``: to that length's bucket)."""
        idx = idx.to(self.device)
        length = int(self.lengths[idx].max())
        if self.static:
            length = min(bucket(length), self.input_ids.shape[1])
        return SeqBatch(self.input_ids[idx, :length], self.attention_mask[idx, :length],
                        self.gather_idx[idx].clamp(max=length - 1), self.completion_ids[idx], self.mask[idx],
                        self.old_logprobs[idx], self.lengths[idx], self.prompt_lens[idx], self.prompt_group[idx],
                        self.static)

    def to(self, device: torch.device) -> SeqBatch:
        """The rows on ``device`` (itself if they are there): one copy per tensor."""
        if self.device == torch.device(device):
            return self
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self) if f.name != "static"})

    def padded(self, length: int, width: int) -> SeqBatch:
        """Right-padded to ``length`` sequence positions and ``width`` completion tokens (mask 0,
        gather index 0: nothing trained reads the padding), with ``rows()`` kept on buckets."""
        grow_l, grow_t = length - self.input_ids.shape[1], width - self.width
        if grow_l < 0 or grow_t < 0:
            raise ValueError(f"padded({length}, {width}) is smaller than the rows ({self.input_ids.shape[1]}, "
                             f"{self.width})")
        pad = torch.nn.functional.pad
        return SeqBatch(pad(self.input_ids, (0, grow_l)), pad(self.attention_mask, (0, grow_l)),
                        pad(self.gather_idx, (0, grow_t)), pad(self.completion_ids, (0, grow_t)),
                        pad(self.mask, (0, grow_t)), pad(self.old_logprobs, (0, grow_t)), self.lengths,
                        self.prompt_lens, self.prompt_group, static=True)


def build_seq_batch(tokenizer, prompts: list, completions: list) -> SeqBatch:
    """Rows from rollouts (exact ids, loss masks, sampling log-probs) or, for offline data such
    as DPO pairs, from text (the prompt through the chat template, the completion plus eos)."""
    rows = []
    for prompt, comp in zip(prompts, completions):
        if isinstance(comp, str):
            p_ids = EpisodeState.start(tokenizer, prompt).ids
            c_ids = encode(tokenizer, comp) + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
            rows.append((p_ids, c_ids, [1] * len(c_ids), [0.0] * len(c_ids)))
        else:
            r = as_rollout(comp)
            rows.append((r.prompt_ids, r.completion_ids, r.loss_mask, r.sampling_logprobs))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    seqs = [p + c for p, c, _, _ in rows]
    input_ids = pad_rows(seqs, dtype=torch.long, pad=pad)
    attention = pad_rows([[1] * len(s) for s in seqs], dtype=torch.long)
    width = max(1, max(len(c) for _, c, _, _ in rows))
    gather = pad_rows([[len(p) - 1 + t for t in range(len(c))] for p, c, _, _ in rows], dtype=torch.long, width=width)
    gather = torch.maximum(gather, torch.zeros_like(gather))
    groups: dict[tuple[int, ...], int] = {}
    prompt_group = [groups.setdefault(tuple(p), len(groups)) for p, _, _, _ in rows]
    return SeqBatch(input_ids, attention, gather, pad_rows([c for _, c, _, _ in rows], dtype=torch.long, width=width),
                    pad_rows([m for _, _, m, _ in rows], width=width), pad_rows([o for _, _, _, o in rows], width=width),
                    torch.tensor([len(s) for s in seqs]), torch.tensor([len(p) for p, _, _, _ in rows]),
                    torch.tensor(prompt_group))


def gather_rows(x_B_L_H: Tensor, idx_B_T: Tensor) -> Tensor:
    """Rows of ``x`` (B, L[, H]) at positions ``idx`` (B, T): the states that predict each token."""
    if x_B_L_H.dim() == 2:
        return x_B_L_H.gather(1, idx_B_T)
    return x_B_L_H.gather(1, idx_B_T[..., None].expand(-1, -1, x_B_L_H.shape[-1]))


def completion_hidden(agent, sb: SeqBatch, *, share_prompts: bool = True) -> Tensor:
    """(B, T, H): the hidden state that predicts each completion token.

    When rows share prompts (a GRPO group) and ``share_prompts``, each distinct prompt is run once
    and its KV cache reused by the rows that continue it (``shared_prefix_hidden_states``): the
    same values as one forward over every full row, for fewer tokens.
    """
    sb = sb.to(agent.device)  # a no-op unless this agent sits on another device than the batch
    if not share_prompts or getattr(agent, "gradient_checkpointing", False):  # HF's checkpointed layers drop a cache
        return gather_rows(agent.hidden_states(sb.input_ids, sb.attention_mask), sb.gather_idx)
    groups_U, owner_B = sb.prompt_group.unique(return_inverse=True)
    if len(groups_U) == len(owner_B):
        return gather_rows(agent.hidden_states(sb.input_ids, sb.attention_mask), sb.gather_idx)
    dev = sb.device
    first_U = torch.full_like(groups_U, len(owner_B)).scatter_reduce(
        0, owner_B, torch.arange(len(owner_B), device=dev), "amin")
    plen_U = sb.prompt_lens[first_U]
    width = int(plen_U.max())
    prefix_mask = (torch.arange(width, device=dev)[None, :] < plen_U[:, None]).long()
    prefix_ids = sb.input_ids[first_U, :width] * prefix_mask
    steps = sb.completion_ids.shape[1] - 1  # the last completion token predicts nothing we train
    suffix_mask = (torch.arange(steps, device=dev)[None, :] < (sb.lengths - sb.prompt_lens)[:, None]).long()
    last_B_H, suffix_B_S_H = agent.shared_prefix_hidden_states(
        prefix_ids, prefix_mask, owner_B, sb.completion_ids[:, :steps] * suffix_mask, suffix_mask)
    return torch.cat([last_B_H[:, None], suffix_B_S_H], dim=1)
