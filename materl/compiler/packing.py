"""Sequence packing: micro-batches cut by a token budget, and a micro-batch's rows laid end to
end for the learner's forwards, with no padding computed.

    mb = MicroBatching(tokens=4096, lengths=lengths_R)
    for idx in mb.split(rows):                       # greedy in order, <= 4096 tokens each
        packed = pack(sb.rows(idx))                  # (1, N) ids; position ids restart on each row
        hidden_1_N_H = agent.hidden_states(packed.input_ids, None, position_ids=packed.position_ids)
        states_M_H = hidden_1_N_H[0, packed.hidden_idx]          # only real completion tokens
        logp_R_T = unpack(logp_M, packed.valid)                  # the (R, T) layout losses read
    shards = mb.shard(rows, world_size)              # learner ranks: tokens balanced

Attention never crosses a row: the forward gets ``attention_mask=None`` and position ids that
restart at 0, from which transformers builds a block-diagonal causal mask for the model's
attention implementation (SDPA: a boolean mask, which is what the CPU runs; FlexAttention: a
BlockMask; flash attention: varlen). Under ``cuda_graphs`` the packed length N and the count M
of completion tokens are padded to buckets (``sequences.bucket``) with a filler row of its own,
and the mask is built inside the captured graph from segment ids (``block_causal_mask``).

Each row's tokens see the same positions, the same keys and the same values as in the padded
layout, so log-probs, values, entropies and every loss over them equal the padded path to float
rounding (``tests/compiler/test_packing.py`` holds them within 1e-6 in float64). Loss terms and
their aggregation keep the (R, T) layout: padded entries are 0 and masked, as before.
(verl ``use_remove_padding``; OpenRLHF/prime-rl packing; AReaL's token-budget micro-batches;
transformers' packed ``position_ids`` with ``DataCollatorWithFlattening``.)

Budget: a micro-batch holds rows whose token counts sum to at most ``tokens``; a row longer
than the budget goes alone (a row is never split). ``groups``: rows of one group stay in one
micro-batch (the update then has a group-scoped node reading live values). ``rows``: with a
budget, also at most this many rows per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from materl.compiler.sequences import SeqBatch, bucket


@dataclass(frozen=True)
class MicroBatching:
    """How a mini-batch's rows are cut into micro-batches (module docstring)."""

    rows: int | None = None  # micro_batch_size: rows per micro-batch (None: no row limit)
    tokens: int | None = None  # max_tokens_per_micro_batch (None: cut by rows only)
    lengths: Tensor | None = None  # (R,) tokens each row costs; needed with ``tokens``
    groups: Tensor | None = None  # (R,) rows with one id stay together

    @property
    def packed(self) -> bool:
        return self.tokens is not None

    def units(self, rows: Tensor) -> list[Tensor]:
        """``rows`` as the units that stay together: each row, or each group's rows (in order of
        the group's first row)."""
        if self.groups is None:
            return [rows[i:i + 1] for i in range(len(rows))]
        by_group: dict[int, list[int]] = {}
        for r in rows.tolist():
            by_group.setdefault(int(self.groups[r]), []).append(r)
        return [torch.tensor(v, dtype=rows.dtype) for v in by_group.values()]

    def cost(self, unit: Tensor) -> int:
        return int(self.lengths[unit].sum()) if self.lengths is not None else len(unit)

    def split(self, rows: Tensor) -> list[Tensor]:
        """``rows`` in micro-batches, in order."""
        if not self.packed:
            n = self.rows or max(1, len(rows))
            return [rows[i:i + n] for i in range(0, len(rows), n)]
        out: list[list[Tensor]] = []
        used = count = 0
        for unit in self.units(rows):
            c = self.cost(unit)
            full = used + c > self.tokens or (self.rows is not None and count + len(unit) > self.rows)
            if not out or (full and count):
                out.append([])
                used = count = 0
            out[-1].append(unit)
            used, count = used + c, count + len(unit)
        return [torch.cat(parts) for parts in out]

    def shard(self, rows: Tensor, world_size: int) -> list[Tensor]:
        """Each rank's rows of a mini-batch. Without a budget: contiguous shares whose sizes differ
        by at most one; with one, tokens balanced (longest unit first to the rank with fewest
        tokens so far; each shard keeps the mini-batch's order)."""
        if not self.packed:
            return list(torch.tensor_split(rows, world_size))
        units = sorted(self.units(rows), key=self.cost, reverse=True)
        load, shards = [0] * world_size, [[] for _ in range(world_size)]
        for unit in units:
            r = min(range(world_size), key=lambda k: (load[k], k))
            load[r] += self.cost(unit)
            shards[r].append(unit)
        pos = {int(r): i for i, r in enumerate(rows.tolist())}
        out = []
        for parts in shards:
            mine = torch.cat(parts) if parts else rows[:0]
            out.append(mine[torch.tensor(sorted(range(len(mine)), key=lambda i: pos[int(mine[i])]), dtype=torch.long)]
                       if len(mine) else mine)
        return out


@dataclass
class PackedRows:
    """A micro-batch's rows end to end (module docstring)."""

    input_ids: Tensor  # (1, N) every row's prompt + completion, no padding (N: bucketed under graphs)
    position_ids: Tensor  # (1, N) restarting at 0 on each row
    segment_ids: Tensor  # (1, N) which row each position is (the filler row: R)
    hidden_idx: Tensor  # (M,) flat position of the state that predicts each completion token
    targets: Tensor  # (M,) those completion tokens
    valid: Tensor  # (R, T) bool: where the first ``tokens`` of the M values go in the (R, T) layout
    tokens: int  # real completion tokens (M without bucket padding)


def pack(sb: SeqBatch, *, static: bool = False) -> PackedRows:
    """The rows of ``sb`` packed (``static``: N and M padded to buckets with a filler row)."""
    dev = sb.device
    L = sb.input_ids.shape[1]
    lengths = sb.lengths.to(dev)
    seq_R_L = torch.arange(L, device=dev)[None, :] < lengths[:, None]
    pos_R_L = torch.arange(L, device=dev)[None, :].expand(len(lengths), -1)
    seg_R_L = torch.arange(len(lengths), device=dev)[:, None].expand(-1, L)
    ids, pos, seg = sb.input_ids[seq_R_L], pos_R_L[seq_R_L], seg_R_L[seq_R_L]
    offsets_R = torch.cumsum(lengths, 0) - lengths
    comp_R = lengths - sb.prompt_lens.to(dev)
    valid_R_T = torch.arange(sb.width, device=dev)[None, :] < comp_R[:, None]
    hidden_idx = (offsets_R[:, None] + sb.gather_idx)[valid_R_T]
    targets = sb.completion_ids[valid_R_T]
    m = len(targets)
    if static:
        n, mb = len(ids), bucket(max(1, len(targets)))
        grow = bucket(n + 1) - n  # at least one filler position: its own segment
        ids = torch.cat([ids, ids.new_zeros(grow)])
        pos = torch.cat([pos, torch.arange(grow, device=dev)])
        seg = torch.cat([seg, seg.new_full((grow,), len(lengths))])
        hidden_idx = torch.cat([hidden_idx, hidden_idx.new_zeros(mb - m)])
        targets = torch.cat([targets, targets.new_zeros(mb - m)])
    return PackedRows(ids[None], pos[None], seg[None], hidden_idx, targets, valid_R_T, m)


def unpack(values_M: Tensor, packed: PackedRows) -> Tensor:
    """Per-token values of the packed completion tokens, (M,), as (R, T) with 0 at padding."""
    out = values_M.new_zeros(packed.valid.shape)
    return out.masked_scatter(packed.valid, values_M[:packed.tokens])


def block_causal_mask(segment_ids_1_N: Tensor) -> Tensor:
    """(1, 1, N, N) boolean mask: position i attends to j <= i of its own row (SDPA's layout:
    True = attend). Built from tensors only, so a captured graph can make it."""
    seg = segment_ids_1_N[0]
    n = seg.shape[0]
    causal = torch.ones(n, n, dtype=torch.bool, device=seg.device).tril()
    return (causal & (seg[:, None] == seg[None, :]))[None, None]
