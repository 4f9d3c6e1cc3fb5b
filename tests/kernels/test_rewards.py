"""Reward kernels (Mojo and vectorised torch) against the Python built-in rewards, bit for bit."""

import pytest
import torch

from materl.errors import ConfigError, ShapeError
from materl.kernels import rewards as R
from materl.ops import reward_builtins as RB

IMPLS = ["torch", pytest.param("mojo", marks=pytest.mark.mojo)]


def _rows(seed: int = 0, B: int = 24, T: int = 40, vocab: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, vocab, (int(torch.randint(0, T + 1, (1,), generator=g)),), generator=g).tolist()
            for _ in range(B)]
    return rows + [[], [5], [1, 2, 1, 2, 1], [9] * 7, list(range(T))]


def _expected(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_ngram_rewards_equal_the_python_builtins(impl, n):
    rows = _rows(n)
    ids, lengths = R.pad_ids(rows)
    rep = R.repetition(ids, lengths, n=n, impl=impl)
    div = R.diversity(ids, lengths, n=n, impl=impl)
    assert torch.equal(rep, _expected(RB.repetition(completion_ids=rows, n=n)))
    assert torch.equal(div, _expected(RB.diversity(completion_ids=rows, n=n)))


@pytest.mark.parametrize("impl", IMPLS)
def test_hand_computed_ngram_values(impl):
    ids, lengths = R.pad_ids([[1, 2, 1, 2, 1], [4, 4, 4, 4], [], [8]])
    # n=2: [1,2,1,2,1] has windows 12,21,12,21 -> W=4, U=2 -> -(4-2)/4 = -0.5
    #      [4,4,4,4] has 44,44,44 -> W=3, U=1 -> -2/3; [] and [8] have no window -> 0
    assert R.repetition(ids, lengths, n=2, impl=impl).tolist() == [-0.5, -2 / 3, 0.0, 0.0]
    # n=1 diversity: 2 distinct of 5, 1 of 4, empty 0, 1 of 1
    assert R.diversity(ids, lengths, n=1, impl=impl).tolist() == [0.4, 0.25, 0.0, 1.0]


@pytest.mark.parametrize("impl", IMPLS)
def test_padding_beyond_the_length_is_ignored(impl):
    ids = torch.tensor([[1, 2, 3, 1, 2, 3], [5, 6, 5, 6, 5, 6]])
    lengths = torch.tensor([3, 2])  # only 1,2,3 and 5,6 count: nothing repeats
    assert R.repetition(ids, lengths, n=1, impl=impl).tolist() == [0.0, 0.0]
    assert R.pattern_match(ids, lengths, [3, 1], impl=impl).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("params", [{}, {"target": 10}, {"range": (5, 20), "scale": 4.0}, {"target": 0}])
def test_length_equals_the_python_builtin(impl, params):
    rows = _rows(1)
    _, lengths = R.pad_ids(rows)
    assert torch.equal(R.length(lengths, impl=impl, **params), _expected(RB.length(completion_ids=rows, **params)))


@pytest.mark.parametrize("impl", IMPLS)
def test_length_hand_computed(impl):
    # target=100 -> scale 100: L=100 -> 1, 75 or 125 -> 1 - 25/100 = 0.75, 0 or 250 -> 0
    lengths = torch.tensor([100, 75, 125, 0, 250])
    assert R.length(lengths, target=100, impl=impl).tolist() == [1.0, 0.75, 0.75, 0.0, 0.0]


@pytest.mark.parametrize("impl", IMPLS)
def test_length_stats(impl):
    # lengths 2, 4, 6, 8 with budget 8: mean 5, var ((9+1+1+9)/3) -> std sqrt(20/3), one of four at 8
    stats = R.length_stats(torch.tensor([2, 4, 6, 8]), max_length=8, impl=impl)
    assert stats == pytest.approx({"mean": 5.0, "std": (20 / 3) ** 0.5, "min": 2.0, "max": 8.0, "clip_ratio": 0.25})
    empty = R.length_stats(torch.zeros(0, dtype=torch.long), max_length=8, impl=impl)
    assert empty == dict.fromkeys(R.LENGTH_STATS, 0.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_pattern_match(impl):
    rows = _rows(2) + [[7, 8], [0, 7, 8, 9], [7], [8, 7]]
    ids, lengths = R.pad_ids(rows)
    expected = [float(any(r[j:j + 2] == [7, 8] for j in range(len(r) - 1))) for r in rows]
    got = R.pattern_match(ids, lengths, [7, 8], impl=impl)
    assert got.tolist() == expected and expected[-4:] == [1.0, 1.0, 0.0, 0.0]
    long_pattern = R.pattern_match(ids, lengths, list(range(ids.shape[1] + 1)), impl=impl)
    assert long_pattern.tolist() == [0.0] * len(rows)  # longer than any row


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_inputs_raise(impl):
    ids, lengths = R.pad_ids([[1, 2, 3]])
    with pytest.raises(ShapeError, match=r"outside \[0, T\]|lie in \[0, T=3\]"):
        R.repetition(ids, torch.tensor([4]), impl=impl)
    with pytest.raises(ConfigError, match="n must be an integer >= 1, got 0"):
        R.diversity(ids, lengths, n=0, impl=impl)
    with pytest.raises(ConfigError, match="empty"):
        R.pattern_match(ids, lengths, [], impl=impl)
    with pytest.raises(ShapeError, match="ids"):
        R.repetition(ids[0], lengths, impl=impl)
    with pytest.raises(ConfigError, match="not both"):
        R.length(lengths, target=3, range=(1, 2), impl=impl)


def test_unknown_impl_and_reward_names():
    ids, lengths = R.pad_ids([[1]])
    with pytest.raises(ConfigError, match="auto, mojo, torch"):
        R.repetition(ids, lengths, impl="cuda")
    with pytest.raises(ConfigError, match="valid: repetition, diversity, length, pattern_match"):
        R.score_completions("format", [[1]])


@pytest.mark.parametrize("impl", IMPLS)
def test_score_completions_takes_the_python_batch_form(impl):
    rows = _rows(3)
    got = R.score_completions("repetition", rows, n=2, impl=impl)
    assert torch.equal(got, _expected(RB.repetition(completion_ids=rows, n=2)))
    assert torch.equal(R.score_completions("length", rows, target=7, impl=impl),
                       _expected(RB.length(completion_ids=rows, target=7)))


def test_torch_general_path_for_large_ids():
    # ids too large for the exact 1-D int64 encoding take the unique(dim=0) path
    rows = [[2**40, 2**41, 2**40, 2**41], [2**50, 3, 2**50, 3, 2**50]]
    ids, lengths = R.pad_ids(rows)
    expected = _expected(RB.repetition(completion_ids=rows, n=3))
    assert torch.equal(R.repetition(ids, lengths, n=3, impl="torch"), expected)
