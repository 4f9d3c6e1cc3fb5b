"""Multi-turn episodes: exact token ids across turns, loss masks, step-reward placement,
turn-level discounting, environments."""

import anyio
import pytest

import materl as ml
from materl.compiler.kinds.rewards import turn_discounted
from materl.engines.base import SamplingParams
from materl.rollout.multiturn import EpisodeState, TurnResult, append_tool_results, generate_step
from materl.rollout.types import Rollout, Step, ToolCall, ToolResult


@pytest.fixture(scope="module")
def agent():
    return ml.Agent("tiny-random")


class Recording:
    """The real engine, with every prompt it was asked to continue recorded."""

    def __init__(self, engine):
        self.engine, self.prompts = engine, []

    async def generate(self, prompt_ids, params):
        self.prompts.append(list(prompt_ids))
        return await self.engine.generate(prompt_ids, params)


def test_turn_k_plus_1_continues_turn_k_exact_ids(agent):
    tok = agent.tokenizer
    engine = Recording(agent.engine)
    params = SamplingParams(max_new_tokens=6, seed=1)

    async def episode():
        state = EpisodeState.start(tok, "compute 2+2", tools=[])
        first = await generate_step(engine, tok, state, None, params)
        # the tiny model never calls a tool: give its turn one (the ids it sampled stay as they are)
        first.history.steps[-1].tool_calls = [ToolCall("calculate", {"expression": "2+2"})]
        first.history.done = False
        second = await generate_step(engine, tok, first.history, ["4"], params)
        return first, second

    first, second = anyio.run(episode)
    turn1_prompt, turn2_prompt = engine.prompts
    tool_step = second.history.steps[1]
    assert tool_step.kind == "tool" and tool_step.tool_results[0].content == "4"
    # turn 2's context = turn 1's context + turn 1's sampled ids + the tool glue, never re-tokenized
    assert turn2_prompt == turn1_prompt + first.token_ids + tool_step.token_ids
    rollout = second.rollout
    assert rollout.prompt_ids + rollout.completion_ids == turn2_prompt + second.token_ids
    assert "4" in tok.decode(tool_step.token_ids) and "tool" in tok.decode(tool_step.token_ids)
    # loss mask: generate tokens 1, tool glue 0
    assert rollout.loss_mask == [1] * len(first.token_ids) + [0] * len(tool_step.token_ids) + [1] * len(second.token_ids)
    assert rollout.sampling_logprobs[len(first.token_ids):len(first.token_ids) + len(tool_step.token_ids)] == \
        [0.0] * len(tool_step.token_ids)


def test_a_malformed_call_becomes_an_error_result_not_an_exception(agent):
    tok = agent.tokenizer
    params = SamplingParams(max_new_tokens=4, seed=2)

    async def episode():
        state = EpisodeState.start(tok, "hi")
        step = await generate_step(agent.engine, tok, state, None, params)
        step.history.steps[-1].tool_calls = [ToolCall("", {}, raw="<tool_call>{oops", error="invalid JSON")]
        step.history.done = False
        return await generate_step(agent.engine, tok, step.history, [], params)

    result = anyio.run(episode)
    tool_step = result.history.steps[1]
    assert tool_step.tool_results[0].is_error and "invalid JSON" in tool_step.tool_results[0].content
    assert tool_step.error is not None


def test_finished_episode_skips_later_steps(agent):
    async def episode():
        state = EpisodeState.start(agent.tokenizer, "hi")
        step = await generate_step(agent.engine, agent.tokenizer, state, None, SamplingParams(max_new_tokens=3))
        return step, await generate_step(agent.engine, agent.tokenizer, step.history, [], SamplingParams())

    first, second = anyio.run(episode)
    assert first.done and second.step is None and second.history.steps == first.history.steps


def _rollout(gen_lengths, tool_lengths):
    steps = []
    for i, n in enumerate(gen_lengths):
        steps.append(Step("generate", list(range(n)), [0.0] * n))
        if i < len(tool_lengths):
            steps.append(Step("tool", [7] * tool_lengths[i], [], tool_results=[ToolResult("t", "x")]))
    return Rollout([1, 2], steps)


def test_step_rewards_land_on_the_last_token_of_their_step():
    r = _rollout([3, 2], [2])
    r.steps[0].reward, r.steps[2].reward = 0.5, 1.0
    # tokens: gen0 = 0..2, tool = 3..4, gen1 = 5..6
    assert r.step_rewards() == [0, 0, 0.5, 0, 0, 0, 1.0]


def test_turn_discount_gives_each_turn_its_discounted_return():
    r = _rollout([2, 2, 2], [1, 1])
    # rewards 1 at the end of turn 0 and 2 at the end of turn 2; gamma 0.5:
    # R_2 = 2, R_1 = 0 + 0.5 * 2 = 1, R_0 = 1 + 0.5 * 1 = 1.5 -> placed R_j - R_{j+1}: 0.5, -1, 2
    tokens = [0, 1.0, 0, 0, 0, 0, 0, 2.0]  # gen0 0-1, tool 2, gen1 3-4, tool 5, gen2 6-7
    out = turn_discounted(tokens, r, 0.5)
    assert out == [0, 0.5, 0, 0, -1.0, 0, 0, 2.0]
    returns = [sum(out[t:]) for t in range(len(out))]
    assert returns[0] == 1.5 and returns[3] == 1.0 and returns[6] == 2.0


def test_step_reward_and_turn_gamma_through_a_recipe(agent):
    def first_turn_bonus(*, completions, **_):
        return [1.0 for _ in completions]

    @ml.recipe
    def r(policy, prompts):
        s1 = ml.generate_step(policy, prompts, name="s1")
        rollout = ml.structure_rollout(s1, turn_gamma=0.9)
        rewards = ml.reward(first_turn_bonus, step=s1, rollout=rollout) + ml.reward("length", rollout=rollout, target=2)
        ml.set_loss(ml.ppo_loss(ml.advantages(rewards, completions=rollout), ml.logprobs(policy, prompts, rollout)))

    step = ml.compile(r, policy=ml.Agent("tiny-random", trainable=True), group_size=2, max_new_tokens=4)
    episodes = step.call_blocking(step.rollout, ["x"])
    for ep in episodes:
        tokens, ro = ep.values["rewards"], step.episode_rollout(ep)
        assert len(tokens) == len(ro.completion_ids) and tokens[-1] == pytest.approx(sum(tokens))
        assert sum(tokens) == pytest.approx(1.0 + ep.metrics["reward/length"])
    step.close()


def test_environments_drive_multi_turn_episodes():
    from materl.rollout.env import ConversationEnv, SimpleTextEnv
    from materl.runtime.tasks import ToolBudgetVerifyEnv

    def score(text, **_):
        return float(len(text) > 0)

    @ml.recipe
    def r(policy, prompts):
        convo = ml.env_rollout(policy, lambda: ConversationEnv(["and then?", "thanks"]), prompts, max_turns=4)
        rewards = ml.reward("step_rewards", rollout=convo) + ml.reward("length", rollout=convo, target=3)
        ml.set_loss(ml.ppo_loss(ml.advantages(rewards, completions=convo), ml.logprobs(policy, prompts, convo)))

    step = ml.compile(r, policy=ml.Agent("tiny-random", trainable=True), group_size=2, max_new_tokens=3)
    metrics = step.run(prompts=["hello"])
    assert metrics["failed_episodes"] == 0
    ro = step.episode_rollout(step.last_episodes[0])
    assert [s.kind for s in ro.steps] == ["generate", "tool", "generate", "tool", "generate"]
    assert ro.num_turns == 3 and sum(ro.loss_mask) == sum(len(s.token_ids) for s in ro.generate_steps)

    async def solo(env, prompt, **cols):
        from materl.rollout.env import run_env_episode

        agent = step.agents["policy"]
        return await run_env_episode(agent.engine, agent.tokenizer, env, prompt, cols, SamplingParams(max_new_tokens=3),
                                     max_turns=3)

    simple = anyio.run(solo, SimpleTextEnv(score), "hi")
    assert simple.num_turns == 1 and simple.steps[0].reward in (0.0, 1.0)
    env = ToolBudgetVerifyEnv(budget=2, cost=1)
    verify = anyio.run(lambda: solo(env, "What is 6*7?", answer="42"))
    assert env.is_done() and verify.steps[-1].reward is not None  # a random model gives up: reward 0
    step.close()


def test_tool_budget_env_rewards_verification_then_answer():
    from materl.runtime.tasks import ToolBudgetVerifyEnv

    async def play():
        env = ToolBudgetVerifyEnv(budget=2, cost=1)
        await env.reset("What is 6*7?", answer="42")
        a = await env.step("VERIFY: 6*7")
        b = await env.step("ANSWER: 42")
        return a, b

    a, b = anyio.run(play)
    assert a.observation == "VERIFY result: 42" and not a.done
    assert b.done and b.reward == pytest.approx(1.0 - 0.1)  # correct, minus 0.1 per unit of budget spent
