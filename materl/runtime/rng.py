"""The global random generators' states, saved in a checkpoint (``rng.pt``) and restored on
resume so that the next draws repeat the saved run's: torch (CPU and every CUDA device), Python's
``random`` and numpy's, as tensors and tuples that ``torch.load(weights_only=True)`` accepts."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """torch (CPU and every CUDA device), python ``random`` and numpy global RNG states, as
    tensors/tuples that ``torch.load(weights_only=True)`` accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of :func:`rng_state`: the next draws of every generator repeat the saved run's."""
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
