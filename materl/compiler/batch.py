"""The rollout-to-learner hand-off: one typed batch, built once from finished episodes, moved to
the learner's device once, sliced per micro-batch.

    batch = LearnerBatch(episodes, device=torch.device("cuda"))
    sb = batch.sequences(("prompts", "completions"), build)   # token ids, masks, sampling log-probs,
                                                              # lengths, prompt groups: a SeqBatch
    adv_R_T = batch.rows("advantages", Kind.TOKENS, rows_R)   # one collation per ref, then slices
    batch.put_rows("policy_logprobs", rows_R, proximal_R_T)   # values the update itself produces

A ref's column is collated over the whole batch the first time the update reads it (after
prepare, whose results it includes) and kept: a micro-step slices it, it never re-collates.
Every tensor of the batch lives on ``device``; an agent on another device (a reference on a
second GPU) gets its rows moved there by the forward that reads them (``SeqBatch.to``).
(tinker-cookbook ``data_processing.assemble_training_data``; torchtune ``dev/grpo/types.py``.)

Static shapes (``cuda_graphs=True``): ``bucket(n)`` rounds a length up to the next power of two
(at least 16), so the learner's micro-batches come in few shapes and a captured graph per shape
is replayed; padding is right padding with mask 0, which no trained token reads.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor

from materl.compiler.episode import Episode, collate, to_tensor
from materl.compiler.sequences import MIN_BUCKET, SeqBatch, bucket  # noqa: F401 (bucket: re-exported)
from materl.compiler.spec import Kind

class LearnerBatch:
    """Everything the learner reads about a batch of episodes, on one device (module docstring)."""

    def __init__(self, episodes: list[Episode], *, device: torch.device, static: bool = False):
        self.episodes = episodes
        self.device = device
        self.static = static  # pad lengths to buckets (cuda_graphs)
        self.group_ids = torch.tensor([e.group for e in episodes], dtype=torch.long, device=device)
        self._sequences: dict[Hashable, SeqBatch] = {}
        self._columns: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.episodes)

    # -- token rows --
    def sequences(self, key: Hashable, build: Callable[[], SeqBatch]) -> SeqBatch:
        """The (prompt, completion) rows under ``key``, built once (``build()``), on the device."""
        if key not in self._sequences:
            sb = build()
            if self.static:
                sb = sb.padded(bucket(sb.input_ids.shape[1]), bucket(sb.width))
            self._sequences[key] = sb.to(self.device)
        return self._sequences[key]

    def sequence_items(self):
        """(key, SeqBatch) of every row set built so far."""
        return self._sequences.items()

    @property
    def width(self) -> int | None:
        """T, the completion width every per-token column is padded to (None before any rows)."""
        return next(iter(self._sequences.values())).width if self._sequences else None

    # -- per-episode values --
    def column(self, ref: str, kind: Kind | None) -> Any:
        """Every episode's value of ``ref`` as one batch value (``collate`` by ``kind``; per-token
        values right-padded to ``width``), built on first use and kept."""
        if ref not in self._columns:
            values = collate([e.resolve(ref) for e in self.episodes], kind)
            if isinstance(values, Tensor):
                values = to_tensor(values, width=self.width).to(self.device)
            self._columns[ref] = values
        return self._columns[ref]

    def rows(self, ref: str, kind: Kind | None, idx: Tensor) -> Any:
        """Rows ``idx`` of ``ref``'s column: a tensor slice, or the items of a list."""
        return take(self.column(ref, kind), idx)

    def stacked(self, name: str, idx: Tensor, *, width: int | None = None) -> Tensor:
        """Rows ``idx`` of the (B, T) float values node ``name`` stored per episode in prepare (or
        ``put_rows`` stored in the update), stacked once for the whole batch."""
        if name not in self._columns:
            values = [e.resolve(name) for e in self.episodes]
            width = width if width is not None else self.width
            if all(isinstance(v, Tensor) and v.shape == (width,) for v in values):  # as prepare stored them
                col = torch.stack([v.to(self.device) for v in values]).float()
            else:
                col = to_tensor(values, width=width).to(self.device)
            self._columns[name] = col
        return self._columns[name][idx.to(self.device)]

    def put_rows(self, name: str, idx: Tensor, values_R_T: Tensor) -> None:
        """Rows ``idx`` of node ``name``'s (B, T) values, produced during the update itself (the
        deferred proximal log-probs); also stored on each episode, as prepare would have."""
        col = self._columns.get(name)
        if col is None:
            col = self._columns[name] = torch.zeros(len(self.episodes), values_R_T.shape[1], device=self.device)
        col[idx.to(self.device)] = values_R_T.to(self.device, torch.float32)
        for i, row in zip(idx.tolist(), values_R_T):
            self.episodes[i].store(name, row)


def take(value: Any, idx: Tensor) -> Any:
    """Rows ``idx`` of a batch value: a tensor indexed on its device, or a list's items (a
    ``RolloutBatch`` stays one)."""
    if isinstance(value, Tensor):
        return value[idx.to(value.device)]
    picked = [value[i] for i in idx.tolist()]
    return type(value)(picked) if isinstance(value, list) else picked
