"""Text reward kernels: ``sentiment`` and ``toxicity`` over a batch of completion texts.

    scores_B = sentiment(texts, target="positive")       # float64 (B,)
    scores_B = toxicity(texts)

The same numbers, bit for bit, as the Python rewards of ``materl.ops.text_rewards`` (whose
docstring defines the tokens, the VADER rules kept and the scores). The texts travel as one
uint8 buffer of their UTF-8 bytes with B + 1 offsets (``pack_texts``); the word lists as one
open-addressing hash table (``table(reward)``, built once per process from the packaged lexicons).

``impl``: ``"auto"`` (the Mojo kernel ``kernels/text_rewards.mojo`` when it builds, else the
Python reference), ``"mojo"`` (``KernelError`` if it cannot run) or ``"python"``.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from materl.errors import ConfigError, KernelError, ShapeError
from materl.kernels import loader
from materl.ops import text_rewards as T

IMPLS = ("auto", "mojo", "python")
FNV_OFFSET, FNV_PRIME, MASK64 = 14695981039346656037, 1099511628211, (1 << 64) - 1


def pack_texts(texts: Sequence[str]) -> tuple[Tensor, Tensor]:
    """B strings -> (their UTF-8 bytes concatenated, uint8; B + 1 int64 offsets)."""
    _check_texts(texts)
    encoded = [t.encode("utf-8") for t in texts]
    offsets = torch.tensor(list(itertools.accumulate(map(len, encoded), initial=0)), dtype=torch.int64)
    blob = bytearray(b"".join(encoded)) or bytearray(1)
    return torch.frombuffer(blob, dtype=torch.uint8), offsets


def _check_texts(texts: Sequence[str]) -> None:
    if isinstance(texts, str):
        raise ShapeError(f"text rewards take a list of B completions, got one string {texts[:40]!r}")


def fnv1a(word: bytes) -> int:
    """The kernel's hash of a (lowercased) word: 64-bit FNV-1a, then h ^= h >> 29."""
    h = FNV_OFFSET
    for c in word:
        h = ((h ^ c) * FNV_PRIME) & MASK64
    return h ^ (h >> 29)


@dataclass(frozen=True)
class Table:
    """The lexicon as the kernel reads it (see kernels/text_rewards.mojo)."""
    slots: Tensor  # (cap,) int64: entry index or -1
    keys: Tensor  # uint8: the entries' lowercased bytes
    key_offs: Tensor  # (E + 1,) int64
    flags: Tensor  # (E,) int64
    codes: Tensor  # (E,) int64
    valence: Tensor  # (E,) float64
    booster: Tensor  # (E,) float64


@functools.lru_cache(maxsize=2)
def table(which: str = "sentiment") -> Table:
    """The words ``which`` reward looks up: every entry for sentiment, the listed words for
    toxicity (a table of ~900 words stays in the L1/L2 cache while a batch streams through)."""
    entries, _ = T.lexicon()
    if which == "toxicity":
        entries = {w: e for w, e in entries.items() if e.flags & T.TOXIC}
    words = list(entries)
    cap = 2
    while cap < 2 * len(words):
        cap *= 2
    slots = [-1] * cap
    for k, w in enumerate(words):
        slot = fnv1a(w) & (cap - 1)
        while slots[slot] >= 0:
            slot = (slot + 1) & (cap - 1)
        slots[slot] = k
    offs = [0]
    for w in words:
        offs.append(offs[-1] + len(w))
    e = [entries[w] for w in words]
    return Table(
        slots=torch.tensor(slots, dtype=torch.int64),
        keys=torch.frombuffer(bytearray(b"".join(words)), dtype=torch.uint8),
        key_offs=torch.tensor(offs, dtype=torch.int64),
        flags=torch.tensor([x.flags for x in e], dtype=torch.int64),
        codes=torch.tensor([x.code for x in e], dtype=torch.int64),
        valence=torch.tensor([x.valence for x in e], dtype=torch.float64),
        booster=torch.tensor([x.booster for x in e], dtype=torch.float64),
    )


def _kernel(op: str, impl: str) -> loader.Kernel | None:
    if impl not in IMPLS:
        raise ConfigError(f"{op}: impl must be one of {', '.join(IMPLS)}; got {impl!r}")
    if impl == "python":
        return None
    if impl == "mojo":
        kernel, why = loader.load_or_reason("text_rewards")
        if kernel is None:
            raise KernelError(f"{op}: Mojo kernel unavailable: {why}")
        return kernel
    return loader.load("text_rewards")


def _run(kernel: loader.Kernel, op: str, texts: Sequence[str], extra: tuple, signature: str) -> Tensor:
    data, offs = pack_texts(texts)
    lengths = offs[1:] - offs[:-1]
    max_tokens = int(lengths.max()) // 2 + 1 if len(lengths) else 1
    scratch = torch.empty(3 * max_tokens, dtype=torch.int64)
    out = torch.empty(len(texts), dtype=torch.float64)
    t = table(op)
    rc = kernel.function(op, signature)(
        data.data_ptr(), offs.data_ptr(), len(texts), t.slots.data_ptr(), len(t.slots), t.keys.data_ptr(),
        t.key_offs.data_ptr(), t.flags.data_ptr(), t.codes.data_ptr(), *extra, scratch.data_ptr(), max_tokens,
        out.data_ptr())
    if rc != 0:
        raise KernelError(f"{op}: kernel text_rewards.{op} returned error code {rc}")
    return out


def sentiment(texts: Sequence[str], *, target="positive", impl: str = "auto") -> Tensor:
    """``1 - |compound - t|`` per text (``materl.ops.text_rewards.sentiment``). B str -> float64 (B,)."""
    _check_texts(texts)
    t = T.sentiment_target(target)
    kernel = _kernel("sentiment", impl)
    if kernel is None:
        return torch.tensor(T.sentiment(completions=texts, target=target), dtype=torch.float64)
    tab, (_, k) = table("sentiment"), T.lexicon()
    extra = (tab.valence.data_ptr(), tab.booster.data_ptr(), k.c_incr, k.n_scalar, t)
    return _run(kernel, "sentiment", texts, extra, "iiiiiiiiiiifffiii")


def toxicity(texts: Sequence[str], *, impl: str = "auto") -> Tensor:
    """``-(listed tokens) / tokens`` per text (``materl.ops.text_rewards.toxicity``). B str -> float64 (B,)."""
    _check_texts(texts)
    kernel = _kernel("toxicity", impl)
    if kernel is None:
        return torch.tensor(T.toxicity(completions=texts), dtype=torch.float64)
    return _run(kernel, "toxicity", texts, (), "iiiiiiiiiiii")


#: Text kernel rewards by the name of the Python reward they reproduce.
TEXT_KERNELS = {"sentiment": sentiment, "toxicity": toxicity}
