"""grpo_tools with a step reward on identical episodes (issue 27's table): the tiny model decodes
greedily, so every episode of a group is the same; an async op gives turn 1 a calculator call
(the tiny random model never writes one). No signal, so loss 0 and grad norm 0 under each way of
crediting the step reward; before, GRPO's return-to-go against the summed baseline gave turn 2
about -r / 1e-6 and a loss of ~1e4."""

import dataclasses

import pytest

import materl as ml
from materl.recipes.grpo_tools import grpo_tools_recipe
from materl.rollout.multiturn import TurnResult
from materl.rollout.types import ToolCall


@ml.op
async def force_call(step):
    state = step.history
    last = dataclasses.replace(state.steps[-1], tool_calls=[ToolCall("calculate", {"expression": "2 + 3"},
                                                                     id="call_0")], finish_reason="tool_call")
    return TurnResult(dataclasses.replace(state, steps=state.steps[:-1] + [last], done=False), last)


@pytest.mark.parametrize("step_credit", ["process", "turn", "gigpo"])
def test_identical_episodes_with_a_step_reward_make_no_update(step_credit):
    toolbox = ml.mcp_tools("python -m materl.tools.calculator")
    recipe = ml.replace(grpo_tools_recipe(toolbox, step_credit=step_credit), "turn_1",
                        lambda g: force_call(g.turn_1))
    step = ml.compile(recipe, policy=ml.Agent("tiny-random", trainable=True), ref_policy=ml.Agent("tiny-random"),
                      group_size=4, max_new_tokens=4, temperature=0.0)
    try:
        metrics = step.run(prompts=["What is 2 + 3?"], answer=["5"])
    finally:
        step.close()
    assert metrics["tool_calls"] == 1.0 and metrics["reward/tool_format/mean"] == 1.0  # the step reward is there
    assert metrics["reward/std"] == 0.0
    # turn 1: the well-formed call earns the format reward, 0.2 x 1, as a step reward; turn 2:
    # the answer is wrong (0) and the call succeeded, 0.2 x 1. Every episode is the same, so each
    # method's statistics have std 0: process's R = {0.2, 0.2, ...}, turn's turn-j returns and
    # GiGPO's episode totals and same-state returns are all equal. A = 0 exactly.
    assert metrics["loss"] == 0.0 and metrics["grad_norm"] == 0.0
