"""GRPO over multi-turn tool episodes (calculator by default).

Each episode alternates ``generate_step`` and tool calls for up to ``turns`` model turns: the
model may emit ``<tool_call>{"name": "calculate", "arguments": {...}}</tool_call>``, the tool
runs on an MCP server, its result is appended as exact tokens, and the model continues. Tool
output and prompts are never trained on (loss mask 0).

Rewards: the final answer (exact match of its last number against the ``answer`` column) and
the fraction of tool calls that succeeded, on the episode's last token; and whether the first
turn made a well-formed tool call (-0.5 for a malformed one) as a STEP reward on turn 1's last
token (``format_as_step=True``, the default), or as an outcome term (``False``). By default a
well-formed call earns the format reward even when the tool answers it with an error;
``format_needs_success=True`` pays it only for calls that work (the demo's setting). Advantages are
GRPO's (Shao et al. 2024, arXiv:2402.03300); with the step reward, ``step_credit`` picks how
steps are credited: ``"process"`` (default: DeepSeekMath's process supervision, every step reward
normalised over all the group's step rewards), ``"turn"`` (``ml.turn_advantages``: turn j
against turn j of the group, MT-GRPO style) or ``"gigpo"`` (``ml.gigpo_advantages``: episode
plus same-state step advantages, arXiv:2505.10978); docs/reward-shaping.md compares them. The
loss is the clipped surrogate averaged over tokens (DAPO's token mean), with an optional k3 KL
to the reference.

Differences from the canonical GRPO: multi-turn episodes with tool output masked out; no KL by
default (``kl_coef=0``, as in DAPO and Dr. GRPO; the reference forward is then skipped).
With ``format_as_step=False`` every term is an outcome and GRPO's group statistics are those of
the summed reward; the demo (examples/calculator_tool_rl.py) was tuned that way, with
``format_needs_success=True`` (paid for failing calls, a demo run learned well-formed calls that
the tool rejected, for a reward of 0.2 each).

``show_schemas=False`` keeps the tools' JSON schemas out of the chat template (the system
prompt then has to describe the tools); the calculator's schema block is ~230 tokens per row,
which on a CPU more than doubles the learner's cost for a short prompt.

Build it with a toolbox: ``grpo_tools_recipe(ml.mcp_tools("python -m materl.tools.calculator"))``.
"""

import re

import materl as ml

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
STEP_CREDIT = ("process", "turn", "gigpo")


def _advantages(step_credit: str, rewards, rollout):
    if step_credit == "turn":
        return ml.turn_advantages(rewards, rollout, name="advantages")
    if step_credit == "gigpo":
        return ml.gigpo_advantages(rewards, rollout, name="advantages")
    return ml.advantages(rewards, estimator="grpo", completions=rollout, name="advantages")


def tool_call_format(*, rollouts, **_):
    """1 if the episode's first turn made a well-formed tool call, -0.5 for a malformed one, else 0."""
    out = []
    for r in rollouts:
        calls = r.steps[0].tool_calls if r.steps and r.steps[0].kind == "generate" else []
        out.append(-0.5 if any(c.error for c in calls) else 1.0 if calls else 0.0)
    return out


def tool_call_format_succeeded(*, rollouts, **_):
    """Like ``tool_call_format``, but a well-formed first-turn call earns the 1 only if none of
    its tool results is an error (a call to an unknown tool, or an expression the tool rejects,
    scores 0): the format bonus then cannot pay for calls that do not work."""
    out = []
    for r, fmt in zip(rollouts, tool_call_format(rollouts=rollouts)):
        results = r.steps[1].tool_results if fmt == 1.0 and len(r.steps) > 1 and r.steps[1].kind == "tool" else []
        out.append(0.0 if fmt == 1.0 and (not results or any(x.is_error for x in results)) else fmt)
    return out


def final_answer(*, completions, answer, **_):
    """1 if the last number of the final turn equals the gold answer (commas ignored)."""
    out = []
    for text, gold in zip(completions, answer):
        nums = _NUMBER.findall(text or "")
        got = nums[-1].replace(",", "") if nums else None
        out.append(1.0 if got is not None and got == str(gold).replace(",", "") else 0.0)
    return out


def grpo_tools_recipe(toolbox, *, turns: int = 2, answer_weight: float = 1.0, format_weight: float = 0.2,
                      success_weight: float = 0.2, kl_coef: float = 0.0, show_schemas: bool = True,
                      format_as_step: bool = True, format_needs_success: bool = False, step_credit: str = "process"):
    """The recipe for a given toolbox (tools are part of the recipe: by default their schemas
    enter the chat template). ``turns``: model turns per episode (2 = call, then answer).
    ``format_as_step``: the tool-call format reward is a step reward on turn 1's last token
    (credits exactly the tokens that made the call); False makes it an outcome term like the
    others (the demo's tuned setting). ``format_needs_success``: the format reward is paid only
    for a well-formed call whose tool results are not errors (``tool_call_format_succeeded``).
    ``step_credit``: ``"process"``, ``"turn"`` or ``"gigpo"`` (module docstring)."""
    if step_credit not in STEP_CREDIT:
        raise ml.RecipeError(f"grpo_tools_recipe(step_credit={step_credit!r}): valid: {', '.join(STEP_CREDIT)}")
    schemas = toolbox if show_schemas else None
    fmt = tool_call_format_succeeded if format_needs_success else tool_call_format

    @ml.recipe
    def grpo_tools(policy, ref_policy, prompts):
        step = first = ml.generate_step(policy, prompts, tools=schemas, name="turn_1")
        for t in range(2, turns + 1):
            results = ml.call_tools(step, tools=toolbox, name=f"tools_{t - 1}")
            step = ml.generate_step(policy, step.history, results, tools=schemas, name=f"turn_{t}")
        rollout = ml.structure_rollout(step, name="rollout")
        rewards = (
            ml.reward(final_answer, rollout=rollout, weight=answer_weight, name="answer")
            + ml.reward(fmt, rollout=rollout, weight=format_weight, name="tool_format",
                        step=first if format_as_step else None)
            + ml.reward("tool_success", rollout=rollout, weight=success_weight)
        )
        advantages = _advantages(step_credit, rewards, rollout)
        policy_logprobs = ml.logprobs(policy, prompts, rollout, name="policy_logprobs")
        ref_logprobs = ml.logprobs(ref_policy, prompts, rollout, name="ref_logprobs") if kl_coef else None
        ml.set_loss(ml.policy_loss(advantages, policy_logprobs, ref_logprobs, loss="ppo_clip",
                                   agg="token_mean", kl="k3" if kl_coef else None, kl_coef=kl_coef))

    return grpo_tools
