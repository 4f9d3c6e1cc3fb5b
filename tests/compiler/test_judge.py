"""ml.judge: an LLM judge's score as a reward term, against real judges: a tiny model in process
and the same model over HTTP (materl's own OpenAI-compatible endpoint). The random tiny model
answers gibberish, so the parse-failure path runs for real; the success path reads its answer
with a ``parse=`` the test controls, or teaches the model the answer first."""

import anyio
import anyio.abc
import pytest

import materl as ml
from materl.compiler.compiled import Compiled
from materl.compiler.options import CompileOptions
from materl.engines.base import SamplingParams
from materl.errors import ConfigError, RecipeError, RewardError
from materl.rollout.endpoint import AgentEndpoint, AgentSession
from materl.rollout.multiturn import EpisodeState
from materl.rollout.judge import absolute_messages, parse_ranking, parse_score
from tests.rollout.taught import teach


def judged(judge_model, **judge_kw):
    @ml.recipe
    def judged_recipe(policy, prompts):
        rollout = ml.generate(policy, prompts, greedy=True, name="rollout")
        ml.judge("Is it a friendly reply?", model=judge_model, rollout=rollout, name="judge", **judge_kw) \
            + ml.reward(lambda completions, **_: [1.0] * len(completions), name="one")
    return judged_recipe


async def rollout(recipe, prompts=("hi", "yo"), *, steps: list | None = None, policy=None, **options):
    compiled = Compiled(recipe, {"policy": policy or ml.Agent("tiny-random")},
                        CompileOptions(max_new_tokens=5, group_size=2, max_failed_fraction=1.0, **options),
                        rollout_only=True)
    if steps is not None:  # the caller reads the step's live services
        steps.append(compiled)
    try:
        return await compiled.rollout(list(prompts))
    finally:
        await compiled.aclose()


def test_the_default_parsers_read_scores_and_refuse_the_rest():
    assert parse_score("The reply is fine.\nScore: 0.25\nScore: 0.75") == 0.75
    with pytest.raises(RewardError, match="no 'Score"):
        parse_score("I like it")
    with pytest.raises(RewardError, match="outside"):
        parse_score("Score: 7")
    assert parse_ranking("Response 2: 0.5\nresponse 1 = 1", 2) == [1.0, 0.5]
    with pytest.raises(RewardError, match=r"missing \[2\]"):
        parse_ranking("Response 1: 0.5", 2)


async def test_a_gibberish_judge_fails_its_episodes_after_its_retries():
    judge_model = ml.Agent("tiny-random")
    recipe = judged(judge_model, retries=1, max_new_tokens=8, temperature=1.0)
    steps = []
    episodes = await rollout(recipe, steps=steps)
    judge = steps[0].service("judge")  # the live Judge the step built from the recipe's spec
    assert judge.calls == 8  # 2 prompts x 2 episodes each x (1 try + 1 retry)
    for ep in episodes:
        assert (ep.error.node, ep.error.kind) == ("judge", "RewardError")
        assert "failed after 2 attempt(s)" in ep.error.message and "no 'Score: <number>' line" in ep.error.message
        assert "rewards" not in ep.values  # never a silent 0


async def test_an_in_process_judge_scores_each_episode_with_a_user_parse():
    seen = []

    def length_score(text):  # the user's reading of the judge's answer
        seen.append(text)
        return min(1.0, len(text) / 64)

    episodes = await rollout(judged(ml.Agent("tiny-random"), parse=length_score, max_new_tokens=12))
    assert all(ep.error is None for ep in episodes) and len(seen) == 4
    got = sorted(ep.values["judge"] for ep in episodes)
    assert got == pytest.approx(sorted(min(1.0, len(t) / 64) for t in seen))
    # the judge term and the other term sum (weights 1 and 1)
    assert [ep.values["rewards"] for ep in episodes] == pytest.approx([ep.values["judge"] + 1.0 for ep in episodes])


async def test_a_taught_judge_is_read_by_the_default_parser():
    """The judge model is taught to answer the first episode's judge prompt with 'Score: 0.75'."""
    first = await rollout(judged(ml.Agent("tiny-random"), parse=lambda t: 0.0), prompts=("hi",))
    task, reply = first[0].prompt, first[0].values["rollout"]
    judge_model = ml.Agent("tiny-random")
    messages = absolute_messages("Is it a friendly reply?", task, reply)
    teach(judge_model, [(EpisodeState.start(judge_model.tokenizer, messages).ids, "Looks kind.\nScore: 0.75")])
    episodes = await rollout(judged(judge_model, max_new_tokens=32), prompts=("hi",))
    assert [ep.values["judge"] for ep in episodes] == [0.75, 0.75]  # greedy policy: both replies are the same


async def http_judge():
    """materl's endpoint serving a tiny model: an OpenAI-compatible judge URL with its key."""
    endpoint, judge_model = AgentEndpoint(), ml.Agent("tiny-random")
    await endpoint.start()
    session = AgentSession(judge_model.engine, judge_model.tokenizer,
                           lambda k: SamplingParams(max_new_tokens=10, seed=k))
    return endpoint, session, endpoint.open("judge", session)


async def test_an_http_judge_ranks_each_group_in_one_call():
    endpoint, session, key = await http_judge()
    calls = []

    def ranks(text, n):  # the user's reading: the i-th response gets i/n
        calls.append((text, n))
        return [(i + 1) / n for i in range(n)]

    try:
        episodes = await rollout(judged(endpoint.base_url, api_key=key, relative=True, parse=ranks),
                                 prompts=("hi", "yo", "hey"))
    finally:
        await endpoint.aclose()
    assert all(ep.error is None for ep in episodes)
    assert [n for _, n in calls] == [2, 2, 2] and session.trace.requests == 3  # one judge call per group
    for g in range(3):
        assert [ep.values["judge"] for ep in episodes if ep.group == g] == [0.5, 1.0]


async def test_an_http_judge_answering_gibberish_or_not_listening_fails_the_episodes():
    endpoint, _, key = await http_judge()
    try:
        episodes = await rollout(judged(endpoint.base_url, api_key=key, retries=0))
    finally:
        await endpoint.aclose()
    assert {(ep.error.node, ep.error.kind) for ep in episodes} == {("judge", "RewardError")}
    assert all("no 'Score: <number>' line" in ep.error.message for ep in episodes)
    # the same URL once its server is gone: the connection is refused, retried, then reported
    episodes = await rollout(judged(endpoint.base_url, api_key=key, retries=1, timeout_s=5, relative=True))
    assert {(ep.error.node, ep.error.kind) for ep in episodes} == {("judge", "RewardError")}
    assert all("ConnectError" in ep.error.message and "2 attempt(s)" in ep.error.message for ep in episodes)


def test_bad_judge_settings_are_refused():
    with pytest.raises(ConfigError, match="must start with http"):
        judged("localhost:8000")
    with pytest.raises(ConfigError, match="max_concurrency must be an int >= 1"):
        judged("http://127.0.0.1:1/v1", max_concurrency=0)
    with pytest.raises(RecipeError, match="needs a rubric"):
        @ml.recipe
        def no_rubric(policy, prompts):
            ml.judge("", model="http://127.0.0.1:1/v1", rollout=ml.generate(policy, prompts))


async def test_an_in_process_judge_at_temperature_answers_each_episode_the_same_in_any_order():
    """A sampling judge's seed is its question's (and the attempt's), not a call counter: the
    same episodes judged in the opposite order, or again by a new judge, get the same answers;
    different questions get different samples."""
    from materl.rollout.judge import Judge
    from materl.rollout.types import Rollout, Step

    model = ml.Agent("tiny-random")
    rollouts = [Rollout([1, 2], [Step("generate", [3, 4], [0.0, 0.0], text=t)], prompt_text=p)
                for p, t in (("hi", "hello there"), ("yo", "what's up"), ("hey", "hi!"))]

    async def answers(order):
        judge = Judge(model, "Is it friendly?", parse=lambda text: 0.5, temperature=1.0, max_new_tokens=8)
        return {i: (await judge.verdict("task", rollouts[i])).answer for i in order}

    forward, backward, again = await answers([0, 1, 2]), await answers([2, 1, 0]), await answers([1, 0, 2])
    assert forward == backward == again
    assert len(set(forward.values())) == 3  # a seed per question, not one for all


@pytest.mark.parametrize("cap", [64, 1])
async def test_a_group_judge_that_never_answers_times_its_episodes_out(cap):
    """A relative judge runs once its group is done, outside the episodes' scopes: a judge server
    that accepts the connection and never answers (its own timeout far away) is stopped
    ``episode_timeout_s`` after that, and the episodes are recorded as timed out at the judge."""
    async def silent(stream):
        async with stream:
            await anyio.sleep(3600)

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, silent)
        with anyio.fail_after(60):  # before the fix: the stage waited for the judge for ever
            policy = ml.Agent("tiny-random")
            assert policy.engine is not None  # started: the deadline times the judge, not the model's load
            episodes = await rollout(judged(f"http://127.0.0.1:{port}/v1", api_key="k", relative=True,
                                            timeout_s=3600, retries=0),
                                     policy=policy, episode_timeout_s=2.0, max_concurrent_episodes=cap)
        tg.cancel_scope.cancel()
    assert {(ep.error.node, ep.error.kind) for ep in episodes} == {("judge", "StepTimeoutError")}
