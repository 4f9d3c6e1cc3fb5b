"""Rewards: built-ins against hand-computed values, composition, validation and aggregation."""

from __future__ import annotations

import math
import threading

import anyio
import numpy as np
import pytest
import torch

from materl.errors import ConfigError, RewardError, ShapeError, UnknownNameError
from materl.ops.reward_builtins import distinct_ngram_fraction, pareto_rank, repeated_ngram_fraction
from materl.ops.rewards import REWARD_AGGREGATORS, REWARDS, Reward, RewardSum, VectorReward
from materl.rollout.types import Rollout, Step, ToolCall, ToolResult


def batch(completions=None, completion_ids=None, **columns):
    n = len(completions if completions is not None else completion_ids)
    completions = completions if completions is not None else ["x"] * n
    completion_ids = completion_ids if completion_ids is not None else [[1] for _ in range(n)]
    return dict(completions=completions, prompts=["p"] * n, completion_ids=completion_ids, rollouts=None, **columns)


def const(values, name=None):
    """A reward returning fixed values, whatever the batch."""
    def fn(**kwargs):
        return list(values)
    fn.__name__ = name or "const"
    return fn


def close(t, expected):
    torch.testing.assert_close(t, torch.tensor(expected, dtype=torch.float32), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- built-ins


def test_length_target_range_scale_and_default():
    ids = [[0] * n for n in (100, 75, 130, 250)]
    # target=100, scale=max(hi,1)=100: d = 0, 25, 30, 150 -> 1, 0.75, 0.7, max(0, -0.5)=0
    close(Reward.from_spec("length", target=100).score(**batch(completion_ids=ids)), [1.0, 0.75, 0.7, 0.0])
    ids = [[0] * n for n in (5, 15, 30, 22)]
    # range=(10,20), scale=20: d = 5, 0, 10, 2 -> 0.75, 1, 0.5, 0.9
    close(Reward.from_spec("length", range=(10, 20)).score(**batch(completion_ids=ids)), [0.75, 1.0, 0.5, 0.9])
    # scale=5: 1-5/5=0, 1, max(0,1-10/5)=0, 1-2/5=0.6
    close(Reward.from_spec("length", range=(10, 20), scale=5).score(**batch(completion_ids=ids)),
          [0.0, 1.0, 0.0, 0.6])
    # no target/range: target=128, scale 128: L=128 -> 1, L=64 -> 1-64/128 = 0.5, L=0 -> 0
    ids = [[0] * 128, [0] * 64, []]
    close(Reward.from_spec("length").score(**batch(completion_ids=ids)), [1.0, 0.5, 0.0])


def test_length_rejects_target_and_range_together():
    with pytest.raises(ConfigError, match=r"not both.*target=5"):
        Reward.from_spec("length", target=5, range=(1, 2)).score(**batch(completion_ids=[[1]]))


def test_format_search_and_full_match():
    texts = ["x <answer>12</answer>", "<answer>12</answer>", "<answer>ab</answer>", "<answer>\n7</answer>"]
    # search finds the tag anywhere: 1, 1, 0 (not digits), 0 (newline is not \d)
    close(Reward.from_spec("format", regex=r"<answer>\d+</answer>").score(**batch(texts)), [1, 1, 0, 0])
    # fullmatch also rejects the leading "x "
    close(Reward.from_spec("format", regex=r"<answer>\d+</answer>", full_match=True).score(**batch(texts)),
          [0, 1, 0, 0])
    # DOTALL by default: ".*" crosses the newline in row 3
    close(Reward.from_spec("format", regex=r"^<answer>.*</answer>$").score(**batch(texts)), [0, 1, 1, 1])


def test_format_bad_regex_and_missing_regex():
    with pytest.raises(ConfigError, match=r"does not compile"):
        Reward.from_spec("format", regex="(").score(**batch(["a"]))
    with pytest.raises(RewardError, match=r"'format' cannot take this batch.*regex"):
        Reward.from_spec("format").score(**batch(["a"]))


def test_exact_match_normalisation_and_extract():
    texts = ["  Paris ", "paris", "PARIS\n", "Lyon", "Paris"]
    b = batch(texts, answer=["Paris"] * 5)
    # whitespace stripped/collapsed and casefolded: only "Lyon" differs
    close(Reward.from_spec("exact_match").score(**b), [1, 1, 1, 0, 1])
    close(Reward.from_spec("exact_match", normalize=False).score(**b), [0, 0, 0, 0, 1])
    b = batch(["so <answer> 42 </answer>", "no tags 42", "<answer>41</answer>"], answer=[42, 42, 42])
    # extracted " 42 " normalises to "42" == str(42); no match -> 0; "41" != "42"
    close(Reward.from_spec("exact_match", extract=r"<answer>(.*?)</answer>").score(**b), [1, 0, 0])


def test_math_answer_latex_and_numbers():
    gold = ["42", r"\frac{1}{2}", r"\sqrt{2}", "3", "$x^2+1$", "42", "7"]
    texts = [
        "The answer is 42.",           # number in prose -> 42 == 42
        r"so $\boxed{0.5}$",           # 0.5 == 1/2
        r"$\boxed{\sqrt 2}$",          # bare gold \sqrt{2} only parses as $\sqrt{2}$ (retry)
        "I think 4",                   # 4 != 3
        r"$\boxed{1+x^2}$",            # symbolic equality
        "",                            # nothing to parse -> 0
        r"\boxed{7} but maybe 8",      # boxed answer is tried first
    ]
    close(Reward.from_spec("math_answer").score(**batch(texts, answer=gold)), [1, 1, 1, 0, 1, 0, 1])


def test_math_answer_off_the_main_thread():
    # SIGALRM timeouts only work on the main thread; elsewhere math_answer runs without one
    out = []
    worker = threading.Thread(target=lambda: out.append(
        Reward.from_spec("math_answer").score(completions=[r"$\boxed{\frac{3}{6}}$", "0.4"], answer=["0.5", "0.5"])))
    worker.start()
    worker.join()
    close(out[0], [1, 0])  # 3/6 == 0.5; 0.4 != 0.5


def test_repetition_and_diversity_definitions():
    ids = [[5, 6, 7, 5, 6, 7, 5], [1, 2, 1, 2, 1], [1, 2], [], [9]]
    # n=3, row 0: windows 567,675,756,567,675 -> W=5, U=3 -> -(5-3)/5 = -0.4
    # row 1: windows 121,212,121 -> W=3, U=2 -> -1/3; rows 2-4 shorter than 3 -> 0
    close(Reward.from_spec("repetition").score(**batch(completion_ids=ids)), [-0.4, -1 / 3, 0, 0, 0])
    # n=2, row 0: 56,67,75,56,67,75 -> W=6, U=3 -> -0.5; row 1: 12,21,12,21 -> W=4, U=2 -> -0.5;
    # row 2: one window -> 0; rows 3-4 too short -> 0
    close(Reward.from_spec("repetition", n=2).score(**batch(completion_ids=ids)), [-0.5, -0.5, 0, 0, 0])
    # diversity n=1: distinct/len = 3/7, 2/5, 2/2, empty -> 0, 1/1
    close(Reward.from_spec("diversity").score(**batch(completion_ids=ids)), [3 / 7, 2 / 5, 1, 0, 1])
    # n=3 equals 1 + repetition(3) where a window exists: 3/5, 2/3; too short -> 0 (not 1)
    close(Reward.from_spec("diversity", n=3).score(**batch(completion_ids=ids)), [0.6, 2 / 3, 0, 0, 0])
    assert repeated_ngram_fraction([4, 4, 4, 4], 1) == 0.75  # W=4, U=1
    assert distinct_ngram_fraction([4, 4, 4, 4], 2) == 1 / 3  # windows 44,44,44 -> 1/3
    with pytest.raises(ConfigError, match=r"n must be an integer >= 1, got 0"):
        Reward.from_spec("diversity", n=0).score(**batch(completion_ids=ids))


def _rollout(calls: list[ToolCall], results: list[ToolResult]) -> Rollout:
    steps = [Step("generate", [1, 2], [-0.1, -0.2], tool_calls=calls, finish_reason="tool_call")]
    if results:
        steps.append(Step("tool", [3, 4], tool_results=results))
    steps.append(Step("generate", [5], [-0.3], text="done", finish_reason="stop"))
    return Rollout(prompt_ids=[0], steps=steps)


def _tool_rollouts() -> list[Rollout]:
    call, bad = ToolCall("calc", {"x": "1+1"}), ToolCall("calc", {}, error="bad json")
    ok, err = ToolResult("calc", "2"), ToolResult("calc", "boom", is_error=True)
    return [
        _rollout([call], [ok]),                    # 1 call; 1/1 results ok
        _rollout([], []),                          # 0 calls; no results
        _rollout([call, call, call, bad], [ok, ok, err]),  # 4 calls (malformed counts) > budget 3; 2/3 ok
        _rollout([call, call, call], [err]),       # 3 calls == budget; 0/1 ok
    ]


def test_tool_usage_and_tool_success_on_rollouts():
    rollouts = _tool_rollouts()
    b = dict(completions=[r.text for r in rollouts], rollouts=rollouts)
    # 1 <= calls <= 3 -> 1, else penalty -0.5: calls 1, 0, 4, 3
    close(Reward.from_spec("tool_usage", budget=3, penalty=-0.5).score(**b), [1, -0.5, -0.5, 1])
    close(Reward.from_spec("tool_usage", budget=4).score(**b), [1, 0, 1, 1])  # default penalty 0
    close(Reward.from_spec("tool_success").score(**b), [1, 0, 2 / 3, 0])
    with pytest.raises(RewardError, match=r"'tool_success' .*needs rollouts.*rollouts=None"):
        Reward.from_spec("tool_success").score(**batch(["a"]))


# ----------------------------------------------------------------------------- composition


def test_weights_add_mul_sub_neg_and_components():
    a = Reward(const([1, 2], "a"), weight=2.0)
    b = Reward(const([10, 20], "b"))
    c = Reward(const([4, 8], "c"), weight=0.5)
    r = a + 3 * b - c
    assert isinstance(r, RewardSum) and [t.weight for t in r.terms] == [2.0, 3.0, -0.5]
    bt = batch(["u", "v"])
    # 2*[1,2] + 3*[10,20] - 0.5*[4,8] = [2+30-2, 4+60-4]
    close(r.score(**bt), [30, 60])
    close((-r).score(**bt), [-30, -60])
    close((r * 0.5).score(**bt), [15, 30])
    parts = anyio.run(lambda: r.acomponents(**bt))
    assert list(parts) == ["a", "b", "c"]
    close(parts["b"], [10, 20])  # unweighted
    close(parts["c"], [4, 8])
    close(sum([a, b]).score(**bt), [12, 24])  # sum() starts from 0: 2*[1,2] + [10,20]


def test_duplicate_component_names_get_suffixes():
    r = Reward.from_spec("length", target=1) + Reward.from_spec("length", target=2, weight=2) + Reward.from_spec(
        "length", target=3)
    parts = anyio.run(lambda: r.acomponents(**batch(completion_ids=[[7, 7]])))
    # len 2: target 1 -> 1-1/1 = 0; target 2 -> 1; target 3 -> 1-1/3
    assert list(parts) == ["length", "length_2", "length_3"]
    close(torch.stack(list(parts.values())).squeeze(1), [0, 1, 2 / 3])
    close(r.score(**batch(completion_ids=[[7, 7]])), [0 + 2 * 1 + 2 / 3])


async def test_async_rewards_run_concurrently():
    ready = anyio.Event()

    async def waiter(*, completions, **kwargs):
        await ready.wait()  # only finishes if `setter` runs at the same time
        return [1.0] * len(completions)

    async def setter(*, completions, **kwargs):
        ready.set()
        return [2.0] * len(completions)

    r = Reward(waiter) + Reward(setter, weight=0.5)
    with anyio.fail_after(5):
        total, parts = await r.aevaluate(**batch(["a", "b"]))
    close(total, [2, 2])  # 1 + 0.5 * 2
    assert set(parts) == {"waiter", "setter"}
    with pytest.raises(RewardError, match=r"inside a running event loop.*await reward.ascore"):
        r.score(**batch(["a", "b"]))


def test_token_level_rewards_and_mixing():
    ids = [[1, 2, 3], [4]]
    per_token = Reward(lambda **kw: [[0.1, 0.2, 0.3], [0.5]], name="tok")
    # ragged rows padded to T=3 with zeros
    close(per_token.score(**batch(completion_ids=ids)), [[0.1, 0.2, 0.3], [0.5, 0, 0]])
    # per-completion [1, 2] lands on each last token: row0 col2 0.3+1, row1 col0 0.5+2
    mixed = per_token + Reward(const([1, 2]))
    close(mixed.score(**batch(completion_ids=ids)), [[0.1, 0.2, 1.3], [2.5, 0, 0]])
    # a (B,T) tensor: entries past a completion's end are padding and set to 0
    ones = Reward(lambda **kw: torch.ones(2, 3), name="ones")
    close(ones.score(**batch(completion_ids=ids)), [[1, 1, 1], [1, 0, 0]])
    with pytest.raises(RewardError, match=r"'ones' returned token scores of shape \[2, 3\]; expected \[2, 4\]"):
        ones.score(**batch(completion_ids=[[1, 2, 3, 4], [5]]))
    with pytest.raises(RewardError, match=r"'tok' returned 1 token scores for row 0, whose completion has 2"):
        Reward(lambda **kw: [[0.1], [0.5]], name="tok").score(**batch(completion_ids=[[1, 2], [4]]))
    with pytest.raises(RewardError, match=r"'const' .*lands on each completion's last trained token; row 1 has none"):
        fitted = Reward(lambda *, completion_ids, **kw: [[0.1] * len(x) for x in completion_ids], name="fit")
        (fitted + Reward(const([1, 2]))).score(**batch(completion_ids=[[1, 2, 3], []]))


def test_a_completion_score_lands_on_the_last_trained_token_not_on_tool_output():
    """Row 0 ends on tool output (tokens 3-4, untrained): its per-completion score goes to
    token 2, the model's last token, as the advantages and the learner place it."""
    from materl.rollout.types import Rollout, Step

    rollouts = [Rollout([0], [Step("generate", [1, 2, 3], [0.0] * 3), Step("tool", [4, 5])]),
                Rollout([0], [Step("generate", [6], [0.0])])]
    ids = [r.completion_ids for r in rollouts]
    zeros = Reward(lambda *, completion_ids, **kw: [[0.0] * len(x) for x in completion_ids], name="zeros")
    total = (zeros + Reward(const([1, 2]))).score(completions=["a", "b"], completion_ids=ids, rollouts=rollouts)
    close(total, [[0, 0, 1, 0, 0], [2, 0, 0, 0, 0]])


def test_accepts_tensors_arrays_bools_and_ints():
    bt = batch(["a", "b"])
    out = Reward(lambda **kw: torch.tensor([0.5, 1.5], dtype=torch.float64)).score(**bt)
    assert out.dtype == torch.float32
    close(out, [0.5, 1.5])
    close(Reward(lambda **kw: np.array([1, 2])).score(**bt), [1, 2])
    close(Reward(lambda **kw: [True, False]).score(**bt), [1, 0])
    close(Reward(lambda **kw: [np.float32(0.25), 3]).score(**bt), [0.25, 3])


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("out", "pattern"),
    [
        ([1.0, 0.0, 1.0], r"reward 'bad' returned 3 values for a batch of 4: \[1.0, 0.0, 1.0\]"),
        (torch.zeros(5), r"reward 'bad' returned 5 values for a batch of 4"),
        ([1.0, math.nan, 0.0, 0.0], r"reward 'bad' returned non-finite value nan at row 1"),
        (torch.tensor([0.0, 0.0, 0.0, math.inf]), r"non-finite value inf at row 3"),
        ([1.0, None, 0.0, 0.0], r"returned None at row 1: \[1.0, None, 0.0, 0.0\].*return 0.0"),
        (None, r"reward 'bad' returned None; expected 4 numbers"),
        ([1.0, "yes", 0.0, 0.0], r"returned a non-number at row 1: 'yes' \(str\)"),
        ("1111", r"returned str '1111'; expected 4 numbers"),
        (torch.zeros(4, 2, 2), r"returned a tensor of shape \[4, 2, 2\]"),
        (torch.tensor([1 + 1j] * 4), r"dtype torch.complex64"),
    ],
)
def test_bad_outputs_raise_reward_error_naming_the_reward(out, pattern):
    with pytest.raises(RewardError, match=pattern):
        Reward(lambda **kw: out, name="bad").score(**batch(["a", "b", "c", "d"]))


def test_unknown_names_and_params_suggest():
    with pytest.raises(UnknownNameError, match=r"unknown reward 'lenght'.*Did you mean 'length'"):
        Reward.from_spec("lenght")
    with pytest.raises(ConfigError, match=r"'length' has no parameter 'targt' \(valid: target, range, scale\)"
                                          r"\. Did you mean 'target'"):
        Reward.from_spec("length", targt=5)
    with pytest.raises(ConfigError, match=r"come from the batch"):
        Reward.from_spec("length", completion_ids=[[1]])
    with pytest.raises(ConfigError, match=r"registered name or a callable, got 3 \(int\)"):
        Reward.from_spec(3)
    with pytest.raises(ConfigError, match=r"weight must be a finite number, got nan"):
        Reward.from_spec("length", weight=math.nan)
    with pytest.raises(UnknownNameError, match=r"unknown reward_aggregator 'paretto'.*Did you mean 'pareto'"):
        VectorReward(["length"], aggregate="paretto")


def test_batch_and_call_errors():
    with pytest.raises(RewardError, match=r"'exact_match' cannot take this batch.*'answer'"):
        Reward.from_spec("exact_match").score(**batch(["a"]))

    def strict(*, completions):  # no **kwargs: cannot take prompts etc.
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match=r"'strict' cannot take this batch.*\*\*kwargs"):
        Reward(strict).score(**batch(["a"]))

    def broken(**kwargs):
        raise KeyError("missing thing")

    with pytest.raises(RewardError, match=r"reward 'broken' raised KeyError: 'missing thing'") as info:
        Reward(broken).score(**batch(["a"]))
    assert isinstance(info.value.__cause__, KeyError)

    def with_answer(*, answer="x", **kwargs):
        return [0.0]

    with pytest.raises(RewardError, match=r"\['answer'\] also arrive as batch columns"):
        Reward(with_answer, params={"answer": "y"}).score(**batch(["a"], answer=["z"]))
    with pytest.raises(ShapeError, match=r"disagree on the batch size: completions=2, prompts=3"):
        Reward(const([0, 0])).score(completions=["a", "b"], prompts=["p"] * 3)
    with pytest.raises(ShapeError, match=r"needs column 'answer' with 2 entries .* got 1 entries"):
        Reward.from_spec("exact_match").score(**batch(["a", "b"], answer=["a"]))


# ----------------------------------------------------------------------------- vector rewards


def test_vector_reward_aggregates():
    a = Reward(const([1, 4], "a"))
    b = Reward(const([3, 2], "b"), weight=2.0)  # weighted: [6, 4]
    bt = batch(["u", "v"])
    # a = [1, 4], weighted b = [6, 4]: sum [7, 8], mean [3.5, 4], min [1, 4], max [6, 4]
    expected = {"weighted_sum": [7, 8], "mean": [3.5, 4], "min": [1, 4], "max": [6, 4]}
    for aggregate, values in expected.items():
        close(VectorReward([a, b], aggregate=aggregate).score(**bt), values)
    v = 0.5 * VectorReward([a, b], aggregate="min")
    close(v.score(**bt), [0.5, 2])  # 0.5 * min
    parts = anyio.run(lambda: v.acomponents(**bt))
    close(parts["b"], [3, 2])  # members' unweighted scores
    assert v.name == "min(a, b)" and set(REWARD_AGGREGATORS.names()) >= {"pareto", "weighted_sum"}
    close((v + a).score(**bt), [1.5, 6])  # [0.5, 2] + [1, 4]


def test_pareto_rank_hand_example():
    # rows: p0 (1,0) p1 (0,1) p2 (.5,.5) p3 (.4,.4) p4 (0,0) in group a; q0, q1 (0,0) in group b
    obj1 = [1.0, 0.0, 0.0, 0.5, 0.0, 0.4, 0.0]
    obj2 = [0.0, 0.0, 1.0, 0.5, 0.0, 0.4, 0.0]
    gids = ["a", "b", "a", "a", "b", "a", "a"]  # order: p0 q0 p1 p2 q1 p3 p4
    # group a: p0, p1, p2 dominated by none -> 0; p3 dominated by p2 -> 1; p4 dominated by p3 -> 2
    # group b: equal vectors do not dominate each other -> both 0
    ranks = pareto_rank(torch.tensor([obj1, obj2]), group_ids=gids)
    assert ranks.tolist() == [0, 0, 0, 0, 0, 1, 2]

    def column(key):
        def fn(**kwargs):
            return kwargs[key]
        fn.__name__ = key
        return fn

    v = VectorReward([column("obj1"), column("obj2")], aggregate="pareto")
    b = batch(["t"] * 7, obj1=obj1, obj2=obj2, group_ids=gids)
    close(v.score(**b), [0, 0, 0, 0, 0, -1, -2])
    # minimising obj2 instead (negative weight): group a on (obj1, -obj2):
    # p0 (1,0) dominates all of p1 (0,-1), p2 (.5,-.5), p3 (.4,-.4), p4 (0,0);
    # after p0: p4 (0,0), p2 (.5,-.5), p3 (.4,-.4) are mutually non-dominated -> 1; p1 dominated by p4 -> 2
    v = VectorReward([Reward(column("obj1")), -Reward(column("obj2"))], aggregate="pareto")
    close(v.score(**b), [0, 0, -2, -1, 0, -1, -1])
    with pytest.raises(RewardError, match=r"needs group_ids .*got None.*column 'group_ids'"):
        v.score(**batch(["t"] * 7, obj1=obj1, obj2=obj2))


def test_vector_reward_rejects_token_level_members():
    tok = Reward(lambda **kw: [[1.0], [2.0]], name="tok")
    with pytest.raises(RewardError, match=r"member 'tok' returned token-level scores of shape \[2, 1\]"):
        VectorReward([tok, "diversity"]).score(**batch(completion_ids=[[1], [2]]))


def test_registry_holds_the_builtins():
    assert set(REWARDS.names()) >= {"length", "format", "exact_match", "math_answer", "repetition", "diversity",
                                    "tool_usage", "tool_success"}
    r = Reward.from_spec("diversity", weight=0.9)
    assert r.name == "diversity" and r.weight == 0.9 and r == Reward.from_spec("diversity", weight=0.9)
