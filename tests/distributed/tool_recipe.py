"""A multi-turn tool-use recipe the tiny random model can run: turn 1's sampled ids are kept
but given a real calculator call (the model never writes one), the calculator MCP server answers
it, turn 2 reads the answer. ``delay_s`` stands for a slow tool: the episode waits that long
before its call. Module-level, so Ray actors unpickle it."""

import dataclasses

import anyio

import materl as ml
from materl.rollout.multiturn import TurnResult
from materl.rollout.types import ToolCall


def calculator_recipe(toolbox, *, delay_s: float = 0.0, expression: str = "6 * 7", diversity: float = 0.0):
    """``diversity``: the weight of a diversity reward term (episodes of a group then differ in
    reward, so advantages and gradients are not zero)."""

    @ml.op
    async def call_calculator(step) -> {"step": TurnResult}:
        await anyio.sleep(delay_s)
        state = step.history
        call = ToolCall("calculate", {"expression": expression}, id="call_0")
        last = dataclasses.replace(state.steps[-1], tool_calls=[call], finish_reason="tool_call")
        return {"step": TurnResult(dataclasses.replace(state, steps=state.steps[:-1] + [last], done=False), last)}

    @ml.recipe
    def calculator_grpo(policy, prompts):
        turn_1 = call_calculator(ml.generate_step(policy, prompts, name="turn_1"))
        results = ml.call_tools(turn_1, tools=toolbox, name="tool_results")
        turn_2 = ml.generate_step(policy, turn_1.history, results, tools=toolbox, name="turn_2")
        rollout = ml.structure_rollout(turn_2, name="rollout")
        rewards = ml.reward("tool_usage", rollout=rollout) + ml.reward("length", rollout=rollout, target=4)
        if diversity:
            rewards = rewards + ml.reward("diversity", rollout=rollout, weight=diversity)
        ml.set_loss(ml.policy_loss(ml.advantages(rewards, completions=rollout), ml.logprobs(policy, prompts, rollout)))

    return calculator_grpo
