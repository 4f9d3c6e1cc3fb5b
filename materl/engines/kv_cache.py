"""A decode KV cache that appends in place instead of re-concatenating.

    cache = decode_cache(lm.config, reserve=max_new_tokens)   # a DynamicCache
    lm(..., use_cache=True, **cache_kwargs(lm, cache))   # cache= (or past_key_values= before 5.2x)

HF's ``DynamicLayer.update`` does ``torch.cat([keys, new], dim=-2)``: every decode step copies the
whole cache of every layer, so a 32-token decode copies it 32 times (141 ms of a 2.2 s SmolLM2
decode of 8 rows on 2 cores, the largest cost after the matmuls). ``GrowingLayer`` preallocates
``prompt + reserve`` positions on its first update and writes each new token into the next slot;
``keys``/``values`` are views of the filled part, which SDPA reads through their strides. The
numbers are the ones ``torch.cat`` would give: the same values at the same positions.

Used by the in-process engine's decode loop, which calls ``update`` and ``batch_select_indices``
only; models whose cache layers are not all plain ``DynamicLayer`` (sliding windows, linear
attention) keep HF's layers.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` with preallocated buffers; grows by doubling if ``reserve`` runs out."""

    def __init__(self, reserve: int):
        super().__init__()
        self.reserve = reserve
        self.length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._keys = self._alloc(key_states, key_states.shape[-2] + self.reserve)
            self._values = self._alloc(value_states, value_states.shape[-2] + self.reserve)
        end = self.length + key_states.shape[-2]
        if end > self._keys.shape[-2]:
            capacity = max(end, 2 * self._keys.shape[-2])
            self._keys = self._grown(self._keys, capacity)
            self._values = self._grown(self._values, capacity)
        self._keys[..., self.length:end, :] = key_states
        self._values[..., self.length:end, :] = value_states
        self.length = end
        self._expose()
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._keys, self._values = self._keys[indices], self._values[indices]
            self._expose()

    def _expose(self) -> None:
        self.keys = self._keys[..., : self.length, :]
        self.values = self._values[..., : self.length, :]

    @staticmethod
    def _alloc(like: torch.Tensor, capacity: int) -> torch.Tensor:
        return like.new_empty(*like.shape[:-2], capacity, like.shape[-1])

    def _grown(self, buffer: torch.Tensor, capacity: int) -> torch.Tensor:
        out = self._alloc(buffer, capacity)
        out[..., : self.length, :] = buffer[..., : self.length, :]
        return out


def decode_cache(config, *, reserve: int) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose layers append in place (see the module docstring)."""
    cache = DynamicCache(config=config)
    if cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [GrowingLayer(reserve) for _ in cache.layers]
    return cache
