"""Agent episodes whose history was rewritten train every segment (issue #29 item 2): each
segment is a learner row of its own (its own prompt, sampled ids, log-probs and mask), carrying
its episode's advantages; groups and the estimator see the episode once."""

import copy
import itertools
import pickle

import pytest
import torch

import materl as ml
from materl.compiler.batch import RowMap
from materl.compiler.compiled import Compiled
from materl.compiler.context import StageEnv
from materl.compiler.turns import observation_anchor, turn_index
from materl.compiler.learner import Learner
from materl.compiler.options import CompileOptions
from materl.compiler.spec import Kind
from materl.errors import CompileError
from materl.rollout.types import SEGMENT_START, Rollout, Step, join_segments
from materl.runtime.logging import format_episode
from materl.runtime.train import train

EPS = 1e-6  # grpo's and process's eps, added to the std


def rewriting_agent():
    """Two requests per episode. Every other episode to start drops request 1's messages (its
    context "summarised" to one line): two segments. The others continue: one."""
    calls = itertools.count()

    async def agent(client, task):
        rewrite = next(calls) % 2 == 0
        messages = [{"role": "user", "content": task["prompt"]}]
        first = await client.chat.completions.create(model="policy", messages=messages)
        if rewrite:
            messages = [{"role": "user", "content": f"summary: {task['prompt']}"}]
        else:
            messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "on"}]
        out = await client.chat.completions.create(model="policy", messages=messages)
        return out.choices[0].message.content

    return agent


def num_segments(rollouts, **_):
    return [float(r.metadata["num_segments"]) for r in rollouts]


def sampled_logprob(rollouts, **_):
    return [sum(r.sampling_logprobs) for r in rollouts]  # continuous: two episodes never tie


def recipe_for(agent, *, step_rewards=None, ref: bool = False, kl_in_reward: float = 0.0, outcome=num_segments):
    @ml.recipe
    def segmented(policy, ref_policy, prompts):
        rollout = ml.agent_episodes(policy, prompts, agent=agent, request_reward=step_rewards, name="rollout")
        if step_rewards is None:
            rewards = ml.reward(outcome, rollout=rollout, name="outcome")
        else:
            rewards = ml.reward("step_rewards", rollout=rollout, name="steps")
        logp = ml.logprobs(policy, prompts, rollout, name="logp")
        ref_logp = ml.logprobs(ref_policy, prompts, rollout, name="ref") if ref or kl_in_reward else None
        adv = ml.advantages(rewards, ref_logp if kl_in_reward else None, logp if kl_in_reward else None,
                            estimator="grpo", kl_coef=kl_in_reward, completions=rollout, name="advantages")
        ml.set_loss(ml.policy_loss(adv, logp, ref_logp if ref else None, loss="reinforce", is_level="none",
                                   kl_coef=0.05 if ref else 0.0))
    return segmented


class KeepGradients:
    """An ``OptimizerStep`` (``materl.compiler.learner``) that keeps the policy's gradient and
    zeroes it instead of stepping, so a test can read what the update computed."""

    def __init__(self, model):
        self.model, self.grads = model, []

    def step(self) -> float:
        self.grads.append({n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None})
        self.model.zero_grad(set_to_none=True)
        return 0.0


async def learner_for(recipe, prompts, *, group_size: int = 2):
    """Rollouts of ``recipe``, then a Learner over them, prepared (no update yet)."""
    policy, ref = ml.Agent("tiny-random", trainable=True), ml.Agent("tiny-random")
    compiled = Compiled(recipe, {"policy": policy, "ref_policy": ref},
                        CompileOptions(group_size=group_size, max_new_tokens=6, lr=1e-3))
    try:
        episodes = await compiled.rollout(list(prompts))
    finally:
        await compiled.aclose()
    assert all(e.ok for e in episodes), [str(e.error) for e in episodes]
    keep = KeepGradients(policy.model)
    learner = Learner(StageEnv(compiled.context(), compiled.agents), episodes, keep)
    await learner.prepare()
    return learner, keep


def hand_gradient(model, rows, advantages) -> torch.Tensor:
    """The gradient of -(1/N) sum_rows sum_t m_t A logp_t (reinforce without an importance weight,
    token_mean over the N trained tokens of all rows), computed in float64 with the model's own
    forward over each whole row, flattened."""
    m = copy.deepcopy(model).double()
    total = sum(sum(r.loss_mask) for r in rows)
    loss = torch.zeros((), dtype=torch.float64)
    for r, a in zip(rows, advantages):
        ids = torch.tensor([r.prompt_ids + r.completion_ids])
        logp_all = torch.log_softmax(m(ids).logits[0], -1)
        p, comp = len(r.prompt_ids), torch.tensor(r.completion_ids)
        logp = logp_all[p - 1:p - 1 + len(comp)].gather(1, comp[:, None])[:, 0]
        loss = loss - (a * torch.tensor(r.loss_mask, dtype=torch.float64) * logp).sum() / total
    loss.backward()
    return torch.cat([q.grad.flatten() for q in m.parameters()])


def flat(grads: dict, model) -> torch.Tensor:
    return torch.cat([grads[n].double().flatten() for n, _ in model.named_parameters()])


def by_segments(learner):
    """(the segmented episode, the other) and the segmented one's position in the batch."""
    eps = {int(e.values["rollout"].metadata["num_segments"]): e for e in learner.episodes}
    return eps[2], eps[1]


def position(learner, episode) -> int:
    return next(i for i, e in enumerate(learner.episodes) if e is episode)


async def test_every_segment_is_a_learner_row_and_the_gradient_is_the_hand_built_batch_of_all_of_them():
    learner, keep = await learner_for(recipe_for(rewriting_agent()), ["add 2 and 3"])
    seg, cont = by_segments(learner)
    first, last = seg.values["rollout"].segments
    assert [s.kind for s in first.steps] == ["generate"] and [s.kind for s in last.steps] == ["generate"]
    # the rows: (episode, segment) in episode order, each with its own prompt and sampled ids
    assert len(learner.batch) == 3 and learner.batch_metrics["trained_sequences"] == 3.0
    sb = learner.seq_batch(learner.plan.nodes["logp"])
    rows = learner.batch.per_row([e.values["rollout"] for e in learner.episodes], Kind.ROLLOUT)
    assert [r.prompt_ids for r in rows].count(last.prompt_ids) == 1  # the summary prompt: its own row
    for i, r in enumerate(rows):
        n, p = len(r.completion_ids), len(r.prompt_ids)
        assert sb.input_ids[i, :p + n].tolist() == r.prompt_ids + r.completion_ids
        assert sb.mask[i, :n].tolist() == r.loss_mask and sb.mask[i, n:].sum() == 0
        assert sb.old_logprobs[i, :n].tolist() == pytest.approx(r.sampling_logprobs)
    # grpo over the group's two episodes (rewards 2 and 1, the segmented one counted ONCE):
    # mean 1.5, unbiased std sqrt(2 * 0.5^2 / 1) = 0.7071, A = +-0.5 / (0.7071 + eps) = +-0.7071.
    # (Were each segment a member, rewards 2, 2, 1 would give +0.577 and -1.155.)
    a = 0.5 / (2 ** -0.5 + EPS)
    adv = learner.batch.column("advantages", Kind.TOKENS)
    expected = [a if learner.batch.map.episode[i] == position(learner, seg) else -a for i in range(len(rows))]
    assert torch.allclose(adv, torch.tensor(expected)[:, None] * sb.mask, atol=1e-6)
    learner.run_updates()
    got = flat(keep.grads[0], learner.run.agents["policy"].model)
    model = learner.run.agents["policy"].model
    want = hand_gradient(model, rows, expected)
    assert (got - want).norm() / want.norm() < 1e-4
    # training the last segment alone (what materl did before segments were rows) is another gradient
    alone = hand_gradient(model, [last, cont.values["rollout"]], [a, -a])
    assert (got - alone).norm() / alone.norm() > 0.05


async def test_step_rewards_of_every_segment_are_credited_as_one_turn_sequence():
    def by_messages(*, messages, reply, task):
        return float(len(messages))  # request 1: 1 message; request 2: 1 (rewritten) or 3 (continued)

    learner, _ = await learner_for(recipe_for(rewriting_agent(), step_rewards=by_messages, ref=True), ["x"])
    seg, cont = by_segments(learner)
    r = seg.values["rollout"]
    sep = next(s for s in r.steps if s.metadata.get(SEGMENT_START))
    assert sep.kind == "tool" and sep.token_ids == r.segments[1].prompt_ids  # the rewritten context, untrained
    # process credit over the group's steps, in order: segmented [1, 1], continued [1, 3];
    # mean 1.5, unbiased std sqrt((3 * 0.25 + 2.25) / 3) = 1, so r~ = [-0.5, -0.5], [-0.5, 1.5] and a
    # token's advantage sums r~ from its step on: segmented -1.0 then -0.5, continued 1.0 then 1.5.
    # (Had the segments been one step, 2 vs [1, 3] would give the segmented episode 0.)
    s = 1 / (1 + EPS)
    sb = learner.seq_batch(learner.plan.nodes["logp"])
    adv = learner.batch.column("advantages", Kind.TOKENS)
    rows = [(learner.batch.map.episode[i], learner.batch.map.segment[i]) for i in range(len(learner.batch))]
    first = position(learner, seg)
    segments = learner.batch.per_row([x.values["rollout"] for x in learner.episodes], Kind.ROLLOUT)
    for i, ((e, k), row) in enumerate(zip(rows, segments)):
        n = len(row.completion_ids)
        if e == first:
            want = torch.full((n,), (-1.0, -0.5)[k] * s)
        else:
            steps = row.steps  # generate, tool, generate
            want = torch.tensor([1.0 * s] * len(steps[0].token_ids) + [0.0] * len(steps[1].token_ids)
                                + [1.5 * s] * len(steps[2].token_ids))
        assert torch.allclose(adv[i, :n], want * sb.mask[i, :n], atol=1e-6), (e, k)
    # the reference forward ran on the same rows: its log-probs are the frozen model's on each
    # row, stored on the episode in its own layout (0 on the untrained step between segments)
    ref_model = learner.run.agents["ref_policy"].model
    for i, row in enumerate(segments):
        ids = torch.tensor([row.prompt_ids + row.completion_ids])
        p, n = len(row.prompt_ids), len(row.completion_ids)
        with torch.no_grad():
            logp = torch.log_softmax(ref_model(ids).logits[0].double(), -1)[p - 1:p - 1 + n]
        want = logp.gather(1, torch.tensor(row.completion_ids)[:, None])[:, 0]
        got = learner.batch.stacked("ref", torch.tensor([i]))[0, :n]
        assert torch.allclose(got.double(), want, atol=1e-4)
    (_, end_first), (start_last, _) = r.segment_spans
    stored = seg.values["ref"]
    assert len(stored) == len(r.completion_ids) and end_first < start_last
    assert stored[end_first:start_last].abs().sum() == 0


async def _continuing(client, task):
    messages = [{"role": "user", "content": task["prompt"]}]
    first = await client.chat.completions.create(model="policy", messages=messages)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "on"}]
    await client.chat.completions.create(model="policy", messages=messages)


async def test_one_segment_episodes_are_one_row_each_and_pass_through_unchanged():
    learner, keep = await learner_for(recipe_for(_continuing, outcome=sampled_logprob), ["x"])
    batch = learner.batch
    assert not batch.map.segmented and len(batch) == len(learner.episodes) == 2
    assert learner.batch_metrics["trained_sequences"] == 2.0
    values = [e.resolve("advantages") for e in learner.episodes]
    assert batch.per_row(values, Kind.TOKENS) is values  # nothing is sliced or copied
    sb = learner.seq_batch(learner.plan.nodes["logp"])
    assert torch.equal(torch.stack([e.values["logp"] for e in learner.episodes]), sb.old_logprobs)
    # two distinct rewards: grpo gives +-0.5 |r1 - r2| / (|r1 - r2| / sqrt(2) + eps), about +-0.7071
    rewards = [float(e.values["rewards"]) for e in learner.episodes]
    gap = abs(rewards[0] - rewards[1])
    adv = [(0.5 * gap if r == max(rewards) else -0.5 * gap) / (gap / 2 ** 0.5 + EPS) for r in rewards]
    learner.run_updates()
    got = flat(keep.grads[0], learner.run.agents["policy"].model)
    want = hand_gradient(learner.run.agents["policy"].model, [e.values["rollout"] for e in learner.episodes], adv)
    assert (got - want).norm() / want.norm() < 1e-4  # one row per episode: its prompt and whole completion


def test_a_step_reports_segments_and_trained_sequences_and_learns_with_kl_in_the_reward():
    step = ml.compile(recipe_for(rewriting_agent(), kl_in_reward=0.1), policy=ml.Agent("tiny-random", trainable=True),
                      ref_policy=ml.Agent("tiny-random"), group_size=2, max_new_tokens=6, lr=1e-3)
    try:
        metrics = step.run(prompts=["a"])
    finally:
        step.close()
    # one of the two episodes rewrote its history: 2 and 1 segments, 3 rows trained
    assert metrics["failed_episodes"] == 0.0 and metrics["agent/segments/mean"] == 1.5
    assert metrics["trained_sequences"] == 3.0 and metrics["grad_norm"] > 0
    assert abs(metrics["mismatch/max_abs"]) < 1e-4  # every row scores the ids its segment sampled


async def test_segments_survive_pickling_as_episodes_travel_to_ray_workers():
    learner, _ = await learner_for(recipe_for(rewriting_agent()), ["x"])
    seg, _ = by_segments(learner)
    back = pickle.loads(pickle.dumps(seg))
    r, r2 = seg.values["rollout"], back.values["rollout"]
    assert [(s.prompt_ids, s.completion_ids, s.loss_mask) for s in r2.segments] == \
           [(s.prompt_ids, s.completion_ids, s.loss_mask) for s in r.segments]
    assert r2.segment_spans == r.segment_spans and r2.metadata["num_segments"] == 2


def test_join_segments_lays_the_episode_out_in_order_and_splits_back_into_its_segments():
    first = Rollout([1, 2], [Step("generate", [10, 11], [-0.1, -0.2], text="a"), Step("tool", [20]),
                             Step("generate", [12], [-0.3], text="b")])
    second = Rollout([3, 4, 5], [Step("generate", [13, 14], [-0.4, -0.5], text="c")])
    joined = join_segments([first, second], metadata={"num_segments": 2})
    # completion: 10 11 | 20 | 12 | 3 4 5 (segment 2's prompt, untrained) | 13 14
    assert joined.prompt_ids == [1, 2] and joined.completion_ids == [10, 11, 20, 12, 3, 4, 5, 13, 14]
    assert joined.loss_mask == [1, 1, 0, 1, 0, 0, 0, 1, 1] and joined.text == "c"
    assert joined.sampling_logprobs == [-0.1, -0.2, 0.0, -0.3, 0.0, 0.0, 0.0, -0.4, -0.5]
    assert joined.segment_spans == [(0, 4), (7, 9)]
    back = joined.segments
    assert [(r.prompt_ids, r.completion_ids, r.loss_mask) for r in back] == \
           [(first.prompt_ids, first.completion_ids, first.loss_mask), (second.prompt_ids, [13, 14], [1, 1])]
    assert join_segments([first]) is first and first.segments == [first] and first.segment_spans == [(0, 4)]
    assert "--- segment 2: history rewritten, new prompt · 3 tokens ---" in format_episode(joined)
    # turn-level estimators count the segments' turns in order; GiGPO's state for segment 2's first
    # turn is the prompt it started from: each completion token's turn
    assert turn_index(joined) == [0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert observation_anchor(joined, 2) == ("observation", 2, (3, 4, 5))
    # the learner's rows: segment rows of the joined episode, one of the plain one
    rows = RowMap.of([joined, first])
    assert (rows.episode, rows.segment, rows.span, rows.tokens) == ((0, 0, 1), (0, 1, 0), ((0, 4), (7, 9), (0, 4)),
                                                                    (9, 4))
    assert rows.row_value(torch.arange(9.0), 1, Kind.TOKENS).tolist() == [7.0, 8.0]
    assert rows.row_value(0.5, 1, Kind.SCORE) == 0.5  # an outcome reward: the episode's, on every row
    values = rows.episode_value(torch.tensor([[1.0, 2, 3, 4], [5, 6, 0, 0], [7, 8, 9, 9]]), 0)
    assert values.tolist() == [1, 2, 3, 4, 0, 0, 0, 5, 6]  # 0 on segment 2's prompt
    with pytest.raises(CompileError, match="split differently"):  # two forwards reading rollouts split otherwise
        RowMap.agreed({"rollout": rows, "other": RowMap.of([first, first])})


def test_segments_train_through_the_asynchronous_pipeline(tmp_path):
    step = ml.compile(recipe_for(rewriting_agent()), policy=ml.Agent("tiny-random", trainable=True),
                      ref_policy=ml.Agent("tiny-random"), group_size=2, max_new_tokens=6, lr=1e-3, max_staleness=1)
    try:
        out = train(step, [{"prompt": "a"}, {"prompt": "b"}], steps=2, batch_size=1, run_dir=tmp_path,
                    progress=False, tensorboard=False)
    finally:
        step.close()
    history = out["history"]
    # every learner row is an episode or an extra segment of one: episodes x mean segments
    assert [h["trained_sequences"] for h in history] == [h["episodes"] * h["agent/segments/mean"] for h in history]
    assert sum(h["agent/segments/mean"] for h in history) == 3.0  # 2 of the 4 episodes rewrote (every other one)
    assert all(h["async/dropped_stale"] == 0.0 for h in history)
