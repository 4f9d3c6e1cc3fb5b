"""Prefix sharing for the Mojo engine: the keys/values a new request can reuse.

A request's cache holds, at position i, the keys and values of its i-th token given tokens
0..i-1. The kernel computes them the same way whatever else runs (``mojo_engine.py``), so two
requests whose token lists agree on 0..L-1 have the same bits at positions 0..L-1, and a new
request may copy them from any cache that holds that prefix instead of computing them:

- a running request's cache (its prompt and the tokens it has fed so far),
- a finished request's cache kept in the ``PrefixPool`` (a multi-turn episode's next prompt is
  the last prompt + the completion + the tool's answer),
- a request admitted in the same step (the shared rows are computed once and written into both
  caches: the forward's mirrors).

The pool keeps finished caches up to a byte budget, least recently used out first, and finds the
longest shared prefix in O(log n) comparisons: its token lists are kept sorted, and the list
sharing the longest prefix with a prompt is the prompt's neighbour in that order (a scan of every
entry made a long rollout-only run quadratic: 1.7 s, then 4.7 s, for the same 128 requests after
seven rounds on the tiny model, whose caches fit the budget by the thousand). Cached keys
and values belong to the weights that computed them: the engine empties the pool whenever the
weights change (``MojoEngine.sync_weights``, ``sleep``, or a changed parameter seen at a step).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass

from torch import Tensor


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (binary search on slice equality,
    which compares in C)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(eq=False)
class Cached:
    """A cache whose positions 0..len(tokens)-1 hold the keys and values of ``tokens``."""

    tokens: list[int]
    cache: Tensor


class PrefixPool:
    """Finished requests' caches, kept for reuse up to ``budget_bytes`` (0: keep none)."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[int, Cached] = OrderedDict()  # least recently used first
        self._sorted: list[tuple[list[int], int]] = []  # (tokens, id) in lexicographic order
        self._bytes = 0
        self.hits = 0  # positions copied from the pool (tests and benchmarks read it)

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, tokens: list[int], cache: Tensor) -> None:
        size = cache.numel() * cache.element_size()
        if not tokens or size > self.budget_bytes:
            return
        entry = Cached(tokens, cache)
        self._entries[id(entry)] = entry
        bisect.insort(self._sorted, (tokens, id(entry)))
        self._bytes += size
        while self._bytes > self.budget_bytes:
            key, old = self._entries.popitem(last=False)
            del self._sorted[bisect.bisect_left(self._sorted, (old.tokens, key))]
            self._bytes -= old.cache.numel() * old.cache.element_size()

    def clear(self) -> None:
        self._entries.clear()
        self._sorted.clear()
        self._bytes = 0

    def best(self, prompt: list[int], limit: int) -> tuple[Cached | None, int]:
        """An entry sharing the longest prefix with ``prompt`` (at most ``limit`` tokens) and that
        length; the entry becomes the most recently used. Of the sorted token lists, those just
        before and just after ``prompt`` share its longest prefix: any list further away agrees
        with ``prompt`` on no more than the nearer one does."""
        i = bisect.bisect_left(self._sorted, (prompt,))
        best, length = None, 0
        for tokens, key in self._sorted[max(i - 1, 0):i + 1]:
            n = min(common_prefix(prompt, tokens), limit)
            if n > length:
                best, length = self._entries[key], n
        if best is not None:
            self._entries.move_to_end(id(best))
        return best, length
