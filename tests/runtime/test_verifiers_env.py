"""verifiers environments (the real ``verifiers`` 0.4.0 from the package index, in a venv of its
own made once per session) train through ``ml.agent_episodes``' endpoint unchanged: their
dataset as prompts, their harness's loop and MCP tools, their ``@vf.reward`` functions as named
rewards, the endpoint's exact tokens. The environments are in tests/verifiers_envs/."""

from pathlib import Path

import pytest

import materl as ml
from materl.compiler.compiled import Compiled
from materl.compiler.options import CompileOptions
from materl.runtime.verifiers_env import make_venv
from tests.rollout.taught import teach

ENVS = Path(__file__).resolve().parents[1] / "verifiers_envs"
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 0, "b": 7}}\n</tool_call>'


@pytest.fixture(scope="session")
def vf_python(tmp_path_factory):
    return make_venv(tmp_path_factory.getbasetemp() / "verifiers-venv")


async def rollouts(env, policy, rows, **options):
    @ml.recipe
    def vf_episodes(policy, prompts):
        ml.agent_episodes(policy, prompts, agent=env.agent, name="rollout", **options)

    compiled = Compiled(vf_episodes, {"policy": policy}, CompileOptions(group_size=1, episode_timeout_s=300),
                        rollout_only=True)
    try:
        episodes = await compiled.rollout([r["prompt"] for r in rows], vf_task=[r["vf_task"] for r in rows])
    finally:
        await compiled.aclose()
    assert all(e.error is None for e in episodes), [e.error for e in episodes]
    return [e.values["rollout"] for e in episodes]


@pytest.mark.slow
async def test_a_single_turn_environment_trains_on_its_rewards_of_the_sampled_text(vf_python):
    with ml.VerifiersEnv("vf_addition", python=vf_python, path=[ENVS], options={"num_tasks": 2}) as env:
        rows = env.rows()
        assert rows == [{"prompt": "What is 0 + 0?", "vf_task": 0}, {"prompt": "What is 1 + 1?", "vf_task": 1}]
        assert env.reward_weights == {"exact_match": 1.0, "brevity": 0.5}

        @ml.recipe
        def vf_grpo(policy, prompts):
            rollout = ml.agent_episodes(policy, prompts, agent=env.agent, name="rollout")
            advantages = ml.advantages(env.rewards(rollout=rollout), estimator="grpo", completions=rollout)
            ml.set_loss(ml.policy_loss(advantages, ml.logprobs(policy, prompts, rollout), agg="token_mean"))

        step = ml.compile(vf_grpo, policy=ml.Agent("tiny-random", trainable=True), group_size=2, max_new_tokens=4)
        episodes = []
        try:
            metrics = await step.arun(prompts=[rows[1]["prompt"]], vf_task=[rows[1]["vf_task"]],
                                      on_episode=episodes.append)
        finally:
            await step.aclose()
    assert metrics["failed_episodes"] == 0.0 and metrics["agent/requests/mean"] == 1.0 and len(episodes) == 2
    expected = {"exact_match": [], "brevity": []}
    for episode in episodes:
        rollout = episode.values["rollout"]
        result, reply = rollout.metadata["result"], rollout.text.strip()
        # verifiers scored the text the endpoint decoded from the sampled ids (its last_reply strips it)
        assert result["reply"] == reply and result["turns"] == 1
        answer = str(2 * episode.columns["vf_task"])
        assert result["rewards"] == {"exact_match": float(reply == answer), "brevity": float(len(reply) <= 4)}
        assert [s.kind for s in rollout.steps] == ["generate"]
        assert rollout.loss_mask == [1] * len(rollout.steps[0].token_ids)
        for name in expected:
            expected[name].append(result["rewards"][name])
    # each @vf.reward is a reward term under its own name
    for name, scores in expected.items():
        assert metrics[f"reward/{name}/mean"] == pytest.approx(sum(scores) / len(scores), abs=1e-6)


@pytest.mark.slow
async def test_a_multi_turn_tool_environment_runs_its_tool_and_turns_on_exact_ids(vf_python):
    with ml.VerifiersEnv("vf_tool_followup", python=vf_python, path=[ENVS]) as env:
        rows = env.rows()[:1]
        assert rows == [{"prompt": "Use the add tool: what is 0 + 7?", "vf_task": 0}]
        assert env.reward_weights == {"correct": 1.0, "used_tool": 0.2}
        policy = ml.Agent("tiny-random")
        # 1. the harness's first request as it sends it (the add tool's schema included)
        (first,) = await rollouts(env, policy, rows, greedy=True, max_new_tokens=8)
        assert first.metadata["result"]["turns"] == 2  # the Env's follow-up turn asked again
        # 2. teach the tiny model to answer that context with a call of the environment's tool
        teach(policy, [(first.prompt_ids, CALL)])
        (rollout,) = await rollouts(env, policy, rows, greedy=True, max_new_tokens=96)
    assert rollout.prompt_ids == first.prompt_ids
    call = rollout.steps[0].tool_calls[0]
    assert (call.name, call.arguments) == ("add", {"a": 0, "b": 7})
    # verifiers ran its MCP tool (0 + 7 = 7) and sent the result back: a tool step, untrained
    assert [s.kind for s in rollout.steps][:3] == ["generate", "tool", "generate"]
    assert "7" in policy.tokenizer.decode(rollout.steps[1].token_ids)
    n0, n1 = len(rollout.steps[0].token_ids), len(rollout.steps[1].token_ids)
    assert rollout.loss_mask[:n0 + n1] == [1] * n0 + [0] * n1
    assert rollout.metadata["result"]["rewards"]["used_tool"] == 1.0
    assert rollout.metadata["num_segments"] == 1  # every request continued the previous one's ids


def test_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(ml.ConfigError, match=r"python='no/such/python'.*make_venv"):
        ml.VerifiersEnv("vf_addition", python="no/such/python")
    python = tmp_path / "python"
    python.write_text("")
    with pytest.raises(ValueError, match=r"num_tasks=0\); accepted: a positive int"):
        ml.VerifiersEnv("vf_addition", python=python, num_tasks=0)
    with pytest.raises(ValueError, match=r"taskset=''"):
        ml.VerifiersEnv("", python=python)


def test_verifiers_score_reads_each_episodes_named_score():
    from materl.rollout.types import Rollout
    from materl.runtime.verifiers_env import verifiers_score

    rollouts = [Rollout([1], metadata={"result": {"rewards": {"a": 0.25, "b": 1.0}}}),
                Rollout([1], metadata={"result": None})]  # scored without a result: the model's mistake
    assert verifiers_score(rollouts=rollouts, key="a") == [0.25, 0.0]
    assert verifiers_score(rollouts=rollouts, key="b") == [1.0, 0.0]


@pytest.mark.slow
def test_an_unknown_taskset_fails_to_load_with_verifiers_message(vf_python):
    env = ml.VerifiersEnv("vf_no_such_taskset", python=vf_python, path=[ENVS])
    with pytest.raises(ml.ConfigError, match=r"'vf_no_such_taskset' failed to load: .*vf_no_such_taskset"):
        env.rows()
    env.close()
