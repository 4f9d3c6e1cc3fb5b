"""The Mojo engine's prefix pool: the longest shared prefix, found from the sorted token lists,
is the one a scan of every entry finds, through additions, evictions and reuse."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from materl.engines.mojo_prefix import PrefixPool, common_prefix

TOKENS = st.lists(st.integers(0, 3), max_size=12)  # a small alphabet: many shared prefixes


def cache(n: int) -> torch.Tensor:
    return torch.zeros(n)  # n float32 elements: 4n bytes


def scanned(pool: PrefixPool, prompt: list[int], limit: int) -> int:
    return max((min(common_prefix(prompt, e.tokens), limit) for e in pool._entries.values()), default=0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "best"]), TOKENS, st.integers(0, 12)), max_size=40),
       st.integers(0, 40))
def test_best_finds_what_a_scan_of_every_entry_finds(ops, budget_elements):
    pool = PrefixPool(4 * budget_elements)
    for op, tokens, n in ops:
        if op == "add":
            pool.add(tokens, cache(n + 1))
        else:
            want = scanned(pool, tokens, n)
            entry, length = pool.best(tokens, n)
            assert length == want
            assert (entry is None) == (want == 0)
            if entry is not None:
                assert min(common_prefix(tokens, entry.tokens), n) == want
                assert next(reversed(pool._entries.values())) is entry  # now the most recently used
        assert sorted(pool._sorted) == pool._sorted and len(pool._sorted) == len(pool)
        assert {k for _, k in pool._sorted} == set(pool._entries)
        assert pool._bytes == sum(4 * e.cache.numel() for e in pool._entries.values()) <= pool.budget_bytes


def test_the_least_recently_used_entry_leaves_first():
    pool = PrefixPool(4 * 10)  # room for two 5-element caches
    pool.add([1, 2, 3], cache(5))
    pool.add([7, 8], cache(5))
    assert pool.best([1, 2, 9], 5)[1] == 2  # [1, 2, 3] used: [7, 8] is now the oldest
    pool.add([4], cache(5))
    assert sorted(e.tokens for e in pool._entries.values()) == [[1, 2, 3], [4]]
    assert pool.best([7, 8, 1], 5) == (None, 0)
    first = pool.best([1, 2], 5)[0]
    pool.add([4, 4], cache(5))  # [4] was used less recently than [1, 2, 3]: it leaves
    assert sorted(e.tokens for e in pool._entries.values()) == [[1, 2, 3], [4, 4]]
    pool.add([1, 2, 3], cache(5))  # the same tokens again: a second entry, and the first one leaves
    again, length = pool.best([1, 2, 3, 4], 9)
    assert len(pool) == 2 and length == 3 and again is not first
    pool.clear()
    assert len(pool) == 0 and pool._sorted == [] and pool.best([1], 1) == (None, 0)
