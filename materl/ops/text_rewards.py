"""Lexicon rewards on the completion text: ``sentiment`` (VADER's compound score) and
``toxicity`` (the share of words on a profanity list). Both read lexicons that ship inside PyPI
packages (nothing is downloaded): ``vadersentiment`` 3.3.2 (MIT; ``vader_lexicon.txt``, its
``BOOSTER_DICT``, ``NEGATE`` and constants) and ``better-profanity`` 0.7.0 (MIT;
``profanity_wordlist.txt``). This is the Python reference; ``materl.kernels.text_rewards`` runs
the same definition in Mojo and gives the same float64 numbers bit for bit.

Tokens (both rewards): the completion's UTF-8 bytes split on ASCII whitespace
(``bytes.split()``); each token loses its leading and trailing ASCII punctuation
(``string.punctuation``) unless fewer than 3 bytes would remain (then it is kept whole, so
``:)`` survives); words are compared ASCII-lowercased (``bytes.lower()``), ALL-CAPS is
``bytes.isupper()``. This is VADER's ``SentiText`` on bytes: for ASCII text it is identical.

sentiment: VADER's ``polarity_scores(text)["compound"]`` (Hutto & Gilbert 2014), unrounded,
keeping these rules of vaderSentiment 3.3.2 exactly as written there: lexicon valence; booster
words score 0 themselves; "kind of" scores 0; ALL-CAPS emphasis (+-0.733 when some but not all
tokens are upper case); boosters/dampeners among the 3 preceding non-lexicon tokens (+-0.293,
damped x0.95 and x0.9 with distance, +-0.733 if in caps); negation of each of the 3 preceding
non-lexicon tokens (``NEGATE`` or containing "n't": x -0.74) with the "never so/this" (x1.25)
and "without doubt" exceptions, including VADER's third-word test that multiplies by 1.25
whenever the word just before is "so" or "this"; the "no" rules; the "least" rule; the "but"
rule (x0.5 before the first "but", x1.5 after it); "!" (up to 4, +0.292 each) and "?" (2-3:
+0.18 each, more: +0.96) emphasis; ``compound = s / sqrt(s*s + 15)`` clamped to [-1, 1].
Dropped: emoji descriptions (non-ASCII emoji are plain bytes here), VADER's special idioms
(``SPECIAL_CASES`` such as "the bomb", and the multi-word boosters "kind of"/"sort of"/"just
enough" as boosters), Unicode case and whitespace rules. The "but" rule is the intended one;
VADER's list-``index`` loop differs from it only when two sentiments are equal after scaling.
tests/ops/test_text_rewards.py compares with ``polarity_scores`` where these rules apply.

    r_i = 1 - |compound_i - t|,   t = 1 ("positive"), -1 ("negative"), 0 ("neutral") or a number in [-1, 1]

toxicity: ``r_i = -(tokens on the list) / tokens``, 0 for a completion without tokens. The list
is better-profanity's single-word entries, lowercased (its 26 multi-word phrases and its
leetspeak variants are not used). No TRL/verl built-in for either; TRL's sentiment examples call
a hub classifier, which cannot run here.
"""

from __future__ import annotations

import functools
import importlib.resources
import math
import numbers
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from materl.errors import ConfigError
from materl.ops.rewards import REWARDS

PUNCT = string.punctuation.encode()
TARGETS = {"positive": 1.0, "negative": -1.0, "neutral": 0.0}
ALPHA = 15.0  # VADER's normalisation constant

# flags of a lexicon entry (the kernel reads the same bits)
IN_LEXICON, BOOSTER, NEGATION, TOXIC = 1, 2, 4, 8
# special words VADER's rules compare against (code of an entry; 0 for every other word)
SPECIAL = ("no", "never", "so", "this", "without", "doubt", "least", "at", "very", "or", "nor", "but", "kind", "of")
CODE = {w.encode(): k + 1 for k, w in enumerate(SPECIAL)}
NO, NEVER, SO, THIS, WITHOUT, DOUBT, LEAST, AT, VERY, OR, NOR, BUT, KIND, OF = range(1, len(SPECIAL) + 1)


@dataclass(frozen=True)
class Entry:
    flags: int = 0
    valence: float = 0.0  # VADER lexicon mean rating (IN_LEXICON)
    booster: float = 0.0  # +-0.293 (BOOSTER)
    code: int = 0  # 1 + index in SPECIAL, or 0


@dataclass(frozen=True)
class Constants:
    b_incr: float
    c_incr: float
    n_scalar: float


@functools.lru_cache(maxsize=1)
def lexicon() -> tuple[dict[bytes, Entry], Constants]:
    """Every word the two rewards look up (lowercased bytes -> Entry) and VADER's constants."""
    try:
        from vaderSentiment import vaderSentiment as vs
    except ImportError as e:  # a core dependency; only a broken install lacks it
        raise ConfigError(f"the sentiment reward needs the vadersentiment package (pip install vadersentiment): {e}")
    words: dict[bytes, dict[str, Any]] = {}

    def entry(word: str) -> dict[str, Any]:
        return words.setdefault(word.encode("utf-8").lower(), {"flags": 0})

    text = (importlib.resources.files("vaderSentiment") / "vader_lexicon.txt").read_text(encoding="utf-8")
    for line in text.rstrip("\n").split("\n"):  # VADER's make_lex_dict
        if line:
            word, measure = line.strip().split("\t")[0:2]
            if word.encode("utf-8") != word.encode("utf-8").lower():
                continue  # VADER looks up item.lower(): an entry with capitals never matches
            e = entry(word)
            e["flags"] |= IN_LEXICON
            e["valence"] = float(measure)
    for word, scalar in vs.BOOSTER_DICT.items():
        if " " not in word:
            e = entry(word)
            e["flags"] |= BOOSTER
            e["booster"] = scalar
    for word in vs.NEGATE:
        entry(word)["flags"] |= NEGATION
    for word in SPECIAL:
        entry(word)["code"] = CODE[word.encode()]
    for word in toxic_words():
        entry(word)["flags"] |= TOXIC
    consts = Constants(b_incr=vs.B_INCR, c_incr=vs.C_INCR, n_scalar=vs.N_SCALAR)
    return {w: Entry(**e) for w, e in words.items()}, consts


def toxic_words() -> list[str]:
    """better-profanity's word list: its single-word entries, lowercased, in file order."""
    try:
        text = (importlib.resources.files("better_profanity") / "profanity_wordlist.txt").read_text(encoding="utf-8")
    except ModuleNotFoundError as e:
        raise ConfigError(f"the toxicity reward needs the better-profanity package (pip install better-profanity): "
                          f"{e}") from None
    return [w.strip().lower() for w in text.splitlines() if w.strip() and " " not in w.strip()]


def tokens(text: str) -> list[bytes]:
    """VADER's tokens of ``text`` on its UTF-8 bytes (see the module docstring)."""
    out = []
    for tok in text.encode("utf-8").split():
        stripped = tok.strip(PUNCT)
        out.append(stripped if len(stripped) > 2 else tok)
    return out


def negated(low: bytes, e: Entry | None) -> bool:
    """VADER's ``negated([word])``: a NEGATE word, or a word containing "n't"."""
    return (e is not None and bool(e.flags & NEGATION)) or b"n't" in low


def _scalar(j: int, v: float, ents, upper, cap_diff: bool, k: Constants) -> float:
    """VADER's ``scalar_inc_dec`` of token j for a word of valence v."""
    e = ents[j]
    if e is None or not e.flags & BOOSTER:
        return 0.0
    s = e.booster
    if v < 0:
        s *= -1
    if upper[j] and cap_diff:
        s = s + k.c_incr if v > 0 else s - k.c_incr
    return s


def _negation(v: float, step: int, i: int, low, ents, codes, k: Constants) -> float:
    """VADER's ``_negation_check`` for the token ``step + 1`` places before i."""
    j = i - step - 1
    if step == 1:
        if codes[i - 2] == NEVER and codes[i - 1] in (SO, THIS):
            return v * 1.25
        if codes[i - 2] == WITHOUT and codes[i - 1] == DOUBT:
            return v
    if step == 2:
        if (codes[i - 3] == NEVER and codes[i - 2] in (SO, THIS)) or codes[i - 1] in (SO, THIS):
            return v * 1.25
        if codes[i - 3] == WITHOUT and DOUBT in (codes[i - 2], codes[i - 1]):
            return v
    return v * k.n_scalar if negated(low[j], ents[j]) else v


def _valence(i: int, low, ents, codes, in_lex, upper, cap_diff: bool, k: Constants) -> float:
    """Token i's sentiment (VADER's ``polarity_scores`` loop body and ``sentiment_valence``)."""
    n, e = len(low), ents[i]
    if e is not None and e.flags & BOOSTER:
        return 0.0
    if codes[i] == KIND and i < n - 1 and codes[i + 1] == OF:
        return 0.0
    if not in_lex[i]:
        return 0.0
    v = e.valence
    if codes[i] == NO and i != n - 1 and in_lex[i + 1]:
        v = 0.0
    if (i > 0 and codes[i - 1] == NO) or (i > 1 and codes[i - 2] == NO) or \
            (i > 2 and codes[i - 3] == NO and codes[i - 1] in (OR, NOR)):
        v = e.valence * k.n_scalar
    if upper[i] and cap_diff:
        v = v + k.c_incr if v > 0 else v - k.c_incr
    for step in range(3):
        j = i - step - 1
        if j >= 0 and not in_lex[j]:
            s = _scalar(j, v, ents, upper, cap_diff, k)
            if step == 1 and s != 0:
                s = s * 0.95
            if step == 2 and s != 0:
                s = s * 0.9
            v = v + s
            v = _negation(v, step, i, low, ents, codes, k)
    if i > 1 and not in_lex[i - 1] and codes[i - 1] == LEAST:
        if codes[i - 2] != AT and codes[i - 2] != VERY:
            v = v * k.n_scalar
    elif i > 0 and not in_lex[i - 1] and codes[i - 1] == LEAST:
        v = v * k.n_scalar
    return v


def emphasis(text: bytes) -> float:
    """VADER's ``_punctuation_emphasis``: "!" (at most 4) x 0.292, plus "?" x 0.18 for 2-3 of
    them or 0.96 for more."""
    ep = min(text.count(b"!"), 4) * 0.292
    qm = text.count(b"?")
    return ep + ((qm * 0.18 if qm <= 3 else 0.96) if qm > 1 else 0.0)


def compound(text: str) -> float:
    """VADER's compound score of ``text`` under the rules of the module docstring (unrounded)."""
    table, k = lexicon()
    toks = tokens(text)
    if not toks:
        return 0.0
    low = [t.lower() for t in toks]
    ents = [table.get(w) for w in low]
    upper = [t.isupper() for t in toks]
    n_upper = sum(upper)
    cap_diff = 0 < len(toks) - n_upper < len(toks)
    codes = [e.code if e is not None else 0 for e in ents]
    in_lex = [e is not None and bool(e.flags & IN_LEXICON) for e in ents]
    sentiments = [_valence(i, low, ents, codes, in_lex, upper, cap_diff, k) for i in range(len(toks))]
    bi = next((i for i, e in enumerate(ents) if e is not None and e.code == BUT), None)
    if bi is not None:
        sentiments = [s * 0.5 if i < bi else s * 1.5 if i > bi else s for i, s in enumerate(sentiments)]
    total = 0.0
    for s in sentiments:
        total += s
    amp = emphasis(text.encode("utf-8"))
    if total > 0:
        total += amp
    elif total < 0:
        total -= amp
    c = total / math.sqrt(total * total + ALPHA)
    return -1.0 if c < -1.0 else 1.0 if c > 1.0 else c


def sentiment_target(target: Any) -> float:
    """``t`` of the sentiment reward: a name in ``TARGETS`` or a number in [-1, 1]."""
    if isinstance(target, str) and target in TARGETS:
        return TARGETS[target]
    if isinstance(target, numbers.Real) and not isinstance(target, bool) and -1.0 <= float(target) <= 1.0:
        return float(target)
    raise ConfigError(f"sentiment: target must be one of {', '.join(TARGETS)} or a number in [-1, 1]; "
                      f"got {target!r}")


@REWARDS.register("sentiment")
def sentiment(*, completions: Sequence[str], target: Any = "positive", **kwargs: Any) -> list[float]:
    """``1 - |compound - t|`` per completion: VADER's compound score (module docstring) against
    the target t (``"positive"`` = 1 gives the compound itself, ``"negative"`` = -1 its
    negation, ``"neutral"`` = 0 gives 1 for neutral text). (B strings) -> B floats in [-1, 1]."""
    t = sentiment_target(target)
    return [1.0 - abs(compound(text) - t) for text in completions]


def toxic_fraction(text: str) -> float:
    """Tokens of ``text`` on the profanity list / tokens (0 without tokens)."""
    table, _ = lexicon()
    toks = tokens(text)
    if not toks:
        return 0.0
    hits = 0
    for t in toks:
        e = table.get(t.lower())
        hits += e is not None and bool(e.flags & TOXIC)
    return hits / len(toks)


@REWARDS.register("toxicity")
def toxicity(*, completions: Sequence[str], **kwargs: Any) -> list[float]:
    """Minus the share of a completion's tokens on better-profanity's word list (module
    docstring): 0 for clean text, -1 when every token is on it. (B strings) -> B floats."""
    return [0.0 - toxic_fraction(text) for text in completions]
