"""Per-episode values and how they batch.

Every episode and group node stores one value per episode. A group or batch node reads its
inputs collated over its episodes (numbers -> (n,) tensor, per-token lists -> padded (n,T)
tensor, rollouts -> RolloutBatch, strings -> list), and its output is split back per episode.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from materl.rollout.types import Rollout


@dataclass
class Episode:
    index: int
    group: int  # dense group index (prompt index)
    group_id: Hashable
    prompt: Any  # str, chat messages, or a dataset row's prompt
    columns: dict[str, Any]  # the row's other columns (answer, ...)
    seed: int
    values: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    error: Any = None  # a materl.compiler.failures.Failure once the episode failed
    filtered: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not self.filtered


class RolloutBatch(list):
    """A list of Rollouts whose attributes project over its items (``batch.text`` -> list[str])."""

    def __getattr__(self, attr: str):
        if attr.startswith("_"):
            raise AttributeError(attr)
        return collate([getattr(r, attr) for r in self])


def resolve(ep: Episode, ref: str) -> Any:
    head, *path = ref.split(".")
    obj = ep.values[head]
    for attr in path:
        obj = obj[attr] if isinstance(obj, dict) else getattr(obj, attr)
    return obj


def collate(items: list[Any]) -> Any:
    if not items:
        return items
    first = items[0]
    if all(isinstance(x, (int, float, bool)) or (isinstance(x, Tensor) and x.dim() == 0) for x in items):
        return torch.tensor([float(x) for x in items], dtype=torch.float32)
    if all(isinstance(x, Rollout) or hasattr(x, "rollout") for x in items):
        return RolloutBatch(x if isinstance(x, Rollout) else x.rollout for x in items)
    if all(isinstance(x, Tensor) and x.dim() == 1 for x in items):
        return pad_rows([x.tolist() for x in items], dtype=items[0].dtype)
    if all(isinstance(x, list) and all(isinstance(v, (int, float)) for v in x) for x in items):
        is_int = all(isinstance(v, int) and not isinstance(v, bool) for x in items for v in x)
        if any(items):
            return pad_rows(items, dtype=torch.long if is_int else torch.float32)
    if isinstance(first, str):
        return list(items)
    return list(items)


def pad_rows(rows: list[list], *, dtype=torch.float32, pad: float = 0, width: int | None = None) -> Tensor:
    width = max([len(r) for r in rows] + [width or 0])
    out = torch.full((len(rows), width), pad, dtype=dtype)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.as_tensor(r, dtype=dtype)
    return out


def split(value: Any, n: int) -> list[Any]:
    """Split a group/batch node's output into one value per episode."""
    if isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == n:
        return [value[i] for i in range(n)]
    if isinstance(value, (list, tuple)) and len(value) == n:
        return list(value)
    if isinstance(value, dict):
        parts = {k: split(v, n) for k, v in value.items()}
        return [{k: parts[k][i] for k in parts} for i in range(n)]
    return [value] * n


def to_tensor(value: Any, n: int, *, width: int | None = None) -> Tensor:
    """A collated reward/advantage-like value as float (n,) or (n,T) tensor."""
    if isinstance(value, Tensor):
        t = value.float()
    else:
        t = collate(list(value)) if isinstance(value, list) else torch.as_tensor(value, dtype=torch.float32)
    if t.dim() == 2 and width is not None and t.shape[1] != width:
        t = torch.nn.functional.pad(t, (0, width - t.shape[1])) if t.shape[1] < width else t[:, :width]
    return t
