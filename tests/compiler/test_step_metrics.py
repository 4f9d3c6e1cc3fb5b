"""A step's metrics read as the recipe was written: each reward term under its own name
(``reward/<term>/mean``), ``groups/zero_std``, and ``tool_calls``/``tool_success`` in every step
of a tool recipe."""

import dataclasses

import torch

import materl as ml
from materl.compiler.compiled import Compiled
from materl.compiler.options import CompileOptions
from materl.rollout.multiturn import TurnResult
from materl.rollout.mcp import PythonTools, mcp_tools
from materl.rollout.types import ToolCall


@ml.op
def faithful(completions: torch.Tensor) -> {"faithful": torch.Tensor}:
    return {"faithful": torch.full((len(completions),), 0.25)}


@ml.op
def pair(completions: torch.Tensor) -> {"low": torch.Tensor, "high": torch.Tensor}:
    n = len(completions)
    return {"low": torch.full((n,), 1.0), "high": torch.full((n,), 3.0)}


def one(*, completions, **_):
    return [1.0] * len(completions)


def two(*, completions, **_):
    return [2.0] * len(completions)


@ml.recipe
def shaped(policy, prompts):
    completions = ml.generate(policy, prompts, name="completions")
    p = pair(completions)
    rewards = (faithful(completions) + p.low + 0.5 * p.high
               + ml.reward(one, name="bonus") + ml.reward(two, name="bonus"))
    ml.advantages(rewards, name="advantages")


def test_terms_are_named_after_the_op_or_name_and_kept_apart():
    # an op with one output: its name; with several: name.field; a name taken: _2
    assert "{terms=1*faithful + 1*pair.low + 0.5*pair.high + 1*bonus + 1*bonus_2}" in str(shaped.node("rewards"))


def test_each_term_has_its_own_mean_under_its_name():
    compiled = Compiled(shaped, {"policy": ml.Agent("tiny-random")}, CompileOptions(max_new_tokens=3, group_size=2),
                        rollout_only=True)
    try:
        m = compiled.rollout_metrics(compiled.call_blocking(compiled.rollout, ["a", "b"]))
    finally:
        compiled.close()
    terms = {k: v for k, v in m.items() if k.startswith("reward/") and k.endswith("/mean")}
    # unweighted scores: faithful 0.25, pair.low 1, pair.high 3 (its weight 0.5 is not applied), bonus 1, bonus_2 2
    assert terms == {"reward/faithful/mean": 0.25, "reward/pair.low/mean": 1.0, "reward/pair.high/mean": 3.0,
                     "reward/bonus/mean": 1.0, "reward/bonus_2/mean": 2.0}
    # the weighted total: 0.25 + 1 + 0.5 * 3 + 1 + 2 = 5.75 for every episode, so std 0
    assert m["reward"] == 5.75 and m["reward/std"] == 0.0
    assert "tool_calls" not in m and "tool_success" not in m  # no tools in this recipe


def by_prompt(*, prompts, completions, **_):
    """Prompt "b": a different reward for every episode; any other prompt: the same one."""
    return [float(next(_counter)) if p == "b" else 1.0 for p, _c in zip(prompts, completions)]


_counter = iter(range(10**6))


@ml.recipe
def per_prompt(policy, prompts):
    completions = ml.generate(policy, prompts, name="completions")
    ml.advantages(ml.reward(by_prompt), name="advantages")


def test_zero_std_groups_is_the_share_of_groups_whose_rewards_are_all_equal():
    def metrics(group_size: int, prompts: list[str]) -> dict:
        compiled = Compiled(per_prompt, {"policy": ml.Agent("tiny-random")},
                            CompileOptions(max_new_tokens=2, group_size=group_size), rollout_only=True)
        try:
            return compiled.rollout_metrics(compiled.call_blocking(compiled.rollout, prompts))
        finally:
            compiled.close()

    # groups "a" and "c": every episode 1.0 (zero std); "b": all different -> 2 of 3 groups
    assert metrics(3, ["a", "b", "c"])["groups/zero_std"] == 2 / 3
    assert metrics(2, ["b"])["groups/zero_std"] == 0.0
    assert metrics(2, ["a"])["groups/zero_std"] == 1.0
    assert "groups/zero_std" not in metrics(1, ["a", "b"])  # one episode a prompt: no group to judge


class Clock:
    def now(self) -> str:
        """The time."""
        return "noon"


def tool_recipe(toolbox, *, force: bool):
    @ml.op
    async def force_call(step) -> {"step": TurnResult}:
        state = step.history
        last = dataclasses.replace(state.steps[-1], tool_calls=[ToolCall("now", {}, id="call_0")],
                                   finish_reason="tool_call")
        return {"step": TurnResult(dataclasses.replace(state, steps=state.steps[:-1] + [last], done=False), last)}

    @ml.recipe
    def with_tools(policy, prompts):
        step = ml.generate_step(policy, prompts, name="turn_1")
        if force:
            step = force_call(step)
        results = ml.call_tools(step, tools=toolbox, name="tools_1")
        ml.structure_rollout(ml.generate_step(policy, step.history, results, name="turn_2"), name="rollout")

    return with_tools


def tool_metrics(*, force: bool) -> dict:
    compiled = Compiled(tool_recipe(mcp_tools(PythonTools(Clock)), force=force), {"policy": ml.Agent("tiny-random")},
                        CompileOptions(max_new_tokens=3, group_size=2), rollout_only=True)
    try:
        return compiled.rollout_metrics(compiled.call_blocking(compiled.rollout, ["a"]))
    finally:
        compiled.close()


def test_tool_metrics_are_zero_on_a_step_without_calls():
    # the tiny random model never writes a tool call: 0 calls per episode, and 0 success (no signal)
    m = tool_metrics(force=False)
    assert m["episodes"] == 2 and (m["tool_calls"], m["tool_success"]) == (0.0, 0.0)
    # one forced call per episode, answered without an error: 1 call per episode, all succeeded
    m = tool_metrics(force=True)
    assert (m["tool_calls"], m["tool_success"]) == (1.0, 1.0)


def test_the_turn_statistics_are_a_float64_mean_and_population_std():
    from math import isnan, sqrt

    from materl.compiler.metrics import mean_std

    mean, std = mean_std([1.0, 2.0, 4.0])
    assert mean == 7 / 3 and abs(std - sqrt(14 / 9)) <= 1e-15  # ((1-7/3)^2 + (2-7/3)^2 + (4-7/3)^2) / 3
    assert mean_std([0.1] * 10) == (0.1, 0.0)  # equal values: no spread
    assert mean_std([5.0]) == (5.0, 0.0)
    assert all(isnan(v) for v in mean_std([float("inf"), float("-inf")]))  # not fsum's ValueError


def test_reward_statistics_batched_by_count_equal_one_tensor_per_key():
    from materl.compiler.metrics import _column_stats

    columns = {"reward": [0.9062, 0.9062, 0.6812, 0.25], "reward/a": [1, 2, 4, 8], "judge/b": [0.1, 0.7, 0.2],
               "agent/c": [3.5]}
    stats = _column_stats(columns)
    for key, values in columns.items():
        alone = torch.tensor(values, dtype=torch.float32)
        assert stats[key] == (float(alone.mean()), float(alone.std(unbiased=False)))  # bitwise, in float32
