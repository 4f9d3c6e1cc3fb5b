"""The sentiment and toxicity rewards (materl.ops.text_rewards): hand-computed values, and VADER's
own polarity_scores where the kept rules apply."""

import math
import random

import pytest
from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

import materl as ml
from materl.errors import ConfigError
from materl.ops import text_rewards as T

# vader_lexicon.txt: good 1.9, bad -2.5, happy 2.7; boosters +-0.293, caps 0.733, negation x -0.74


def norm(s: float) -> float:
    return s / math.sqrt(s * s + 15.0)


def test_lexicon_values_used_below():
    table, k = T.lexicon()
    assert (table[b"good"].valence, table[b"bad"].valence, table[b"happy"].valence) == (1.9, -2.5, 2.7)
    assert (k.b_incr, k.c_incr, k.n_scalar) == (0.293, 0.733, -0.74)
    assert table[b"very"].flags & T.BOOSTER and table[b"not"].flags & T.NEGATION


@pytest.mark.parametrize("text, total", [
    ("good", 1.9),
    ("not good", 1.9 * -0.74),                      # negation of the word before
    ("very good!", (1.9 + 0.293) + 0.292),          # booster, then one "!" on a positive sum
    ("very very good", (1.9 + 0.293) + 0.293 * 0.95),  # the second booster is 2 words away: x0.95
    ("GOOD day", 1.9 + 0.733),                      # ALL CAPS while another token is not
    ("GOOD DAY", 1.9),                              # every token in caps: no emphasis
    ("good but bad", 1.9 * 0.5 + -2.5 * 1.5),       # "but": x0.5 before it, x1.5 after it
    ("bad??", -2.5 - 2 * 0.18),                     # two "?" on a negative sum
    ("hello world", 0.0),
])
def test_hand_computed_compound(text, total):
    assert T.compound(text) == pytest.approx(norm(total), rel=1e-12, abs=1e-15)


def test_tokens_strip_punctuation_unless_it_is_an_emoticon():
    assert T.tokens("  Good!!  :)  (yes)\tno.  ") == [b"Good", b":)", b"yes", b"no."]


def test_empty_text_is_neutral():
    assert T.compound("") == 0.0 and T.compound(" \n ") == 0.0


@pytest.mark.parametrize("target, expected", [
    ("positive", norm(1.9)), ("negative", -norm(1.9)), ("neutral", 1 - norm(1.9)), (0.5, 1 - abs(norm(1.9) - 0.5)),
])
def test_sentiment_reward_targets(target, expected):
    assert T.sentiment(completions=["good"], target=target)[0] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("bad", ["happy", 2.0, True, None])
def test_sentiment_target_errors_name_the_value(bad):
    with pytest.raises(ConfigError, match=f"got {bad!r}"):
        T.sentiment(completions=["good"], target=bad)


def test_toxicity_is_minus_the_share_of_listed_tokens():
    # "shit" and "fuck" are on better-profanity's list; "you", "are", "fine" are not
    assert T.toxicity(completions=["you shit!", "You are fine.", "", "FUCK"]) == [-0.5, 0.0, 0.0, -1.0]
    assert "shit" in T.toxic_words() and all(" " not in w for w in T.toxic_words())


def test_registered_as_rewards():
    from materl.ops.rewards import REWARDS, Reward

    assert {"sentiment", "toxicity"} <= set(REWARDS.names())
    total = (Reward.from_spec("sentiment", 2.0, target="negative") + Reward.from_spec("toxicity")).score(
        completions=["bad", "shit"])
    # negative target: 1 - |c + 1| = -c for c <= 0; "shit" is one listed token of one: toxicity -1
    expected = [2 * norm(2.5), 2 * -T.compound("shit") - 1.0]
    assert total.tolist() == pytest.approx(expected, rel=1e-6)


# VADER rules this definition drops (module docstring): avoid their trigger words
DROPPED = {"kind", "sort", "just", "enough", "the", "shit", "bomb", "ass", "bus", "stop", "yeah", "right", "kiss",
           "death", "die", "for", "to", "beating", "heart", "of"}


def _sentences(n: int, seed: int = 0) -> list[str]:
    from vaderSentiment import vaderSentiment as vs

    table, _ = T.lexicon()
    rng = random.Random(seed)
    lex = sorted(w.decode() for w, e in table.items() if e.flags & T.IN_LEXICON and w.isalpha()
                 and w.decode() not in DROPPED)
    boosters = sorted(w for w in vs.BOOSTER_DICT if " " not in w and w not in DROPPED)
    special = ["not", "never", "no", "so", "this", "without", "doubt", "least", "at", "very", "or", "nor",
               "isn't", "don't", "cannot"]
    filler = ["i", "it", "was", "movie", "we", "food", "day", "is", "a", "and"]
    out = []
    for _ in range(n):
        words = []
        for _ in range(rng.randint(1, 14)):
            pool = rng.choice([lex, lex, boosters, special, filler, filler])
            w = rng.choice(pool)
            w = w.upper() if rng.random() < 0.1 else w
            words.append(w + rng.choice(["", "", "", "!", "?", ",", "."]))
        out.append(" ".join(words))
    return out


def test_agrees_with_vader_polarity_scores():
    """Where no dropped rule applies, VADER's own compound (rounded to 4 places) is ours rounded."""
    sia = SentimentIntensityAnalyzer()
    texts = _sentences(400) + ["VADER is VERY SMART, handsome, and FUNNY!!!", "The food was not great.",
                                "never so happy", "least good", "at least it works", "no problem",
                                "the movie was good, but the ending was terrible"]
    diffs = [(t, T.compound(t), sia.polarity_scores(t)["compound"]) for t in texts]
    bad = [(t, round(a, 4), b) for t, a, b in diffs if abs(round(a, 4) - b) > 1.1e-4]
    assert not bad, bad[:5]


def test_dropped_rule_is_where_vader_differs():
    # "kind of" as a multi-word dampener is one of the dropped rules: VADER adds -0.293 to "bad"
    sia = SentimentIntensityAnalyzer()
    assert round(T.compound("It is kind of bad"), 4) != sia.polarity_scores("It is kind of bad")["compound"]
