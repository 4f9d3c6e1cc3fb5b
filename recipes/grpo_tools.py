"""GRPO over multi-turn tool episodes (calculator by default).

Each episode alternates ``generate_step`` and tool calls for up to ``turns`` model turns: the
model may emit ``<tool_call>{"name": "calculate", "arguments": {...}}</tool_call>``, the tool
runs on an MCP server, its result is appended as exact tokens, and the model continues. Tool
output and prompts are never trained on (loss mask 0).

Rewards: a step-level reward on the first turn for a well-formed tool call (it lands on that
step's last token, so it credits the tokens that produced the call), an outcome reward for the
final answer (exact match against the ``answer`` column, on the last token), and a small
tool-success term. Advantages are GRPO's over the token-level returns (see ops.advantages).

Build it with a toolbox: ``grpo_tools_recipe(ml.mcp_tools("python -m materl.tools.calculator"))``.
"""

import materl as ml
from materl.ops.rewards import REWARDS


def tool_call_format(*, rollouts, **_):
    """1 if the scored step made at least one well-formed tool call, -0.5 for malformed ones, else 0."""
    out = []
    for r in rollouts:
        calls = r.steps[0].tool_calls if r.steps and r.steps[0].kind == "generate" else []
        if any(c.error for c in calls):
            out.append(-0.5)
        else:
            out.append(1.0 if calls else 0.0)
    return out


def final_answer(*, completions, answer, **_):
    """1 if the final answer's last number equals the gold answer."""
    import re

    out = []
    for text, gold in zip(completions, answer):
        nums = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text or "")
        got = nums[-1].replace(",", "") if nums else None
        out.append(1.0 if got is not None and got == str(gold).replace(",", "") else 0.0)
    return out


def grpo_tools_recipe(toolbox, *, turns: int = 3, format_weight: float = 0.2, answer_weight: float = 1.0,
                      success_weight: float = 0.1, kl_coef: float = 0.0):
    """The recipe for a given toolbox (tools are part of the recipe: their schemas enter the chat
    template)."""
    assert "tool_success" in REWARDS

    @ml.recipe
    def grpo_tools(policy, ref_policy, prompts):
        step = ml.generate_step(policy, prompts, tools=toolbox, name="turn_1")
        first = step
        for t in range(2, turns + 1):
            results = ml.call_tools(step, tools=toolbox, name=f"tools_{t - 1}")
            step = ml.generate_step(policy, step.history, results, tools=toolbox, name=f"turn_{t}")
        rollout = ml.structure_rollout(step, name="rollout")
        rewards = (
            ml.reward(tool_call_format, step=first, rollout=rollout, weight=format_weight, name="tool_format")
            + ml.reward(final_answer, rollout=rollout, weight=answer_weight, name="answer")
            + ml.reward("tool_success", rollout=rollout, weight=success_weight)
        )
        advantages = ml.advantages(rewards, estimator="grpo", completions=rollout, name="advantages")
        policy_logprobs = ml.logprobs(policy, prompts, rollout, name="policy_logprobs")
        ref_logprobs = ml.logprobs(ref_policy, prompts, rollout, name="ref_logprobs")
        ml.set_loss(ml.policy_loss(advantages, policy_logprobs, ref_logprobs, loss="ppo_clip",
                                   agg="token_mean", kl="k3", kl_coef=kl_coef))

    return grpo_tools
