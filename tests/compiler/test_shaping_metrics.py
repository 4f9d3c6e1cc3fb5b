"""What a shaping experiment reads off a step: ``tool_calls``/``tool_success`` count the calls the
model wrote (an unanswered one did not succeed) on every step of a recipe that uses tools,
agents included; ``reward`` leaves out the episodes a tool outage masked (``masked_episodes``);
per-turn advantage statistics; ``step_credit`` set from the compile options (and so a config
and the CLI)."""

import dataclasses

import pytest
import torch

import materl as ml
from materl.cli import build_parser
from materl.recipes import grpo
from materl.compiler.compiled import Compiled
from materl.compiler.episode import Episode
from materl.compiler.metrics import advantage_turn_metrics
from materl.compiler.options import CompileOptions
from materl.errors import CompileError, ConfigError
from materl.rollout.multiturn import TurnResult
from materl.rollout.mcp import PythonTools, mcp_tools
from materl.rollout.types import Rollout, Step, ToolCall
from materl.runtime.config import load_config
from tests.compiler.test_infra_failures import rewards_of
from tests.compiler.test_infra_failures import run as run_with_faults


class Clock:
    def now(self) -> str:
        """The time."""
        return "noon"


@ml.op
async def force_call(step) -> {"step": TurnResult}:
    """The tiny random model never writes a call: give its turn one."""
    state = step.history
    last = dataclasses.replace(state.steps[-1], tool_calls=[ToolCall("now", {}, id=f"call_{len(state.steps)}")],
                               finish_reason="tool_call")
    return {"step": TurnResult(dataclasses.replace(state, steps=state.steps[:-1] + [last], done=False), last)}


def rollout_metrics(recipe, prompts=("a",)) -> dict:
    compiled = Compiled(recipe, {"policy": ml.Agent("tiny-random")}, CompileOptions(max_new_tokens=3, group_size=2),
                        rollout_only=True)
    try:
        return compiled.rollout_metrics(compiled.call_blocking(compiled.rollout, list(prompts)))
    finally:
        compiled.close()


def test_tool_calls_count_the_calls_written_and_an_unanswered_one_did_not_succeed():
    toolbox = mcp_tools(PythonTools(Clock))

    @ml.recipe
    def last_call_unanswered(policy, prompts):
        turn_1 = force_call(ml.generate_step(policy, prompts, name="turn_1"))
        results = ml.call_tools(turn_1, tools=toolbox, name="tools_1")
        turn_2 = force_call(ml.generate_step(policy, turn_1.history, results, name="turn_2"))
        ml.structure_rollout(turn_2, name="rollout")

    m = rollout_metrics(last_call_unanswered)
    # per episode: 2 calls written (one per turn), 1 answered without an error -> 2.0 and 0.5
    # (counting results, as before, said 1 call and 1.0)
    assert (m["tool_calls"], m["tool_success"]) == (2.0, 0.5)


async def agent_without_calls(client, task):
    reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task["prompt"]}])
    return reply.choices[0].message.content


def test_agent_steps_report_tool_metrics_without_any_result():
    @ml.recipe
    def agents(policy, prompts):
        ml.agent_episodes(policy, prompts, agent=agent_without_calls, max_new_tokens=3, name="rollout")

    m = rollout_metrics(agents)
    assert m["episodes"] == 2.0 and (m["tool_calls"], m["tool_success"]) == (0.0, 0.0)


def test_reward_leaves_out_the_episodes_an_outage_masked():
    # p0: one of three calls hangs; p1: two of three (its third is left out too: no baseline,
    # but its reward is a real one and counts); p2: none
    episodes, metrics = run_with_faults({"p0": ["hang"], "p1": ["hang", "hang"]})
    masked = [e for e in episodes if e.infra is not None]
    counted = [e for e in episodes if e.infra is None]
    assert len(masked) == 3 and metrics["masked_episodes"] == 3.0
    assert metrics["reward"] == pytest.approx(float(rewards_of(counted).mean()), rel=1e-6)
    assert metrics["reward/std"] == pytest.approx(float(rewards_of(counted).std(unbiased=False)), rel=1e-6, abs=1e-7)


def episode_with(advantages: list[float], steps: list[Step]) -> tuple[Episode, Rollout]:
    ep = Episode(0, 0, 0, "p", {}, 0)
    ep.store("advantages", torch.tensor(advantages))
    return ep, Rollout([0], steps)


def test_per_turn_advantage_statistics_by_hand():
    gen, tool = (lambda n: Step("generate", [1] * n, [0.0] * n)), (lambda n: Step("tool", [2] * n))
    # episode A: turn 1 advantages 1, 3 (mean 2), a tool token, turn 2 -1, -1 (mean -1)
    # episode B: one turn of 0.5, 0.5, 0.5 (mean 0.5), padded to the batch width with zeros
    a, ra = episode_with([1.0, 3.0, 0.0, -1.0, -1.0], [gen(2), tool(1), gen(2)])
    b, rb = episode_with([0.5, 0.5, 0.5, 0.0, 0.0], [gen(3)])

    @ml.recipe
    def scored(policy, prompts):
        rollout = ml.generate(policy, prompts, name="rollout")
        ml.advantages(ml.reward("length", rollout=rollout), completions=rollout, name="advantages")

    plan = plan_of(scored)
    rollouts = {id(a): ra, id(b): rb}
    m = advantage_turn_metrics(plan, [a, b], lambda ep: rollouts[id(ep)])
    # turn 1: mean(2, 0.5) = 1.25, std 0.75; turn 2: only A, -1; last turns: -1 and 0.5
    assert m == pytest.approx({"advantages/turn_1/mean": 1.25, "advantages/turn_1/std": 0.75,
                               "advantages/turn_2/mean": -1.0, "advantages/turn_2/std": 0.0,
                               "advantages/first_turn/mean": 1.25, "advantages/first_turn/std": 0.75,
                               "advantages/last_turn/mean": -0.25, "advantages/last_turn/std": 0.75})


def test_a_training_step_logs_per_turn_advantages():
    step = ml.compile(grpo, policy=ml.Agent("tiny-random", trainable=True),
                      ref_policy=ml.Agent("tiny-random"), group_size=4, max_new_tokens=6)
    try:
        m = step.run(prompts=["ab", "cd"])
    finally:
        step.close()
    # GRPO over one turn: each episode's tokens carry its normalised advantage, whose group mean is 0
    assert m["advantages/turn_1/mean"] == pytest.approx(0.0, abs=1e-6)
    assert m["advantages/last_turn/mean"] == m["advantages/first_turn/mean"] == m["advantages/turn_1/mean"]
    assert "advantages/turn_2/mean" not in m


def plan_of(recipe, **options):
    return Compiled(recipe, {"policy": ml.Agent("tiny-random")}, CompileOptions(**options), rollout_only=True).plan


def credit_recipe(**advantages_kw):
    @ml.recipe
    def credited(policy, prompts):
        rollout = ml.generate(policy, prompts, name="rollout")
        ml.advantages(ml.reward("length", rollout=rollout), completions=rollout, name="advantages", **advantages_kw)

    return credited


def test_step_credit_from_the_compile_options_a_config_and_the_cli(tmp_path):
    plan = plan_of(credit_recipe(), step_credit="sum")
    assert plan.nodes["advantages"].params["step_credit"] == "sum"
    # the recipe's own choice wins over the option
    plan = plan_of(credit_recipe(step_credit="process"), step_credit="sum")
    assert plan.nodes["advantages"].params["step_credit"] == "process"
    assert "step_credit" not in plan_of(credit_recipe()).nodes["advantages"].params
    with pytest.raises(CompileError, match=r"compile option step_credit='sum' applies to the GRPO family "
                                           r"\(grpo, dr_grpo\); node 'advantages' uses estimator 'rloo'"):
        plan_of(credit_recipe(estimator="rloo"), step_credit="sum")
    config = tmp_path / "run.yaml"
    config.write_text("recipe: grpo\ncompile:\n  step_credit: sum\n")
    assert load_config(config).compile_options().step_credit == "sum"
    args = build_parser().parse_args(["train", str(config), "--step-credit", "process"])
    assert args.overrides == ["compile.step_credit=process"]
    assert load_config(config, overrides=args.overrides).compile_options().step_credit == "process"
    with pytest.raises(ConfigError, match=r"step_credit"):
        load_config(config, overrides=["compile.step_credit=turn"])
