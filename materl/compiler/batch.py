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

Rows. A row is one (prompt, completion) sequence: one per episode, except for an agent episode
whose history was rewritten, which trains one row per segment (``Rollout.segments``; the AReaL /
SkyRL convention for trajectories that are not one token sequence). ``RowMap`` says which episode
(and segment) each row is and where its tokens sit in the episode's per-token values
(``Rollout.segment_spans``): ``column``/``rows``/``stacked`` give each row its episode's value (a
segment Rollout, the slice of a per-token value, a per-episode number as it is), and values the
learner computes per row (prepare's forwards, ``put_rows``) are stored on each episode in its own
layout (untrained positions between segments 0). Groups, rewards and advantages ran per episode
before the learner, so a segmented episode is one group member whose per-token advantages cover
every segment. Loss aggregations count rows: a segment is a sequence of ``seq_mean_*`` like any
other, and ``mini_batch_size`` / ``micro_batch_size`` count rows. Without segments row i is
episode i and every value passes as it is.

Static shapes (``cuda_graphs=True``): ``bucket(n)`` rounds a length up to the next power of two
(at least 16), so the learner's micro-batches come in few shapes and a captured graph per shape
is replayed; padding is right padding with mask 0, which no trained token reads.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from materl.compiler.episode import Episode, as_rollout, collate, to_tensor
from materl.compiler.sequences import MIN_BUCKET, SeqBatch, bucket  # noqa: F401 (bucket: re-exported)
from materl.compiler.spec import Kind
from materl.errors import CompileError
from materl.rollout.multiturn import EpisodeState, TurnResult
from materl.rollout.types import Rollout


@dataclass(frozen=True)
class RowMap:
    """Which episode (and segment of it) each learner row trains, and where the row's tokens sit
    in that episode's per-token values (module docstring)."""

    episode: tuple[int, ...]  # row -> episode index
    segment: tuple[int, ...]  # row -> segment of that episode
    span: tuple[tuple[int, int], ...]  # row -> (start, stop) in the episode's per-token values
    tokens: tuple[int, ...]  # episode -> how long its per-token values are (its completion)
    segmented: bool  # some episode has several rows; else row i is episode i and values pass as they are

    @classmethod
    def of(cls, rollouts: Sequence[Rollout | None]) -> RowMap:
        """The rows of episodes whose completions are ``rollouts`` (None: offline text, one row)."""
        episode, segment, span = [], [], []
        for i, r in enumerate(rollouts):
            spans = r.segment_spans if r is not None else [(0, 0)]
            for k, sp in enumerate(spans):
                episode.append(i)
                segment.append(k)
                span.append(sp)
        tokens = tuple(len(r.completion_ids) if r is not None else 0 for r in rollouts)
        return cls(tuple(episode), tuple(segment), tuple(span), tokens, len(episode) > len(rollouts))

    @classmethod
    def identity(cls, n: int) -> RowMap:
        return cls(tuple(range(n)), (0,) * n, ((0, 0),) * n, (0,) * n, False)

    @classmethod
    def agreed(cls, maps: dict[str, RowMap]) -> RowMap:
        """The one row map of several completion sets (``ref -> map``): segmented ones must agree."""
        segmented = {ref: m for ref, m in maps.items() if m.segmented}
        if not segmented:
            return next(iter(maps.values()))
        first_ref, first = next(iter(segmented.items()))
        for ref, m in maps.items():
            if (m.episode, m.span) != (first.episode, first.span):
                raise CompileError(f"the learner trains one row per segment of %{first_ref} (an agent episode "
                                   f"whose history was rewritten), but %{ref}'s completions are split differently; "
                                   f"every forward (logprobs, values) of a recipe with segmented episodes must "
                                   f"read the same rollout")
        return first

    @cached_property
    def rows_of(self) -> dict[int, list[int]]:
        """Episode -> its rows, in segment order."""
        out: dict[int, list[int]] = {}
        for row, e in enumerate(self.episode):
            out.setdefault(e, []).append(row)
        return out

    def row_value(self, value: Any, row: int, kind: Kind | None) -> Any:
        """Row ``row``'s part of its episode's ``value``: a Rollout's segment, a per-token value's
        slice (``kind`` TOKENS, a per-token SCORE, or an unknown kind's 1-D numbers as long as the
        episode's tokens), anything else (a number per episode, a prompt) as it is."""
        if kind is Kind.ROLLOUT or isinstance(value, (Rollout, TurnResult, EpisodeState)):
            return as_rollout(value).segments[self.segment[row]]
        if kind in (Kind.ROW, Kind.FLAG) or not _numbers(value):
            return value
        if kind in (Kind.TOKENS, Kind.SCORE) or len(value) >= self.tokens[self.episode[row]]:
            start, stop = self.span[row]
            return value[start:stop]
        return value

    def episode_value(self, rows_R: Sequence[Tensor], e: int) -> Tensor:
        """Episode ``e``'s per-token value from its rows' (each cut to its segment's length; 0
        between segments)."""
        out = rows_R[0].new_zeros(self.tokens[e])
        for row in self.rows_of[e]:
            start, stop = self.span[row]
            out[start:stop] = rows_R[row][:stop - start]
        return out


def _numbers(value: Any) -> bool:
    """A 1-D tensor or a non-empty list of numbers (a per-token value, when it is one)."""
    if isinstance(value, Tensor):
        return value.dim() == 1
    return (isinstance(value, list) and bool(value)
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value))


class LearnerBatch:
    """Everything the learner reads about a batch of episodes, on one device (module docstring)."""

    def __init__(self, episodes: list[Episode], *, device: torch.device, static: bool = False,
                 rows: RowMap | None = None):
        self.episodes = episodes
        self.device = device
        self.static = static  # pad lengths to buckets (cuda_graphs)
        self.map = rows if rows is not None else RowMap.identity(len(episodes))
        self.group_ids = torch.tensor([episodes[e].group for e in self.map.episode], dtype=torch.long, device=device)
        self._sequences: dict[Hashable, SeqBatch] = {}
        self._columns: dict[str, Any] = {}

    def __len__(self) -> int:
        """The number of rows (episodes, plus one per extra segment of a rewritten episode)."""
        return len(self.map.episode)

    # -- episodes <-> rows --
    def per_row(self, values: list, kind: Kind | None) -> list:
        """Per-episode ``values`` as one value per row (``RowMap.row_value``)."""
        if not self.map.segmented:
            return values
        return [self.map.row_value(values[e], row, kind) for row, e in enumerate(self.map.episode)]

    def per_episode(self, values_R: Any) -> Any:
        """Per-row (R, T) values as one per-token value per episode, in the episode's layout."""
        if not self.map.segmented:
            return values_R
        return [self.map.episode_value(values_R, e) for e in range(len(self.episodes))]

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
        """Every row's value of ``ref`` (its episode's, ``per_row``) as one batch value (``collate``
        by ``kind``; per-token values right-padded to ``width``), built on first use and kept."""
        if ref not in self._columns:
            values = collate(self.per_row([e.resolve(ref) for e in self.episodes], kind), kind)
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
            values = self.per_row([e.resolve(name) for e in self.episodes], Kind.TOKENS)
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
            col = self._columns[name] = torch.zeros(len(self), values_R_T.shape[1], device=self.device)
        col[idx.to(self.device)] = values_R_T.to(self.device, torch.float32)
        if not self.map.segmented:
            for i, row in zip(idx.tolist(), values_R_T):
                self.episodes[i].store(name, row)
            return
        for e in sorted({self.map.episode[i] for i in idx.tolist()}):
            self.episodes[e].store(name, self.map.episode_value(col, e))


def take(value: Any, idx: Tensor) -> Any:
    """Rows ``idx`` of a batch value: a tensor indexed on its device, or a list's items (a
    ``RolloutBatch`` stays one)."""
    if isinstance(value, Tensor):
        return value[idx.to(value.device)]
    picked = [value[i] for i in idx.tolist()]
    return type(value)(picked) if isinstance(value, list) else picked
