"""Text reward kernels: ``sentiment`` and ``toxicity`` over a batch of completion texts.

    scores_B = sentiment(texts, target="positive")       # float64 (B,)
    scores_B = toxicity(texts)

The same numbers, bit for bit, as the Python rewards of ``materl.ops.text_rewards`` (whose
docstring defines the tokens, the VADER rules kept and the scores). The texts travel as one
buffer of their UTF-8 bytes with B + 1 offsets (``pack_texts``: one join, no copy); the word lists
as one open-addressing hash table with a bitmap filter in front (``table(reward)``, built once per
process from the packaged lexicons).

``impl``: ``"auto"`` (the Mojo kernel ``kernels/text_rewards.mojo`` when it builds, else the
Python reference), ``"mojo"`` (``KernelError`` if it cannot run) or ``"python"``.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from materl.errors import ConfigError, KernelError, ShapeError
from materl.kernels import loader
from materl.ops import text_rewards as T

IMPLS = ("auto", "mojo", "python")
FNV_OFFSET, FNV_PRIME, MIX, MASK64 = 14695981039346656037, 1099511628211, 0x9E3779B97F4A7C15, (1 << 64) - 1


_utf8 = ctypes.pythonapi.PyUnicode_AsUTF8AndSize  # CPython's stable API: the str's UTF-8 bytes, cached in it
_utf8.argtypes, _utf8.restype = [ctypes.py_object, ctypes.c_void_p], ctypes.c_void_p
PAD = "\0" * 8


@dataclass(frozen=True)
class Packed:
    """B texts as the kernels read them: ``address`` of their UTF-8 bytes, concatenated and
    followed by 8 zero bytes (a word's bytes are read 8 at a time, up to 7 past its end), owned by
    ``joined``; ``offsets`` (B + 1,) int64 into them."""
    joined: str
    address: int
    offsets: np.ndarray


def pack_texts(texts: Sequence[str]) -> Packed:
    """One join, no copy: the UTF-8 form of an ASCII str is its own buffer (CPython keeps it),
    and its byte offsets are its lengths; a non-ASCII text's length is that of its encoding."""
    _check_texts(texts)
    joined = "".join([*texts, PAD])
    size = ctypes.c_ssize_t()  # given, so the zero padding is no "embedded null" error (CPython 3.13)
    address = _utf8(joined, ctypes.byref(size))  # raises UnicodeEncodeError, as str.encode does, on a lone surrogate
    sizes = map(len, texts) if all(map(str.isascii, texts)) else (len(t.encode("utf-8")) for t in texts)
    lengths = np.fromiter(sizes, np.int64, len(texts))
    offsets = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Packed(joined, address, offsets)


def _check_texts(texts: Sequence[str]) -> None:
    if isinstance(texts, str):
        raise ShapeError(f"text rewards take a list of B completions, got one string {texts[:40]!r}")


def fnv1a(word: bytes) -> int:
    """The kernel's hash of a (lowercased) word: 64-bit FNV-1a steps over its little-endian 8-byte
    chunks (the last zero-filled), then over its length, then h ^= h >> 32; h *= MIX; h ^= h >> 29
    (chunks rather than bytes: one multiply for most words instead of one a byte)."""
    h = FNV_OFFSET
    for i in range(0, len(word), 8):
        h = ((h ^ int.from_bytes(word[i:i + 8], "little")) * FNV_PRIME) & MASK64
    h = ((h ^ len(word)) * FNV_PRIME) & MASK64
    h ^= h >> 32
    h = (h * MIX) & MASK64
    return h ^ (h >> 29)


@dataclass(frozen=True)
class Table:
    """The lexicon as the kernel reads it (see kernels/text_rewards.mojo)."""
    filter: Tensor  # (1024,) int64: bit h >> 32 & 65535 (of word h >> 38, bit h >> 32 & 63) set for every word's hash h
    slots: Tensor  # (cap,) int64: entry index or -1
    hashes: Tensor  # (cap,) int64: fnv1a of the slot's word (two's complement), 0 for an empty slot
    keys: Tensor  # uint8: the entries' lowercased bytes
    key_offs: Tensor  # (E + 1,) int64
    flags: Tensor  # (E,) int64
    codes: Tensor  # (E,) int64
    info: Tensor  # (E,) int64: flags | code << 8, the token word the kernel keeps
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
    slots, hashes, bits = [-1] * cap, [0] * cap, np.zeros(1024, dtype=np.uint64)
    for k, w in enumerate(words):
        h = fnv1a(w)
        bits[h >> 38 & 1023] |= np.uint64(1 << (h >> 32 & 63))
        slot = h & (cap - 1)
        while slots[slot] >= 0:
            slot = (slot + 1) & (cap - 1)
        slots[slot], hashes[slot] = k, h - (1 << 64) if h >= 1 << 63 else h
    offs = [0]
    for w in words:
        offs.append(offs[-1] + len(w))
    e = [entries[w] for w in words]
    return Table(
        filter=torch.from_numpy(bits.view(np.int64)),
        slots=torch.tensor(slots, dtype=torch.int64),
        hashes=torch.tensor(hashes, dtype=torch.int64),
        keys=torch.frombuffer(bytearray(b"".join(words)), dtype=torch.uint8),
        key_offs=torch.tensor(offs, dtype=torch.int64),
        flags=torch.tensor([x.flags for x in e], dtype=torch.int64),
        codes=torch.tensor([x.code for x in e], dtype=torch.int64),
        info=torch.tensor([x.flags | x.code << 8 for x in e], dtype=torch.int64),
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


def _run(kernel: loader.Kernel, op: str, texts: Sequence[str], extra: tuple, signature: str, *,
         masks: int, scratch: bool) -> Tensor:
    """Pack ``texts``, call ``text_rewards.{op}(text, offsets, B, bit masks, table..., *extra[, scratch,
    max_tokens], out)``: ``masks`` arrays of one bit a byte; a token takes a byte and the space after
    it, so a row of n bytes holds at most n // 2 + 1 tokens."""
    packed = pack_texts(texts)
    offs = packed.offsets
    words = int(offs[-1]) // 64 + 2
    bits = np.empty(masks * words, dtype=np.uint64)
    if scratch:
        max_tokens = int(np.diff(offs).max()) // 2 + 1 if len(texts) else 1
        buf = np.empty(3 * max_tokens, dtype=np.int64)
        extra = (*extra, buf.ctypes.data, max_tokens)
    out = torch.empty(len(texts), dtype=torch.float64)
    t = table(op)
    rc = kernel.function(op, signature)(
        packed.address, offs.ctypes.data, len(texts), bits.ctypes.data, words, t.filter.data_ptr(),
        t.slots.data_ptr(), t.hashes.data_ptr(), len(t.slots), t.keys.data_ptr(), t.key_offs.data_ptr(),
        t.info.data_ptr(), *extra, out.data_ptr())
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
    return _run(kernel, "sentiment", texts, extra, "iiiiiiiiiiiiiifffiii", masks=4, scratch=True)


def toxicity(texts: Sequence[str], *, impl: str = "auto") -> Tensor:
    """``-(listed tokens) / tokens`` per text (``materl.ops.text_rewards.toxicity``). B str -> float64 (B,)."""
    _check_texts(texts)
    kernel = _kernel("toxicity", impl)
    if kernel is None:
        return torch.tensor(T.toxicity(completions=texts), dtype=torch.float64)
    return _run(kernel, "toxicity", texts, (), "iiiiiiiiiiiii", masks=2, scratch=False)


#: Text kernel rewards by the name of the Python reward they reproduce.
TEXT_KERNELS = {"sentiment": sentiment, "toxicity": toxicity}
