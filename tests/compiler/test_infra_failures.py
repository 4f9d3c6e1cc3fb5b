"""Tool infrastructure failures kept out of baselines and updates (compile option
``infra_failures``), with the real fault-injecting MCP server (tests/tools/faulty_server.py): a
call that hangs past ``tool_timeout_s`` is a timeout, a server that exits mid-call a crash. The
tiny random model never writes a tool call, so an async op gives turn 1 one; per group, the first
calls to arrive get the faulty tool (which episode gets it is up to scheduling; how many is not)."""

import dataclasses
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import materl as ml
from materl.compiler.failures import INFRA_ERROR_KINDS, mark_infra_failure
from materl.errors import StepFailedError
from materl.ops.advantages import grpo
from materl.rollout.episode import StepResult
from materl.rollout.types import ERROR_KINDS, ToolCall

ROOT = Path(__file__).resolve().parents[2]
FAULTY = [sys.executable, str(ROOT / "tests/tools/faulty_server.py")]


def recipe(toolbox, faults: dict[str, list[str]]):
    """Prompt p's episodes call ``faults[p][k]`` for the k-th call of its group to arrive ("echo"
    once the list runs out)."""
    calls = defaultdict(int)

    @ml.op
    async def call_by_arrival(step):
        state = step.history
        prompt = next(m["content"] for m in state.messages if m["role"] == "user")
        k = calls[prompt]
        calls[prompt] += 1
        tool = faults.get(prompt, [])[k] if k < len(faults.get(prompt, [])) else "echo"
        args = {"text": "fine"} if tool == "echo" else {}
        last = dataclasses.replace(state.steps[-1], tool_calls=[ToolCall(tool, args, id="call_0")],
                                   finish_reason="tool_call")
        return StepResult(dataclasses.replace(state, steps=state.steps[:-1] + [last], done=False), last)

    def length(*, completions, **_):  # a reward that differs between episodes
        return [float(len(c) % 5) for c in completions]

    @ml.recipe
    def tools(policy, prompts):
        step = call_by_arrival(ml.generate_step(policy, prompts, name="turn_1"))
        results = ml.call_tools(step, tools=toolbox, name="tools_1")
        rollout = ml.structure_rollout(ml.generate_step(policy, step.history, results, name="turn_2"), name="rollout")
        adv = ml.advantages(ml.reward(length, rollout=rollout, name="length"), estimator="grpo", completions=rollout,
                            name="advantages")
        ml.set_loss(ml.policy_loss(adv, ml.logprobs(policy, prompts, rollout)))

    return tools


def run(faults, **options):
    step = ml.compile(recipe(ml.mcp_tools(FAULTY), faults), policy=ml.Agent("tiny-random", trainable=True),
                      group_size=3, max_new_tokens=3, tool_timeout_s=1, **options)
    try:
        episodes = step.call_blocking(step.rollout, ["p0", "p1", "p2"])
        return episodes, step.call_blocking(step.learn, episodes)
    finally:
        step.close()


def trained(episode):
    """The episode's advantages on its trained tokens (the group's rows are padded to one width)."""
    mask = torch.tensor(episode.values["rollout"].loss_mask, dtype=torch.bool)
    return episode.resolve("advantages")[: len(mask)][mask].double()


def rewards_of(episodes):
    return torch.tensor([float(torch.as_tensor(e.values["rewards"]).sum()) for e in episodes], dtype=torch.float64)


def test_masked_episodes_leave_the_baseline_and_a_shrunk_group_is_dropped():
    # p0: one of three calls hangs (timeout): the other two are normalised between themselves.
    # p1: two of three time out: one is left, no baseline, so the group is dropped. p2: all fine.
    episodes, metrics = run({"p0": ["hang"], "p1": ["hang", "hang"]})
    by_prompt = defaultdict(list)
    for e in episodes:
        by_prompt[e.prompt].append(e)
    assert [e.infra for e in by_prompt["p0"]].count("timeout") == 1
    assert [e.infra for e in by_prompt["p1"]].count("timeout") == 2
    assert metrics["infra_failures/timeout"] == 3.0 and metrics["infra_failures/episodes_masked"] == 4.0
    assert metrics["infra_failures/groups_dropped"] == 1.0
    assert not any(e.ok for e in by_prompt["p1"])
    live = [e for e in by_prompt["p0"] if e.ok]
    assert len(live) == 2 and all(e.error is None for e in episodes)
    # the two left in p0 got GRPO over their own two rewards, as if the third had never run
    expected = grpo(rewards_of(live), torch.ones(2, 1, dtype=torch.float64), group_size=2)[0][:, 0]
    for e, a in zip(live, expected):
        assert torch.allclose(trained(e), a.expand(len(trained(e))), atol=1e-6)
    assert metrics["episodes"] == 9.0


def test_keep_trains_on_them_as_before():
    episodes, metrics = run({"p0": ["hang"]}, infra_failures="keep")
    assert metrics["infra_failures/timeout"] == 1.0 and metrics["infra_failures/episodes_masked"] == 0.0
    assert all(e.ok for e in episodes)
    p0 = [e for e in episodes if e.prompt == "p0"]
    expected = grpo(rewards_of(p0), torch.ones(3, 1, dtype=torch.float64), group_size=3)[0][:, 0]
    got = [trained(e)[0] for e in p0]
    assert torch.allclose(torch.stack(got).double(), expected, atol=1e-6)


def test_a_step_where_every_episode_hit_the_infrastructure_makes_no_update_and_says_why():
    with pytest.raises(StepFailedError, match=r"made no update: of 3 episodes, 3 left out after tool infrastructure "
                                              r"failures \(infra_failures='mask'; 1 x crash, 2 x timeout\)"):
        step = ml.compile(recipe(ml.mcp_tools(FAULTY), {"p0": ["crash", "hang", "hang"]}),
                          policy=ml.Agent("tiny-random", trainable=True), group_size=3, max_new_tokens=3,
                          tool_timeout_s=1)
        try:
            step.run(prompts=["p0"])
        finally:
            step.close()


def test_the_model_s_own_errors_are_not_infrastructure():
    # a malformed call (invalid_call) and a tool's own error result are the model's doing: trained on
    assert set(INFRA_ERROR_KINDS) == set(ERROR_KINDS) - {"invalid_call", "tool"}
    episodes, metrics = run({"p0": ["error"], "p1": ["nonexistent_tool"]})
    kinds = {r.error_kind for e in episodes for r in e.values["rollout"].tool_results if r.is_error}
    assert kinds == {"tool", "invalid_call"}
    assert all(e.ok and e.infra is None for e in episodes) and not any(k.startswith("infra") for k in metrics)
    for e in episodes:  # idempotent: marking again changes nothing
        mark_infra_failure(e, "mask")
        assert e.ok
