"""Token edge cases of the text reward kernels (kernels/text_rewards.mojo finds tokens on 64-bit
masks, one bit a byte, and hashes words 8 bytes at a time): words that straddle a mask word or
end a row at any of the 64 offsets, words of 1-23 bytes, tokens longer than 64 bytes, and the
packing of non-ASCII, NUL-holding and surrogate texts. Expectations are counted by hand, and the
kernel must equal the Python reference bit for bit."""

import pytest
import torch

from materl.kernels import text_rewards as K
from materl.ops import text_rewards as T

IMPLS = ["python", pytest.param("mojo", marks=pytest.mark.mojo)]


@pytest.mark.parametrize("impl", IMPLS)
def test_a_listed_word_at_every_offset_of_a_mask_word(impl):
    # row k: k filler bytes "a a a ..." (k // 2 tokens, or k // 2 + 1 when odd), then the word:
    # every row starts where the previous one ends, so the word's bytes sit at every offset mod 64
    for word in ("fuck", "motherfucker", "fuckingshitmotherfucker", "(shit)"):
        texts = [("a " * (k // 2) + "a" * (k % 2) + " " * (k % 2) + word) for k in range(130)]
        tokens = [k // 2 + k % 2 + 1 for k in range(130)]
        want = [0.0 - 1 / n for n in tokens]
        assert K.toxicity(texts, impl=impl).tolist() == want, word
        assert K.toxicity([t + " " for t in texts], impl=impl).tolist() == want, word


@pytest.mark.parametrize("impl", IMPLS)
def test_long_tokens_and_stripping_beyond_64_bytes(impl):
    texts = ["!" * 70 + "shit" + "?" * 70,  # stripped to "shit" across three mask words: 1 of 1 listed
             "(" * 65 + ")",  # all punctuation: kept whole, not listed
             "shit" + "-" * 100 + "shit",  # one token, internal punctuation kept: not listed
             "x" * 64 + " shit",  # a 64-byte token then a listed one: 1 of 2
             "SHIT " + "y" * 200]  # capitals are lowercased for the lookup: 1 of 2
    assert K.toxicity(texts, impl=impl).tolist() == [-1.0, 0.0, 0.0, -0.5, -0.5]


@pytest.mark.parametrize("impl", IMPLS)
def test_word_lengths_around_the_8_byte_chunks(impl):
    # every lexicon word of 1 to 19 bytes is found whatever its length mod 8 (a hash miss would
    # score 0): each text is one lexicon word, its score is its valence's compound
    table, _ = T.lexicon()
    by_len = {}
    for w, e in table.items():
        if e.flags == T.IN_LEXICON and not e.code and w.isalpha() and abs(e.valence) > 0.5:
            by_len.setdefault(len(w), w.decode())
    words = [by_len[n] for n in sorted(by_len)]
    assert {len(w) for w in words} >= set(range(2, 20)) - {18}
    got = K.sentiment(words, target="positive", impl=impl)
    want = [table[w.encode()].valence / (table[w.encode()].valence ** 2 + 15) ** 0.5 for w in words]
    assert got.tolist() == pytest.approx(want, rel=1e-12, abs=0)
    assert all(v != 0 for v in got.tolist())


@pytest.mark.mojo
def test_packing_of_odd_texts_matches_the_reference():
    odd = ["naïve café GOOD 😀 bad", "nul\0inside good", "\0", "ünïcödé" * 20 + " shit", "Ω good!!", ""]
    texts = odd + [f"{o} {p}" for o in odd for p in odd]
    for fn, ref in ((K.sentiment, T.sentiment), (K.toxicity, T.toxicity)):
        assert torch.equal(fn(texts, impl="mojo"), torch.tensor(ref(completions=texts), dtype=torch.float64))
    packed = K.pack_texts(["ab", "ü", ""])
    assert packed.offsets.tolist() == [0, 2, 4, 4]
    with pytest.raises(UnicodeEncodeError):
        K.toxicity(["bad \ud800 surrogate"], impl="mojo")


def test_the_hash_table_filter_holds_every_word():
    for which in ("sentiment", "toxicity"):
        t = K.table(which)
        bits = t.filter.view(torch.int64).tolist()
        for w in [w for w, e in T.lexicon()[0].items() if which == "sentiment" or e.flags & T.TOXIC][::5]:
            h = K.fnv1a(w)
            assert (bits[h >> 38 & 1023] >> (h >> 32 & 63)) & 1, w
