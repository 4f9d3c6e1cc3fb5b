"""ml.agent_episodes in compiled steps: the agent's rollouts train like generate_step's (the same
ids for the same seeds), and an agent that raises, hangs or sends a malformed request fails its
own episode only, with the error recorded."""

import asyncio
import threading

import httpx
import pytest

import materl as ml
from materl.compiler.compiled import Compiled
from materl.compiler.options import CompileOptions
from materl.errors import RecipeError


async def ask(client, task):
    out = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task["prompt"]}])
    return out.choices[0].message.content


def agent_recipe(agent_fn, *, train: bool = False):
    @ml.recipe
    def agents(policy, prompts):
        rollout = ml.agent_episodes(policy, prompts, agent=agent_fn, name="rollout")
        if train:
            rewards = ml.reward(lambda completions, **_: [float(len(c)) for c in completions], rollout=rollout)
            advantages = ml.advantages(rewards, estimator="grpo", completions=rollout)
            ml.set_loss(ml.policy_loss(advantages, ml.logprobs(policy, prompts, rollout)))
    return agents


@ml.recipe
def one_turn(policy, prompts):
    ml.structure_rollout(ml.generate_step(policy, prompts, name="turn_1"), name="rollout")


async def rollout(recipe, prompts, **options):
    compiled = Compiled(recipe, {"policy": ml.Agent("tiny-random")},
                        CompileOptions(max_new_tokens=6, group_size=2, **options), rollout_only=True)
    try:
        return await compiled.rollout(list(prompts))
    finally:
        await compiled.aclose()


async def test_an_agent_episode_samples_what_generate_step_samples_with_the_same_seeds():
    mine = await rollout(agent_recipe(ask), ["add 2 and 3", "hello"])
    theirs = await rollout(one_turn, ["add 2 and 3", "hello"])
    for a, b in zip(mine, theirs):
        ra, rb = a.values["rollout"], b.values["rollout"]
        assert (ra.prompt_ids, ra.completion_ids) == (rb.prompt_ids, rb.completion_ids)
        assert ra.sampling_logprobs == pytest.approx(rb.sampling_logprobs, abs=1e-5)  # batches may differ
        assert ra.metadata["result"] == ra.text and a.metrics["agent/segments"] == 1.0
    assert len({tuple(e.values["rollout"].completion_ids) for e in mine}) > 1  # seeds differ per episode


def test_a_compiled_step_trains_on_agent_episodes_and_reports_segments():
    step = ml.compile(agent_recipe(ask, train=True), policy=ml.Agent("tiny-random", trainable=True), group_size=2,
                      max_new_tokens=6, lr=1e-3)
    try:
        metrics = step.run(prompts=["a", "b"])
    finally:
        step.close()
    assert metrics["failed_episodes"] == 0.0 and metrics["agent/segments/mean"] == 1.0
    assert metrics["agent/requests/mean"] == 1.0
    assert abs(metrics["mismatch/max_abs"]) < 1e-4  # the learner scores the sampled ids, not re-tokenized text


async def test_an_agent_that_raises_hangs_or_sends_garbage_fails_only_its_own_episode():
    async def flaky(client, task):
        if task["prompt"] == "raise":
            await ask(client, task)
            raise ValueError("the agent's own bug")
        if task["prompt"] == "hang":
            await asyncio.sleep(60)
        if task["prompt"] == "garbage":
            async with httpx.AsyncClient() as http:  # a hand-rolled client sending a broken body
                await http.post(f"{client.base_url}chat/completions", content=b"{",
                                headers={"authorization": f"Bearer {client.api_key}"})
        return await ask(client, task)

    episodes = await rollout(agent_recipe(flaky), ["fine", "raise", "hang", "garbage"], episode_timeout_s=3,
                             max_failed_fraction=1.0)
    by_prompt = {}
    for ep in episodes:
        by_prompt.setdefault(ep.prompt, []).append(ep)
    assert all(ep.error is None and ep.values["rollout"].num_turns == 1 for ep in by_prompt["fine"])
    assert {(ep.error.node, ep.error.kind) for ep in by_prompt["raise"]} == {("rollout", "ValueError")}
    assert all("the agent's own bug" in ep.error.message for ep in by_prompt["raise"])
    assert {ep.error.kind for ep in by_prompt["hang"]} == {"StepTimeoutError"}
    assert all("episode_timeout_s=3" in ep.error.message for ep in by_prompt["hang"])
    assert {ep.error.kind for ep in by_prompt["garbage"]} == {"EpisodeError"}
    assert all("Invalid JSON" in ep.error.message for ep in by_prompt["garbage"])


async def test_an_agent_that_never_asks_the_model_fails_its_episode():
    async def silent(client, task):
        return "no model needed"

    episodes = await rollout(agent_recipe(silent), ["x"], max_failed_fraction=1.0)
    assert {ep.error.kind for ep in episodes} == {"EpisodeError"}
    assert "made no chat request" in episodes[0].error.message


async def test_a_plain_def_agent_runs_in_a_thread_with_a_synchronous_client():
    """Most existing agent code is synchronous: it runs in a thread of its own, with an
    ``openai.OpenAI`` client, and samples exactly what the async agent samples (same seeds)."""
    import openai

    seen = []

    def sync_ask(client, task):
        seen.append((type(client), threading.current_thread() is threading.main_thread()))
        out = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task["prompt"]}])
        return out.choices[0].message.content

    mine = await rollout(agent_recipe(sync_ask), ["add 2 and 3", "hello"])
    theirs = await rollout(agent_recipe(ask), ["add 2 and 3", "hello"])
    assert seen and all(kind is openai.OpenAI and not main for kind, main in seen)
    for a, b in zip(mine, theirs):
        assert a.error is None, a.error
        ra, rb = a.values["rollout"], b.values["rollout"]
        assert (ra.prompt_ids, ra.completion_ids) == (rb.prompt_ids, rb.completion_ids)
        assert ra.metadata["result"] == ra.text


def test_agent_must_be_callable():
    with pytest.raises(RecipeError, match="needs a function"):
        agent_recipe("my_agent")


async def test_request_rewards_land_on_the_last_token_of_the_request_they_score():
    async def two_requests(client, task):
        messages = [{"role": "user", "content": task["prompt"]}]
        first = await client.chat.completions.create(model="policy", messages=messages)
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        await client.chat.completions.create(model="policy", messages=messages)

    def per_request(*, messages, reply, task):
        # request 0 answers 1 message, request 1 answers 3: 0.5 for the first, none for the second
        return 0.5 if len(messages) == 1 else None

    @ml.recipe
    def stepwise(policy, prompts):
        rollout = ml.agent_episodes(policy, prompts, agent=two_requests, request_reward=per_request, name="rollout")
        ml.reward("step_rewards", rollout=rollout)

    (ep, _) = await rollout(stepwise, ["x"])
    r = ep.values["rollout"]
    first_end = len(r.steps[0].token_ids) - 1
    expected = [0.0] * len(r.completion_ids)
    expected[first_end] = 0.5  # on the last token request 0 sampled
    assert [s.reward for s in r.steps] == [0.5, None, None]
    assert ep.values["rewards"].tolist() == expected
