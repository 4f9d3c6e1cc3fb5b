"""grpo_tools' format reward: by default a well-formed call earns it even when the tool answers
with an error; with ``format_needs_success`` only a call whose results are all successes does."""

import materl as ml
from materl.recipes.grpo_tools import grpo_tools_recipe, tool_call_format, tool_call_format_succeeded
from materl.rollout.types import Rollout, Step, ToolCall, ToolResult


def episode(call_error: str | None = None, result_error: bool | None = None) -> Rollout:
    """One first turn: no call (``result_error`` None), or a call (malformed when ``call_error``)
    answered by the tool with an error result or a number."""
    if result_error is None:
        return Rollout([1], [Step("generate", [2], text="The answer is 5.")])
    call = ToolCall("calculate", {"expression": "2 + 3"}, error=call_error)
    result = ToolResult("calculate", "bad expression" if result_error else "5", is_error=result_error)
    return Rollout([1], [Step("generate", [2], tool_calls=[call]), Step("tool", [3], tool_results=[result]),
                         Step("generate", [4], text="The answer is 5.")])


ROLLOUTS = [episode(), episode(result_error=False), episode(result_error=True),
            episode(call_error="no JSON object", result_error=True)]


def test_default_format_reward_pays_a_wellformed_call_that_failed():
    assert tool_call_format(rollouts=ROLLOUTS) == [0.0, 1.0, 1.0, -0.5]


def test_format_reward_that_needs_success_pays_only_working_calls():
    assert tool_call_format_succeeded(rollouts=ROLLOUTS) == [0.0, 1.0, 0.0, -0.5]


def test_the_recipe_option_picks_the_format_reward():
    toolbox = ml.mcp_tools("python -m materl.tools.calculator")
    for needs_success, fn in [(False, tool_call_format), (True, tool_call_format_succeeded)]:
        recipe = grpo_tools_recipe(toolbox, format_needs_success=needs_success)
        terms = next(n for n in recipe.nodes if n.op == "rewards").params["terms"]
        assert {t["label"]: t["fn"] for t in terms}["tool_format"] is fn
