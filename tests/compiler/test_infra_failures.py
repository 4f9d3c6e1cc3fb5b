"""Tool infrastructure failures kept out of baselines and updates (compile option
``infra_failures``), with the real fault-injecting MCP server (tests/tools/faulty_server.py): a
call that hangs past ``tool_timeout_s`` is a timeout, a server that exits mid-call a crash. The
tiny random model never writes a tool call, so an async op gives turn 1 one; per group, the first
calls to arrive get the faulty tool (which episode gets it is up to scheduling; how many is not).
A step that every episode's failure left with nothing to learn from is skipped, and the run goes
on (compile option ``max_skipped_steps``), through ``run`` and ``ml.train`` (learner ranks:
tests/distributed/test_learner_ranks.py)."""

import dataclasses
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import materl as ml
from materl.compiler.episode import Episode
from materl.compiler.failures import INFRA_ERROR_KINDS, Failure, FailurePolicy, mark_infra_failure
from materl.errors import StepFailedError
from materl.ops.advantages import grpo
from materl.rollout.multiturn import TurnResult
from materl.rollout.types import ERROR_KINDS, ToolCall
from materl.runtime.checkpoint import load_checkpoint
from materl.runtime.train import train

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
        return TurnResult(dataclasses.replace(state, steps=state.steps[:-1] + [last], done=False), last)

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


def compiled(faults, **options):
    return ml.compile(recipe(ml.mcp_tools(FAULTY), faults), policy=ml.Agent("tiny-random", trainable=True),
                      group_size=3, max_new_tokens=3, tool_timeout_s=1, lr=1e-2, **options)


def weights(step):
    return {k: v.clone() for k, v in step.agents["policy"].model.state_dict().items()}


def test_a_step_that_every_episode_hit_the_infrastructure_is_skipped_and_the_next_trains(caplog):
    # step 1: p0's three calls crash the server, hang, hang: every episode is left out, so there
    # is nothing to learn from: no optimizer step, but the step counts and the run goes on.
    # step 2: the list has run out, p0's calls are answered: it trains.
    step = compiled({"p0": ["crash", "hang", "hang"]})
    try:
        before = weights(step)
        first = step.run(prompts=["p0"])
        assert torch.equal(torch.cat([t.flatten() for t in weights(step).values()]),
                           torch.cat([t.flatten() for t in before.values()]))  # bit for bit
        assert first["infra_failures/update_skipped"] == 1.0 and first["step"] == 1 and step.step_count == 1
        assert first["infra_failures/crash"] == 1.0 and first["infra_failures/timeout"] == 2.0
        assert first["infra_failures/episodes_masked"] == 3.0 and "loss" not in first
        assert not step.optimizers["policy"].state  # no optimizer step (AdamW would hold moments)
        assert step.agents["policy"].policy_version == 1  # the step's version: the same weights
        assert len(step.last_episodes) == 3  # what ran, for the samples of the step
        warned = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
        assert len(warned) == 1 and warned[0].startswith(
            "step 1 made no update: of 3 episodes, 3 left out after tool infrastructure failures "
            "(infra_failures='mask'; 1 x crash, 2 x timeout); the step is skipped"), warned
        assert "max_skipped_steps=3" in warned[0]

        second = step.run(prompts=["p0"])
        assert second["infra_failures/update_skipped"] == 0.0 and second["step"] == 2
        assert not any(k.startswith("infra_failures/") and k != "infra_failures/update_skipped" for k in second)
        changed = [k for k, v in weights(step).items() if not torch.equal(v, before[k])]
        assert changed and "loss" in second
        adam = next(iter(step.optimizers["policy"].state.values()))
        assert float(adam["step"]) == 1.0  # one optimizer step in two training steps
    finally:
        step.close()


def test_more_skipped_steps_in_a_row_than_max_skipped_steps_stop_the_run():
    # max_skipped_steps=1: skipped, trained (the count starts again), skipped, and a second skip
    # in a row stops the run, naming the limit and how to raise it
    hang, echo = ["hang"] * 3, ["echo"] * 3
    step = compiled({"p0": hang + echo + hang + hang}, max_skipped_steps=1)
    try:
        skipped = [step.run(prompts=["p0"])["infra_failures/update_skipped"] for _ in range(3)]
        assert skipped == [1.0, 0.0, 1.0]
        with pytest.raises(StepFailedError) as e:
            step.run(prompts=["p0"])
        assert str(e.value) == (
            "step 4 made no update: of 3 episodes, 3 left out after tool infrastructure failures "
            "(infra_failures='mask'; 3 x timeout)\nsteps in a row without an update after tool "
            "infrastructure failures: 2, more than max_skipped_steps=1; to ride out a longer outage raise it "
            "(compile option max_skipped_steps, compile.max_skipped_steps in a config)")
        assert step.step_count == 3  # the failed step is not counted
    finally:
        step.close()


def test_max_skipped_steps_0_stops_at_the_first_outage_step():
    step = compiled({"p0": ["crash", "hang", "hang"]}, max_skipped_steps=0)
    try:
        with pytest.raises(StepFailedError, match=r"made no update: of 3 episodes, 3 left out after tool "
                                                  r"infrastructure failures \(infra_failures='mask'; 1 x crash, "
                                                  r"2 x timeout\)\nsteps in a row .*: 1, more than "
                                                  r"max_skipped_steps=0"):
            step.run(prompts=["p0"])
    finally:
        step.close()


def test_a_step_left_empty_for_other_reasons_still_stops_the_run():
    # dynamic sampling filtered one group, infrastructure failures left out the other: not only an
    # outage, so the step stops the run as before (and so does one whose episodes all failed)
    policy = FailurePolicy(0.5, max_skipped_steps=3)
    filtered, masked = make(group=0, filtered=True), make(group=1, excluded="tool infrastructure failure (timeout)")
    with pytest.raises(StepFailedError, match=r"step 1 made no update: of 2 episodes, 1 filtered by dynamic "
                                              r"sampling .*, 1 left out after tool infrastructure failures"):
        policy.check_update([filtered, masked], step=1)
    failed = make(group=0, error=Failure("rewards", "RewardError", "reward server down"))
    with pytest.raises(StepFailedError, match=r"^step 2 made no update: of 1 episodes, 1 failed\n"):
        policy.check_update([failed], step=2)
    assert policy.skipped == 0
    assert policy.check_update([make(group=0, excluded="tool infrastructure failure (timeout)")], step=3) is False
    assert policy.skipped == 1
    assert policy.check_update([make(group=0)], step=4) is True and policy.skipped == 0
    # one episode failed (within max_failed_fraction=0.5), the other two hit the outage: skipped
    outage = [make(group=0, excluded="tool infrastructure failure (unavailable)") for _ in range(2)]
    policy.check([failed, *outage], step=5)
    assert policy.check_update([failed, *outage], step=5) is False and policy.skipped == 1


def train_through_an_outage(run_dir, *, learner_ranks=1, **options):
    """``ml.train`` over prompts p0, p1, p2 (one a step, in order) whose step-1 calls all hang."""
    step = compiled({"p0": ["hang"] * 3}, seed=0, **options)
    try:
        start = weights(step)
        out = train(step, [{"prompt": f"p{i}"} for i in range(3)], steps=3, batch_size=1, shuffle=False,
                    lr_schedule="linear", save_every=1, run_dir=run_dir, progress=False, tensorboard=False,
                    learner_ranks=learner_ranks)
        return out, start, weights(step)
    finally:
        step.close()


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_ml_train_counts_the_skipped_step_and_goes_on(tmp_path, max_staleness):
    # step 1 skipped: logged, the linear schedule advances (1e-2, then 2/3 and 1/3 of it), its
    # checkpoint holds the starting weights; steps 2 and 3 train. The asynchronous pipeline
    # (max_staleness=1) goes on too: step 1's version (1) is published with the same weights.
    out, start, end = train_through_an_outage(tmp_path / "run", max_staleness=max_staleness)
    history = out["history"]
    assert [h["step"] for h in history] == [1, 2, 3]
    assert [h["infra_failures/update_skipped"] for h in history] == [1.0, 0.0, 0.0]
    assert [h["lr"] for h in history] == pytest.approx([1e-2, 1e-2 * 2 / 3, 1e-2 / 3])
    assert "loss" not in history[0] and all("loss" in h for h in history[1:])
    first = load_checkpoint(tmp_path / "run" / "checkpoints" / "step-000001", fallback=False)
    saved = load_file(str(Path(first.path) / "agents" / "policy" / "model.safetensors"))
    assert saved.keys() == start.keys() and all(torch.equal(saved[k], start[k]) for k in saved)
    assert any(not torch.equal(end[k], start[k]) for k in start)


def make(*, group, **fields):
    return Episode(index=0, group=group, group_id=group, prompt="p", columns={}, seed=0, **fields)


def test_the_model_s_own_errors_are_not_infrastructure():
    # a malformed call (invalid_call) and a tool's own error result are the model's doing: trained on
    assert set(INFRA_ERROR_KINDS) == set(ERROR_KINDS) - {"invalid_call", "tool"}
    episodes, metrics = run({"p0": ["error"], "p1": ["nonexistent_tool"]})
    kinds = {r.error_kind for e in episodes for r in e.values["rollout"].tool_results if r.is_error}
    assert kinds == {"tool", "invalid_call"}
    assert all(e.ok and e.infra is None for e in episodes) and metrics["infra_failures/update_skipped"] == 0.0
    assert [k for k in metrics if k.startswith("infra")] == ["infra_failures/update_skipped"]
    for e in episodes:  # idempotent: marking again changes nothing
        mark_infra_failure(e, "mask")
        assert e.ok
