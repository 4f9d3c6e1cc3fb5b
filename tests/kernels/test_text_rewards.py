"""Text reward kernels (Mojo) against the Python reference of materl.ops.text_rewards, bit for bit."""

import random

import pytest
import torch

import materl as ml

from materl.errors import ConfigError, ShapeError
from materl.kernels import text_rewards as K
from materl.ops import text_rewards as T
from tests.ops.test_text_rewards import _sentences, norm

IMPLS = ["python", pytest.param("mojo", marks=pytest.mark.mojo)]


def _texts(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    odd = ["", "   ", "!!!", "?? ??", ":) :( :D", "naïve café GOOD 😀 bad", "a" * 300, "shit " * 50,
           "Don't you DARE say it isn't good!!", "x\ty\nz\x0bw\x0cv\rgood", "no good at all", "fuck off, you ass-fucker"]
    words = ["good", "bad", "very", "not", "shit", "happy", "BUT", "but", "least", "at", "!", "kind", "of", "never",
             "so", "this", "no", "nor", "or", "can't", "(great)", "..."]
    mixed = [" ".join(rng.choice(words) for _ in range(rng.randint(0, 30))) for _ in range(60)]
    return odd + mixed + _sentences(200, seed=seed + 1)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("target", ["positive", "negative", "neutral", 0.25])
def test_sentiment_equals_the_python_reward(impl, target):
    texts = _texts(1)
    got = K.sentiment(texts, target=target, impl=impl)
    assert got.dtype == torch.float64
    assert torch.equal(got, torch.tensor(T.sentiment(completions=texts, target=target), dtype=torch.float64))


@pytest.mark.parametrize("impl", IMPLS)
def test_toxicity_equals_the_python_reward(impl):
    texts = _texts(2)
    assert torch.equal(K.toxicity(texts, impl=impl), torch.tensor(T.toxicity(completions=texts), dtype=torch.float64))


@pytest.mark.parametrize("impl", IMPLS)
def test_hand_computed_values(impl):
    # good 1.9 negated by "not": 1.9 * -0.74 (the reward 1 - |c - 1| rounds c once more); toxicity: 1 of 2 listed
    got = K.sentiment(["not good", ""], target="positive", impl=impl).tolist()
    assert got == pytest.approx([norm(1.9 * -0.74), 0.0], rel=1e-14, abs=0)
    assert K.toxicity(["you shit!", "fine", ""], impl=impl).tolist() == [-0.5, 0.0, 0.0]


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_batch(impl):
    assert K.sentiment([], impl=impl).shape == (0,) and K.toxicity([], impl=impl).shape == (0,)


def test_bad_arguments_are_named():
    with pytest.raises(ConfigError, match="impl must be one of auto, mojo, python; got 'torch'"):
        K.toxicity(["x"], impl="torch")
    with pytest.raises(ShapeError, match="list of B completions"):
        K.sentiment("good")
    with pytest.raises(ConfigError, match="got 'happy'"):
        K.sentiment(["good"], target="happy")


@pytest.mark.parametrize("which", ["sentiment", "toxicity"])
def test_table_finds_every_word(which):
    table = K.table(which)
    words = [w for w, e in T.lexicon()[0].items() if which == "sentiment" or e.flags & T.TOXIC]
    assert len(table.flags) == len(words) and (which == "sentiment" or bool((table.flags & T.TOXIC).all()))
    cap = len(table.slots)
    for k in range(0, len(words), 7):
        slot = K.fnv1a(words[k]) & (cap - 1)
        while int(table.slots[slot]) != k:
            assert int(table.slots[slot]) >= 0, f"{words[k]!r} not found"
            slot = (slot + 1) & (cap - 1)


@ml.recipe
def text_grpo(policy, ref_policy, prompts):
    completions = ml.generate(policy, prompts, name="completions")
    policy_logprobs = ml.logprobs(policy, prompts, completions, name="policy_logprobs")
    ref_logprobs = ml.logprobs(ref_policy, prompts, completions, name="ref_logprobs")
    rewards = ml.reward("sentiment", weight=0.5, target="neutral") + ml.reward("toxicity", weight=0.5)
    advantages = ml.advantages(rewards, name="advantages")
    ml.set_loss(ml.grpo_loss(advantages, policy_logprobs, ref_logprobs))


@pytest.mark.mojo
def test_compiled_recipe_runs_the_text_kernels_with_the_same_numbers():
    results = []
    for kernels in ("torch", "auto"):
        torch.manual_seed(0)
        step = ml.compile(text_grpo, policy=ml.Agent("tiny-random", trainable=True), ref_policy=ml.Agent("tiny-random"),
                          group_size=2, max_new_tokens=8, kernels=kernels, seed=0)
        assert ("fused: sentiment + toxicity in %rewards" in step.explain()) == (kernels == "auto")
        m = step.run(prompts=["a", "b"])
        results.append({k: m[k] for k in ("reward", "reward/sentiment/mean", "reward/toxicity/mean")})
    assert results[0] == results[1]
