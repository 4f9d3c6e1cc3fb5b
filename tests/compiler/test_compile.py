"""Compile and run recipes end to end on the tiny random model."""

import copy

import anyio
import pytest
import torch

import materl as ml
from materl.errors import StepFailedError
from tests.tolerance import assert_same_update
from materl.errors import CompileError, ConfigError
from materl.recipes import RECIPES, grpo

from .conftest import toy_reward

PROMPTS = ["a", "b", "c", "d"]


def agents_for(recipe, tiny):
    agents = {"policy": tiny(trainable=True)}
    if "ref_policy" in recipe.agents:
        agents["ref_policy"] = tiny()
    if "value_model" in recipe.agents:
        agents["value_model"] = tiny(head="value", trainable=True)
    return agents


def test_seed_grpo_and_vapo_compile_and_run(tiny):
    @ml.algorithm(using=grpo)
    def vapo(graph, value_model):
        values = ml.values(value_model, graph.prompts, graph.completions)
        graph.advantages.replace_with(ml.gae_advantages(graph.rewards, values))
        ml.add_loss(ml.value_loss(values, graph.rewards))

    for recipe in (grpo, vapo):
        step = ml.compile(recipe, **agents_for(recipe, tiny), group_size=2, max_new_tokens=6)
        metrics = step.run(prompts=["hi", "yo"])
        assert metrics["episodes"] == 4 and metrics["failed_episodes"] == 0
        assert metrics["tokens"] > 0 and torch.isfinite(torch.tensor(metrics["loss"]))
        assert "loss/policy_loss" in metrics and "reward/length/mean" in metrics
    assert "loss/value_loss" in metrics and "value_loss/vf_clipfrac" in metrics


def test_arun_inside_a_loop_and_run_refuses_there(tiny):
    step = ml.compile(grpo, **agents_for(grpo, tiny), group_size=2, max_new_tokens=4)

    async def go():
        with pytest.raises(CompileError, match="use `await compiled.arun"):
            step.run(prompts=["x"])
        return await step.arun(prompts=["x"])

    assert anyio.run(go)["episodes"] == 2


def test_sentiment_style_sync_op_runs_per_group(tiny):
    seen = []

    @ml.op
    def sentiment_reward(completions_text: list[str]) -> {"rewards": torch.Tensor}:
        seen.append(len(completions_text))
        return {"rewards": torch.tensor([float(len(t) % 3) for t in completions_text])}

    @ml.recipe
    def sentiment_rl(policy, ref_policy, prompts):
        completions = ml.generate(policy, prompts)
        rewards = sentiment_reward(completions.text)
        advantages = ml.advantages(rewards)
        lp = ml.logprobs(policy, prompts, completions)
        ml.set_loss(ml.grpo_loss(advantages, lp, ml.logprobs(ref_policy, prompts, completions)))

    step = ml.compile(sentiment_rl, **agents_for(sentiment_rl, tiny), group_size=3, max_new_tokens=4)
    assert step.plan.stage_of("sentiment_reward") == "group"
    step.run(prompts=["p", "q"])
    assert seen == [3, 3]  # once per group of 3, as each group completed


def test_async_tool_op_and_generate_step(tiny):
    calls = []

    @ml.op
    async def execute_tools(tool_requests: list) -> {"tool_responses": list}:
        await anyio.sleep(0.01)
        calls.append(len(tool_requests))
        return {"tool_responses": ["42" for _ in tool_requests]}

    @ml.recipe
    def grpo_with_tools(policy, prompts):
        initial = ml.generate_step(policy, prompts, name="initial_step")
        responses = execute_tools(initial.tool_requests)
        final = ml.generate_step(policy, initial.history, responses, name="final_step")
        rollout = ml.structure_rollout(initial, responses, final)
        rewards = ml.reward("tool_usage", rollout=rollout) + ml.reward("length", rollout=rollout, target=4)
        adv = ml.advantages(rewards, completions=rollout)
        ml.set_loss(ml.ppo_loss(adv, ml.logprobs(policy, prompts, rollout)))

    step = ml.compile(grpo_with_tools, policy=tiny(trainable=True), group_size=2, max_new_tokens=5)
    assert step.plan.stage_of("execute_tools") == "episode"
    metrics = step.run(prompts=["x", "y"])
    assert calls == [0, 0, 0, 0]  # the tiny model makes no tool calls; the op still ran per episode
    assert metrics["failed_episodes"] == 0


def test_failed_episode_is_recorded_and_left_out(tiny):
    @ml.op
    async def flaky(text: str) -> {"score": float}:
        if text.endswith("!"):
            raise RuntimeError("tool server exploded")
        return {"score": 1.0}

    @ml.recipe
    def r(policy, prompts):
        c = ml.generate(policy, prompts, system="!")
        s = flaky(prompts)
        adv = ml.advantages(ml.reward("length", target=3) + s, completions=c)
        ml.set_loss(ml.ppo_loss(adv, ml.logprobs(policy, prompts, c)))

    step = ml.compile(r, policy=tiny(trainable=True), group_size=2, max_new_tokens=3)
    metrics = step.run(prompts=["ok", "bad!"])
    assert metrics["failed_episodes"] == 2 and metrics["episodes"] == 4  # half: below max_failed_fraction=0.5
    assert metrics["failures/flaky/RuntimeError"] == 2
    assert all("RuntimeError in node 'flaky': tool server exploded" in e for e in step.last_errors)
    assert len(step.last_episodes) == 2  # the update used the two good episodes


def hanging_recipe(*hangs_on: str):
    """A recipe whose reward op never returns for the prompts ``hangs_on`` (all: none given)."""
    @ml.op
    async def hang(text: str) -> {"score": float}:
        if not hangs_on or text in hangs_on:
            await anyio.sleep(3600)
        return {"score": 0.0}

    @ml.recipe
    def r(policy, prompts):
        c = ml.generate(policy, prompts)
        adv = ml.advantages(ml.reward("length") + hang(prompts), completions=c)
        ml.set_loss(ml.ppo_loss(adv, ml.logprobs(policy, prompts, c)))

    return r


def started(agent):
    """``agent`` with its engine started: the 0.5 s episode deadlines below time the hang, not
    the engine's start (~0.4 s, and more on a loaded machine)."""
    assert agent.engine is not None
    return agent


def test_a_hanging_episode_times_out(tiny):
    step = ml.compile(hanging_recipe(), policy=started(tiny(trainable=True)), group_size=2, max_new_tokens=2,
                      episode_timeout_s=0.5)
    with pytest.raises(StepFailedError) as info:
        step.run(prompts=["x"])
    assert "step 1: 2 of 2 episodes failed" in str(info.value)
    assert "2 x StepTimeoutError in node 'hang': episode exceeded episode_timeout_s=0.5" in str(info.value)
    assert "episode_timeout_s=0.5" in step.last_errors[0]


@pytest.mark.parametrize("cap", [64, 1])  # episodes that start together share one deadline; queued ones have their own
def test_a_hanging_group_times_out_and_the_other_group_trains(tiny, cap):
    step = ml.compile(hanging_recipe("x"), policy=started(tiny(trainable=True)), group_size=2, max_new_tokens=2,
                      episode_timeout_s=0.5, max_concurrent_episodes=cap)
    try:
        metrics = step.run(prompts=["x", "y"])
    finally:
        step.close()
    assert metrics["failed_episodes"] == 2 and metrics["failures/hang/StepTimeoutError"] == 2
    assert [ep.prompt for ep in step.last_episodes] == ["y", "y"]  # its group's advantages fired and it trained
    assert all("node 'hang': episode exceeded episode_timeout_s=0.5" in e for e in step.last_errors)


def test_compile_errors_name_what_is_wrong(tiny):
    with pytest.raises(CompileError, match="needs agent\\(s\\) ref_policy"):
        ml.compile(grpo, policy=tiny(trainable=True))
    with pytest.raises(ConfigError, match="'grup_size' \\(did you mean 'group_size'\\?\\)"):
        ml.compile(grpo, policy=tiny(trainable=True), ref_policy=tiny(), grup_size=2)
    with pytest.raises(CompileError, match="does not depend on any trainable agent"):
        ml.compile(grpo, policy=tiny(), ref_policy=tiny())
    with pytest.raises(ConfigError, match="top_p=2 is out of range"):
        ml.compile(grpo, policy=tiny(trainable=True), ref_policy=tiny(), top_p=2)


def test_explain_shows_stages_and_implementations(tiny):
    text = ml.compile(grpo, **agents_for(grpo, tiny), kernels="torch").explain()
    assert "rollout stage: one async task per episode" in text
    assert "%advantages = advantages(%rewards, %completions) {estimator='grpo'} [group]  <- torch" in text
    assert "learner prepare" in text and "%ref_logprobs" in text
    assert "(live)" in text


def test_micro_batches_accumulate_to_the_full_batch_update(tiny):
    """Gradient accumulation is exact: micro_batch=2 gives the same update as one micro-batch
    (SGD with lr=1, so the update is the gradient itself)."""
    results = []
    for micro in (None, 2):
        policy = tiny(trainable=True)
        before = [p.detach().clone() for p in policy.parameters()]
        step = ml.compile(ml.replace(grpo, "rewards", lambda g: ml.reward(toy_reward)), policy=policy,
                          ref_policy=tiny(), group_size=4, max_new_tokens=6, lr=1.0, optimizer="sgd",
                          micro_batch_size=micro)
        m = step.run(prompts=["a", "b"])
        results.append((m["loss"], [p.detach().clone() for p in policy.parameters()]))
    assert results[0][0] == pytest.approx(results[1][0], abs=1e-6)
    assert_same_update(results[1][1], results[0][1], before)


def test_dr_grpo_by_transform_equals_the_builtin(tiny):
    dr = ml.replace(grpo, "advantages", lambda g: ml.advantages(g.rewards, estimator="dr_grpo"))
    dr = ml.replace(dr, "policy_loss", lambda g: ml.policy_loss(
        g.advantages, g.policy_logprobs, g.ref_logprobs, loss="ppo_clip", agg="seq_mean_token_sum_norm",
        kl="k3", kl_coef=0.0))
    builtin = RECIPES["dr_grpo"]
    assert {n.name: (n.op, n.inputs, dict(n.params), n.scope) for n in dr.nodes} == \
        {n.name: (n.op, n.inputs, dict(n.params), n.scope) for n in builtin.nodes}
    runs = []
    for recipe in (dr, builtin):
        policy = tiny(trainable=True)
        step = ml.compile(recipe, policy=policy, ref_policy=tiny(), group_size=4, max_new_tokens=6, lr=1e-2)
        assert step.explain().replace("transform of 'grpo'", "").splitlines()[1:] == \
            ml.compile(builtin, policy=tiny(trainable=True), ref_policy=tiny(), group_size=4, max_new_tokens=6,
                       lr=1e-2).explain().splitlines()[1:]
        m = step.run(prompts=PROMPTS)
        runs.append((m["loss"], m["reward"], [p.detach().clone() for p in policy.parameters()]))
    assert runs[0][:2] == runs[1][:2]
    for a, b in zip(runs[0][2], runs[1][2]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", [n for n in sorted(RECIPES) if n not in ("dpo", "distill")])  # no reward
def test_every_builtin_recipe_raises_reward_on_a_toy_task(name, tiny):
    recipe = ml.replace(RECIPES[name], "rewards", lambda g: ml.reward(toy_reward, rollout=g.completions))
    if name == "remax":
        recipe = ml.replace(recipe, "rewards_1", lambda g: ml.reward(toy_reward, rollout=g.greedy))
    step = ml.compile(recipe, **agents_for(recipe, tiny), group_size=8, max_new_tokens=8, lr=1e-2, seed=0)
    rewards = [step.run(prompts=PROMPTS)["reward"] for _ in range(8)]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.05, f"{name}: reward did not rise: {[round(r, 3) for r in rewards]}"


def test_dpo_learns_the_preferred_answer(tiny):
    pairs = [{"prompt": f"q{i}", "chosen": "aaaa", "rejected": "zzzz"} for i in range(4)]
    step = ml.compile(RECIPES["dpo"], policy=tiny(trainable=True), ref_policy=tiny(), lr=1e-2)
    assert "rollout stage" not in step.explain()  # learner only
    first = step.run(pairs=pairs)
    for _ in range(5):
        last = step.run(pairs=pairs)
    assert first["dpo_loss/accuracy"] <= 0.5 + 1e-9 and last["dpo_loss/accuracy"] == 1.0
    assert last["loss"] < first["loss"]


@pytest.mark.mojo
def test_fused_reward_chain_equals_unfused(tiny):
    pytest.importorskip("mojo")
    from materl.kernels import loader

    if loader.disabled():
        pytest.skip("Mojo disabled")
    results = []
    for kernels in ("torch", "auto"):
        step = ml.compile(grpo, **agents_for(grpo, tiny), group_size=4, max_new_tokens=8, kernels=kernels)
        fused = "mojo-fused" in step.explain()
        assert fused == (kernels == "auto")
        m = step.run(prompts=["a", "b"])
        results.append({k: m[k] for k in ("reward", "reward/length/mean", "reward/diversity/mean", "loss")})
    assert "fused: length + diversity in %rewards" in step.explain()
    assert results[0] == pytest.approx(results[1], abs=1e-6)


@pytest.mark.mojo
def test_seed_custom_penalty_recipe_with_a_mojo_op(tiny, tmp_path):
    pytest.importorskip("mojo")
    from materl.kernels import loader

    if loader.disabled():
        pytest.skip("Mojo disabled")

    @ml.mojo_op(path="kernels/repetition_penalty.mojo")
    def repetition_penalty(completions: torch.Tensor) -> {"penalty_scores": torch.Tensor}:
        pass

    @ml.recipe
    def custom_penalty_rl(policy, ref_policy, prompts):
        completions = ml.generate(policy, prompts)
        rewards = ml.reward("length") - repetition_penalty(completions)
        advantages = ml.advantages(rewards)
        lp = ml.logprobs(policy, prompts, completions)
        ml.set_loss(ml.grpo_loss(advantages, lp, ml.logprobs(ref_policy, prompts, completions)))

    step = ml.compile(custom_penalty_rl, **agents_for(custom_penalty_rl, tiny), group_size=2, max_new_tokens=6)
    assert "mojo (user kernel)" in step.explain()
    m = step.run(prompts=["a", "b"])
    assert m["failed_episodes"] == 0 and "reward/repetition_penalty/mean" in m

    bad = tmp_path / "broken.mojo"
    bad.write_text("@export\ndef broken(x: Int) abi(\"C\") -> Int:\n    return undefined_name\n")
    for path, message in ((tmp_path / "missing.mojo", "missing.mojo"), (bad, "undefined_name")):
        @ml.mojo_op(path=str(path), fn_name="broken")
        def op(completions: torch.Tensor) -> {"s": torch.Tensor}:
            pass

        @ml.recipe
        def r(policy, prompts):
            c = ml.generate(policy, prompts)
            adv = ml.advantages(ml.reward("length") + op(c))
            ml.set_loss(ml.ppo_loss(adv, ml.logprobs(policy, prompts, c)))

        with pytest.raises(CompileError, match=rf"(?s)node .op. \(op call\): Mojo kernel .* failed to load: .*{message}"):
            ml.compile(r, policy=tiny(trainable=True))


@pytest.mark.parametrize("reference", ["frozen", "ema"])
def test_a_following_reference_moves_after_each_step_and_a_frozen_one_never(tiny, reference):
    policy, ref = tiny(trainable=True), tiny()
    recipe = ml.replace(grpo, "rewards", lambda g: ml.reward(toy_reward))
    step = ml.compile(recipe, policy=policy, ref_policy=ref, group_size=4, max_new_tokens=6, lr=1e-2,
                      reference=reference, reference_options={"decay": 0.25} if reference == "ema" else {})
    ref_before = [p.detach().clone() for p in ref.model.parameters()]
    try:
        step.run(PROMPTS[:2])
    finally:
        step.close()
    moved = [(a, b) for a, b in zip(ref_before, ref.model.parameters()) if not torch.equal(a, b)]
    assert any(not torch.equal(a, b) for a, b in zip(ref_before, policy.model.parameters()))  # the policy learned
    if reference == "frozen":
        assert step.references == [] and moved == []  # nothing to follow: no reference update is called
        return
    assert [r for r, _, _ in step.references] == [ref] and moved
    for before, after, new in zip(ref_before, ref.model.parameters(), policy.model.parameters()):
        expected = 0.25 * before.double() + 0.75 * new.detach().double()  # ref <- decay * ref + (1 - decay) * policy
        assert torch.allclose(after.double(), expected, rtol=0, atol=1e-6 * (1 + expected.abs().max()))


@pytest.mark.parametrize("cap", [64, 1])
def test_a_hanging_async_reward_times_out_its_episodes(tiny, cap):
    """A row-local node's batch call (here an async reward, one call per tick for every episode
    that reached it) is bounded by its episodes' deadline: the step fails their timeout instead of
    waiting for ever."""
    async def judge(*, completions, **_):
        await anyio.sleep(3600)  # a reward service that never answers
        return [0.0] * len(completions)

    @ml.recipe
    def r(policy, prompts):
        c = ml.generate(policy, prompts)
        ml.set_loss(ml.ppo_loss(ml.advantages(ml.reward(judge), completions=c), ml.logprobs(policy, prompts, c)))

    step = ml.compile(r, policy=started(tiny(trainable=True)), group_size=2, max_new_tokens=2,
                      episode_timeout_s=0.5, max_concurrent_episodes=cap)

    async def go():
        with anyio.fail_after(60):  # the bug: the stage waited for the reward call for ever
            await step.arun(prompts=["x"])

    with pytest.raises(StepFailedError) as info:
        anyio.run(go)
    assert "step 1: 2 of 2 episodes failed" in str(info.value)
    assert "StepTimeoutError in node 'rewards': episode exceeded episode_timeout_s=0.5" in str(info.value)



def test_a_steps_end_runs_in_the_compute_thread_and_run_returns_its_metrics(tiny):
    """The end of a step (engines' weights, policy version, following references, metrics) runs in
    the thread that serves the step's compute work, right after the update: ``run`` returns the
    metrics from there. An error in it still reaches the caller of ``run``."""
    import threading

    policy, ref = tiny(trainable=True), tiny()
    recipe = ml.replace(grpo, "rewards", lambda g: ml.reward(toy_reward))
    step = ml.compile(recipe, policy=policy, ref_policy=ref, group_size=4, max_new_tokens=6, lr=1e-2, reference="ema")
    synced, updated = [], []
    sync, update_references = policy.sync_engine, step.update_references
    policy.sync_engine = lambda: (synced.append(threading.current_thread()), sync())[1]
    step.update_references = lambda kl: (updated.append(threading.current_thread()), update_references(kl))[1]
    try:
        metrics = step.run(PROMPTS[:2])
        assert synced == updated == [threading.current_thread()]  # the caller's thread serves the compute work
        assert metrics["step"] == step.step_count == policy.policy_version == 1
        assert metrics["time/step"] > 0 and metrics["tokens_per_s"] == metrics["tokens"] / metrics["time/step"]
        policy.sync_engine = lambda: (_ for _ in ()).throw(RuntimeError("weight push failed"))
        with pytest.raises(RuntimeError, match="weight push failed"):
            step.run(PROMPTS[:2])
    finally:
        step.close()
