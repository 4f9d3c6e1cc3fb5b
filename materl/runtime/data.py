"""Datasets for training: Python lists, JSONL files, or `datasets` objects, as rows (dicts).

Order is a seeded permutation per epoch, so a (epoch, index) position is all that resuming needs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from materl.errors import ConfigError


def load_rows(data: Any) -> list[dict]:
    """Rows as dicts with at least ``prompt`` (str or chat messages)."""
    if isinstance(data, (str, Path)):
        path = Path(data)
        if not path.exists():
            raise ConfigError(f"dataset file {str(path)!r} does not exist")
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    elif hasattr(data, "to_list"):  # datasets.Dataset
        rows = data.to_list()
    else:
        rows = list(data)
    out = []
    for i, r in enumerate(rows):
        if isinstance(r, str):
            r = {"prompt": r}
        if not isinstance(r, dict) or not ("prompt" in r or "messages" in r or "chosen" in r):
            raise ConfigError(f"dataset row {i} needs a 'prompt' (or 'messages'), got {str(r)[:80]!r}")
        out.append(dict(r))
    if not out:
        raise ConfigError("the dataset is empty")
    return out


class Sampler:
    """Deterministic batches over rows: a fresh seeded permutation each epoch."""

    def __init__(self, rows: list[dict], *, batch_size: int, seed: int = 0, shuffle: bool = True):
        self.rows, self.batch_size, self.seed, self.shuffle = rows, batch_size, seed, shuffle
        self.epoch, self.index = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.rows)))
        return torch.randperm(len(self.rows), generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()

    def next_batch(self) -> list[dict]:
        batch = []
        while len(batch) < self.batch_size:
            if self.index >= len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation()
            batch.append(self.rows[self._order[self.index]])
            self.index += 1
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation()


def split_columns(rows: list[dict]) -> tuple[list, dict[str, list]]:
    """Rows -> (prompts, {column: values}) for ``compiled.run``."""
    prompts = [r.get("prompt", r.get("messages")) for r in rows]
    keys = sorted({k for r in rows for k in r} - {"prompt", "messages"})
    return prompts, {k: [r.get(k) for r in rows] for k in keys}
