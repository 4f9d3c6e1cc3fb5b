"""The built-in rewards, registered in ``REWARDS`` by name, and the vector-reward aggregators,
registered in ``REWARD_AGGREGATORS``. Each reward is a plain reward function (keywords from the
batch, hyperparameters as keywords) returning one float per completion.

``repetition`` and ``diversity`` are defined exactly (which n-grams, which denominator, what an
empty completion gets) so that a Mojo kernel reproduces them bit for bit: both are a ratio of two
integer counts, and float32 division of the counts gives the same float32 as rounding the
float64 ratio (no double-rounding error for counts below 2**24).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from materl.errors import ConfigError, RewardError, ShapeError
from materl.ops._masked import group_index
from materl.ops.rewards import REWARD_AGGREGATORS, REWARDS

if TYPE_CHECKING:
    from materl.rollout.types import Rollout

#: ``length`` without ``target`` or ``range`` aims at this many completion tokens.
DEFAULT_LENGTH_TARGET = 128


def _column(reward: str, key: str, values: Sequence[Any], size: int) -> Sequence[Any]:
    if values is None or len(values) != size:
        got = "None" if values is None else f"{len(values)} entries"
        raise ShapeError(f"reward {reward!r} needs column {key!r} with {size} entries (one per completion), got {got}")
    return values


def _need_rollouts(reward: str, rollouts: Sequence[Rollout] | None) -> Sequence[Rollout]:
    if rollouts is None:
        raise RewardError(
            f"reward {reward!r} scores multi-turn episodes and needs rollouts in the batch, got rollouts=None"
        )
    return rollouts


def length_interval(*, target: int | None = None, range: tuple[int, int] | None = None,  # noqa: A002
                    scale: float | None = None) -> tuple[int, int, float]:
    """``(lo, hi, scale)`` of the ``length`` reward, resolved and checked (shared with the kernel)."""
    if target is not None and range is not None:
        raise ConfigError(f"length: give target=N or range=(lo, hi), not both; got target={target}, range={range}")
    lo, hi = (target, target) if target is not None else range or (DEFAULT_LENGTH_TARGET, DEFAULT_LENGTH_TARGET)
    if not 0 <= lo <= hi:
        raise ConfigError(f"length: need 0 <= lo <= hi tokens, got target={target}, range={range}")
    scale = float(max(hi, 1) if scale is None else scale)
    if not scale > 0:
        raise ConfigError(f"length: scale must be > 0 tokens, got {scale}")
    return int(lo), int(hi), scale


@REWARDS.register("length")
def length(*, completion_ids: Sequence[Sequence[int]], target: int | None = None,  # noqa: A002 (range=)
           range: tuple[int, int] | None = None, scale: float | None = None, **kwargs: Any) -> list[float]:
    """1 inside the target length, decreasing linearly to 0 with the distance from it.

    With L_i = len(completion_ids[i]) tokens and the interval [lo, hi] (``range=(lo, hi)``, or
    lo = hi = ``target``; neither given: target = ``DEFAULT_LENGTH_TARGET`` = 128)::

        d_i = max(lo - L_i, 0, L_i - hi)            # tokens outside the interval
        r_i = max(0, 1 - d_i / scale)               # scale defaults to max(hi, 1)

    e.g. target=100: L=100 -> 1, L=75 or 125 -> 0.75, L=0 or >=200 -> 0.
    (B lists) -> B floats. No TRL/verl built-in of this shape; DAPO's soft overlong punishment
    (TRL ``get_soft_overlong_punishment``, Yu et al. 2025 §3.4) is exactly
    ``length(range=(0, L_max - L_cache), scale=L_cache) - 1``.
    """
    lo, hi, scale = length_interval(target=target, range=range, scale=scale)
    out = []
    for ids in completion_ids:
        d = max(lo - len(ids), 0, len(ids) - hi)
        out.append(max(0.0, 1.0 - d / scale))
    return out


@REWARDS.register("format")
def format_reward(*, completions: Sequence[str], regex: str, full_match: bool = False, flags: int = re.DOTALL,
                  **kwargs: Any) -> list[float]:
    """1.0 where the completion matches ``regex``, else 0.0.

    ``full_match=True`` uses ``re.fullmatch`` (the whole text), otherwise ``re.search`` (anywhere;
    anchor with ``^``/``$`` as needed). ``flags`` default ``re.DOTALL`` (``.`` crosses newlines).
    (B strings) -> B floats. TRL counterpart: ``think_format_reward`` (``re.match`` of a fixed
    ``<think>`` pattern with DOTALL|MULTILINE); open-r1 ``format_reward``.
    """
    try:
        pattern = re.compile(regex, flags)
    except (re.error, TypeError) as e:
        raise ConfigError(f"format: regex {regex!r} does not compile: {e}") from None
    match = pattern.fullmatch if full_match else pattern.search
    return [1.0 if match(c) else 0.0 for c in completions]


def _normalize(text: str) -> str:
    return " ".join(text.split()).casefold()


@REWARDS.register("exact_match")
def exact_match(*, completions: Sequence[str], answer: Sequence[Any], normalize: bool = True,
                extract: str | None = None, **kwargs: Any) -> list[float]:
    """1.0 where the completion (or the part ``extract`` captures) equals ``str(answer[i])``.

    ``normalize=True`` compares ``" ".join(s.split()).casefold()`` of both (surrounding and
    repeated whitespace and case ignored). ``extract`` is a regex searched in the completion (its
    first group if it has one, else the whole match); no match scores 0. Reads column ``answer``.
    (B strings) -> B floats. Counterpart: verl ``reward_score/gsm8k`` (strict string match of the
    extracted answer).
    """
    answer = _column("exact_match", "answer", answer, len(completions))
    pattern = re.compile(extract, re.DOTALL) if extract is not None else None
    out = []
    for text, gold in zip(completions, answer):
        if pattern is not None:
            m = pattern.search(text)
            if m is None:
                out.append(0.0)
                continue
            text = m.group(1) if pattern.groups else m.group(0)
        gold = str(gold)
        out.append(float(_normalize(text) == _normalize(gold) if normalize else text == gold))
    return out


@REWARDS.register("math_answer")
def math_answer(*, completions: Sequence[str], answer: Sequence[Any], timeout_s: int | None = 5,
                **kwargs: Any) -> list[float]:
    """1.0 where math-verify judges the completion's answer equal to the gold ``answer``, else 0.0.

    ``gold = parse(answer[i])`` (retried as ``$answer$`` when bare LaTeX such as ``\\sqrt{2}``
    does not parse), ``pred = parse(completion)`` (math-verify's default LaTeX + expression
    extraction, ``\\boxed{}`` first), reward ``verify(gold, pred)``. An unparseable gold or
    completion scores 0 (TRL's ``accuracy_reward`` returns None for an unparseable gold and skips
    the row; materl needs a number). ``timeout_s`` bounds each parse/verify via SIGALRM, which
    only works on the main thread; elsewhere it runs without a timeout.
    (B strings) -> B floats. Counterparts: TRL ``accuracy_reward``, verl ``reward_score/math_verify``.
    """
    from math_verify import parse, verify  # imports sympy: ~1 s, paid on first use only

    answer = _column("math_answer", "answer", answer, len(completions))
    t = timeout_s if threading.current_thread() is threading.main_thread() else None
    out = []
    for text, gold_text in zip(completions, answer):
        gold = parse(str(gold_text), parsing_timeout=t) or parse(f"${gold_text}$", parsing_timeout=t)
        pred = parse(text, parsing_timeout=t) if gold else []
        out.append(float(bool(pred) and verify(gold, pred, timeout_seconds=t)))
    return out


def repeated_ngram_fraction(ids: Sequence[int], n: int) -> float:
    """(occurrences - distinct) / occurrences of the n-grams of ``ids``; 0.0 when len(ids) < n.

    The n-grams are the ``len(ids) - n + 1`` contiguous windows ``ids[j:j+n]``; an occurrence is a
    repeat when the same window appeared at an earlier j.
    """
    total = len(ids) - n + 1
    if total <= 0:
        return 0.0
    distinct = len({tuple(ids[j:j + n]) for j in range(total)})
    return (total - distinct) / total


def distinct_ngram_fraction(ids: Sequence[int], n: int) -> float:
    """distinct / occurrences of the n-grams of ``ids`` (windows as above); 0.0 when len(ids) < n."""
    total = len(ids) - n + 1
    if total <= 0:
        return 0.0
    return len({tuple(ids[j:j + n]) for j in range(total)}) / total


def _check_n(reward: str, n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"{reward}: n must be an integer >= 1, got {n!r}")
    return n


@REWARDS.register("repetition")
def repetition(*, completion_ids: Sequence[Sequence[int]], n: int = 3, **kwargs: Any) -> list[float]:
    """Minus the fraction of repeated token n-grams in each completion.

    With W_i = L_i - n + 1 windows ``ids[j:j+n]`` (j = 0..W_i-1) and U_i distinct ones::

        r_i = -(W_i - U_i) / W_i        if W_i >= 1
        r_i = 0                         if L_i < n   (too short to repeat; empty included)

    Every id counts (EOS too if the engine returned it). e.g. n=2, ids [1,2,1,2,1]: windows
    (1,2),(2,1),(1,2),(2,1) -> W=4, U=2 -> -0.5. Range [-(W-1)/W, 0]. (B lists) -> B floats.
    Counterpart: open-r1 ``repetition_penalty_reward`` (same ratio, over words instead of token
    ids, times ``max_penalty``); no TRL/verl built-in.
    """
    n = _check_n("repetition", n)
    return [0.0 - repeated_ngram_fraction(ids, n) for ids in completion_ids]


@REWARDS.register("diversity")
def diversity(*, completion_ids: Sequence[Sequence[int]], n: int = 1, **kwargs: Any) -> list[float]:
    """Fraction of distinct token n-grams in each completion (n=1: distinct tokens / tokens).

    With W_i = L_i - n + 1 windows and U_i distinct ones: ``r_i = U_i / W_i`` if W_i >= 1, else 0
    (an empty or too-short completion is not diverse). For W_i >= 1 this is
    ``1 + repetition(n)``. Range (0, 1]. (B lists) -> B floats. Counterpart: the distinct-n metric
    (Li et al. 2016), computed per completion; no TRL/verl built-in.
    """
    n = _check_n("diversity", n)
    return [distinct_ngram_fraction(ids, n) for ids in completion_ids]


@REWARDS.register("tool_usage")
def tool_usage(*, rollouts: Sequence[Rollout] | None, budget: int = 3, penalty: float = 0.0,
               **kwargs: Any) -> list[float]:
    """1.0 when an episode made between 1 and ``budget`` tool calls, else ``penalty``.

    calls_i = ``len(rollouts[i].tool_calls)``: every call parsed from the episode's generate steps,
    malformed ones (``ToolCall.error`` set) included, since they were attempts. 0 calls (never used
    a tool) and more than ``budget`` (looping) both score ``penalty`` (default 0.0).
    (B rollouts) -> B floats. No TRL/verl built-in.
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ConfigError(f"tool_usage: budget must be an integer >= 1, got {budget!r}")
    rollouts = _need_rollouts("tool_usage", rollouts)
    return [1.0 if 1 <= len(r.tool_calls) <= budget else float(penalty) for r in rollouts]


@REWARDS.register("tool_success")
def tool_success(*, rollouts: Sequence[Rollout] | None, **kwargs: Any) -> list[float]:
    """Fraction of an episode's tool results that are not errors; 0.0 when it has none.

    ``results = rollouts[i].tool_results``; ``r_i = #{res : not res.is_error} / len(results)``.
    A malformed call counts only if the runtime answered it with an error result.
    (B rollouts) -> B floats. No TRL/verl built-in.
    """
    out = []
    for r in _need_rollouts("tool_success", rollouts):
        results = r.tool_results
        out.append(sum(not res.is_error for res in results) / len(results) if results else 0.0)
    return out


# ----------------------------------------------------------------------------- aggregators


@REWARDS.register("step_rewards")
def step_rewards(*, rollouts: Sequence[Rollout], **_: Any) -> list[list[float]]:
    """Token-level: each step's own reward (``Step.reward``, e.g. set by an environment) on the
    last token of that step, 0 elsewhere; aligned with ``rollout.completion_ids``."""
    return [r.step_rewards() for r in rollouts]


@REWARD_AGGREGATORS.register("weighted_sum")
def weighted_sum(scores_K_B: Tensor, *, group_ids: Any = None) -> Tensor:
    """``sum_k scores_K_B[k]`` (members carry their weights). (K, B) -> (B,)."""
    return scores_K_B.sum(0)


@REWARD_AGGREGATORS.register("mean")
def mean(scores_K_B: Tensor, *, group_ids: Any = None) -> Tensor:
    """``mean_k scores_K_B[k]``. (K, B) -> (B,)."""
    return scores_K_B.mean(0)


@REWARD_AGGREGATORS.register("min")
def minimum(scores_K_B: Tensor, *, group_ids: Any = None) -> Tensor:
    """``min_k scores_K_B[k]``: a completion is as good as its worst objective. (K, B) -> (B,)."""
    return scores_K_B.amin(0)


@REWARD_AGGREGATORS.register("max")
def maximum(scores_K_B: Tensor, *, group_ids: Any = None) -> Tensor:
    """``max_k scores_K_B[k]``. (K, B) -> (B,)."""
    return scores_K_B.amax(0)


def pareto_rank(scores_K_B: Tensor, *, group_ids: Sequence[Any] | Tensor) -> Tensor:
    """Non-dominated sorting rank of every completion within its group (all objectives maximised).

    i dominates j when ``s[:, i] >= s[:, j]`` everywhere and ``>`` somewhere. Rank 0 is the set of
    rows no other row of the group dominates; rank r is the non-dominated set once ranks < r are
    removed (NSGA-II, Deb et al. 2002). Equal vectors share a rank. (K, B) -> long (B,).
    No verl/TRL counterpart.
    """
    if group_ids is None:
        raise ShapeError("pareto ranking is done within groups and needs group_ids (one per completion), got None")
    index_B, num_groups = group_index(scores_K_B.shape[1], group_ids=group_ids)
    rank_B = torch.zeros(scores_K_B.shape[1], dtype=torch.long)
    for g in range(num_groups):
        rows = (index_B == g).nonzero().squeeze(1)
        s = scores_K_B[:, rows]
        dominates = (s[:, :, None] >= s[:, None, :]).all(0) & (s[:, :, None] > s[:, None, :]).any(0)
        remaining = torch.ones(len(rows), dtype=torch.bool)
        level = 0
        while remaining.any():
            dominated = (dominates & remaining[:, None]).any(0)
            front = remaining & ~dominated
            rank_B[rows[front]] = level
            remaining &= ~front
            level += 1
    return rank_B


@REWARD_AGGREGATORS.register("pareto")
def pareto(scores_K_B: Tensor, *, group_ids: Sequence[Any] | Tensor | None = None) -> Tensor:
    """``-pareto_rank``: 0 for a group's non-dominated completions, -1 for the next front, ...
    Unnormalised so a rank costs the same in every group; group-normalised advantages (GRPO)
    rescale it anyway. (K, B) -> float32 (B,)."""
    return (-pareto_rank(scores_K_B, group_ids=group_ids)).to(torch.float32)  # long negation: no -0.0
