"""Sequence packing: micro-batches by a token budget, and packed forwards that equal the padded
ones (log-probs, entropy, KL, every loss aggregation, reference and value forwards, gradients).

Both layouts give each row's tokens the same positions, keys and values; in float64 they agree
to summation order (the checks allow 1e-6 relative to each tensor's scale, the issue's bar).
"""

import dataclasses

import pytest
import torch

import materl as ml
from materl.compiler.compiled import Compiled
from materl.compiler.context import StageEnv
from materl.compiler.learner import Learner
from materl.compiler.options import CompileOptions
from materl.compiler.packing import MicroBatching, block_causal_mask, pack, unpack
from materl.compiler.sequences import build_seq_batch, completion_hidden
from materl.errors import ConfigError
from materl.ops.aggregate import LOSS_AGG
from materl.rollout.types import Rollout, Step
from tests.compiler.test_agent_segments import KeepGradients


def _rows(agent, pairs):
    rollouts = [Rollout(prompt_ids=p, steps=[Step("generate", c, [0.0] * len(c))]) for p, c in pairs]
    return build_seq_batch(agent.tokenizer, [None] * len(rollouts), rollouts)


# -- micro-batches by tokens ----------------------------------------------------------------------


def test_split_fills_each_micro_batch_up_to_the_budget_in_order_and_a_long_row_goes_alone():
    lengths = torch.tensor([5, 3, 4, 12, 2, 2])
    mb = MicroBatching(tokens=8, lengths=lengths)
    # 5+3 = 8 fits; 4 then 12 > 8 starts anew and is alone (never split); 2+2 = 4
    assert [m.tolist() for m in mb.split(torch.arange(6))] == [[0, 1], [2], [3], [4, 5]]
    # a row limit on top of the budget
    one_row = MicroBatching(rows=1, tokens=8, lengths=lengths)
    assert [m.tolist() for m in one_row.split(torch.tensor([4, 5]))] == [[4], [5]]
    # without a budget: rows only, as micro_batch_size always cut them
    assert [m.tolist() for m in MicroBatching(rows=4).split(torch.arange(6))] == [[0, 1, 2, 3], [4, 5]]


def test_group_aware_split_keeps_each_group_whole():
    lengths = torch.tensor([3, 3, 2, 2, 4, 4])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    mb = MicroBatching(tokens=10, lengths=lengths, groups=groups)
    # group 0 costs 6, group 1 costs 4 (6+4 = 10 fits), group 2 costs 8
    assert [m.tolist() for m in mb.split(torch.arange(6))] == [[0, 1, 2, 3], [4, 5]]
    # a shuffled mini-batch: groups in order of their first row, each one's rows together
    assert [m.tolist() for m in mb.split(torch.tensor([4, 0, 5, 1]))] == [[4, 5], [0, 1]]


def test_ranks_get_balanced_tokens_in_the_mini_batch_order():
    lengths = torch.tensor([10, 1, 1, 1, 1, 6])
    mb = MicroBatching(tokens=100, lengths=lengths)
    # longest first to the lighter rank: 10 -> r0, 6 -> r1, then each 1 to r1 while it is lighter
    # (7, 8, 9, 10): r0 = {0} = 10 tokens, r1 = {1, 2, 3, 4, 5} = 10, each in the batch's order
    shards = mb.shard(torch.arange(6), 2)
    assert [s.tolist() for s in shards] == [[0], [1, 2, 3, 4, 5]]
    assert [int(lengths[s].sum()) for s in shards] == [10, 10]  # contiguous shares would be 12 and 8
    shuffled = mb.shard(torch.tensor([5, 3, 0, 1, 4, 2]), 2)  # each shard keeps the mini-batch's order
    assert [s.tolist() for s in shuffled] == [[0], [5, 3, 1, 4, 2]]
    assert [s.tolist() for s in MicroBatching(rows=2).shard(torch.arange(5), 2)] == [[0, 1, 2], [3, 4]]


def test_rank_partition_pads_to_the_largest_ranks_packed_step_count():
    from materl.distributed.learner import RankPartition

    lengths = torch.tensor([8, 8, 1, 1])
    mb = MicroBatching(tokens=8, lengths=lengths)
    # 0 -> r0, 1 -> r1, 2 -> r0 (a tie: rank 0), 3 -> r1; each rank 9 tokens, two micro-batches (8, 1)
    parts = [RankPartition(None, "ddp", r, 2).micro_batches(torch.arange(4), mb) for r in (0, 1)]
    assert [(m.tolist(), w) for m, w in parts[0]] == [([0], 1.0), ([2], 1.0)]
    assert [(m.tolist(), w) for m, w in parts[1]] == [([1], 1.0), ([3], 1.0)]
    one = RankPartition(None, "ddp", 1, 2).micro_batches(torch.tensor([0]), mb)  # nothing for rank 1
    assert [(m.tolist(), w) for m, w in one] == [([0], 0.0)]


# -- the packed layout --------------------------------------------------------------------------


def test_pack_lays_rows_end_to_end_with_positions_restarting_and_no_padding():
    agent = ml.Agent("tiny-random")
    sb = _rows(agent, [([5, 6, 7], [8, 9]), ([10], [11, 12, 13])])  # lengths 5 and 4
    p = pack(sb)
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert p.segment_ids.tolist() == [[0, 0, 0, 0, 0, 1, 1, 1, 1]]
    # completion token t of row i is predicted at offset_i + len(prompt_i) - 1 + t
    assert p.hidden_idx.tolist() == [2, 3, 5, 6, 7] and p.targets.tolist() == [8, 9, 11, 12, 13]
    assert unpack(torch.tensor([1.0, 2, 3, 4, 5]), p).tolist() == [[1, 2, 0], [3, 4, 5]]
    s = pack(sb, static=True)  # buckets: N 9 (+1 filler) -> 16, M 5 -> 16; the filler is its own row
    assert s.input_ids.shape == (1, 16) and s.hidden_idx.shape == (16,) and s.tokens == 5
    assert s.segment_ids[0, 9:].tolist() == [2] * 7 and s.position_ids[0, 9:].tolist() == list(range(7))
    mask = block_causal_mask(p.segment_ids)[0, 0]
    assert mask[6, 5] and not mask[5, 4] and not mask[5, 6]  # row 1 sees itself only, causally


@pytest.mark.parametrize("lora", [False, True])
def test_packed_hidden_states_and_gradients_equal_the_padded_rows(lora):
    torch.manual_seed(0)
    agent = ml.Agent("tiny-random", trainable=True, dtype=torch.float64, **({"lora": dict(r=4)} if lora else {}))
    sb = _rows(agent, [([5, 6, 7, 8, 9], [30, 31, 32]), ([12, 13], [33]), ([5, 6, 7, 8, 9], [34, 35, 36, 37])])
    weights = torch.linspace(-1, 1, 3 * 4 * agent.model.config.hidden_size, dtype=torch.float64).reshape(3, 4, -1)

    def grads(fn):
        agent.model.zero_grad(set_to_none=True)
        out = fn()
        (out * weights).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in agent.named_parameters() if p.grad is not None}

    def packed(mask_rows: bool):
        p = pack(sb)
        ids_mask = None if mask_rows else torch.ones_like(p.input_ids)  # ones: attention crosses rows
        h = agent.hidden_states(p.input_ids, ids_mask, position_ids=p.position_ids)[0, p.hidden_idx]
        out = h.new_zeros(*p.valid.shape, h.shape[-1])
        out[p.valid] = h
        return out

    padded, g_padded = grads(lambda: completion_hidden(agent, sb, share_prompts=False) * sb.mask[..., None])
    got, g_got = grads(lambda: packed(True))
    assert g_padded and sorted(g_got) == sorted(g_padded)
    torch.testing.assert_close(got, padded, rtol=0, atol=1e-6 * float(padded.abs().max()))
    for n in g_padded:
        torch.testing.assert_close(g_got[n], g_padded[n], rtol=0, atol=1e-6 * float(g_padded[n].abs().max()), msg=n)
    leaky = packed(False).detach()  # rows 2 and 3 would read earlier rows' keys: visibly different
    assert float((leaky - padded)[1:].abs().max()) > 1e-3 * float(padded.abs().max())


# -- whole learner steps: padded vs packed ------------------------------------------------------


PROMPTS = ["Count to three.", "Name a colour.", "Say hi.", "Spell cat."]


def _agents(lora: bool, critic: bool) -> dict:
    torch.manual_seed(1234)
    policy = ml.Agent("tiny-random", trainable=True, dtype=torch.float64, lora=dict(r=4) if lora else None)
    for name, p in policy.model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: give A a gradient too
            p.data.copy_(torch.randn_like(p) * 0.05)
    agents = {"policy": policy, "ref_policy": ml.Agent("tiny-random", dtype=torch.float64)}
    if critic:
        agents["value_model"] = ml.Agent("tiny-random", head="value", trainable=True, dtype=torch.float64)
    return agents


def _episodes(recipe, agents, options):
    compiled = Compiled(recipe, agents, CompileOptions(**options))
    try:
        episodes = compiled.call_blocking(compiled.rollout, PROMPTS)
    finally:
        compiled.close()
    lengths = [len(e.values["completions"].completion_ids) for e in episodes]
    assert len(set(lengths)) > 2, lengths  # uneven rows: padding would matter
    return compiled, episodes


def _learn(compiled, episodes, options, *, cut_by_tokens: int | None = None) -> tuple[dict, list[dict]]:
    """One update over ``episodes`` under ``options``: its metrics and the gradient of every
    mini-batch (kept, not stepped). ``cut_by_tokens``: the padded layout, in the micro-batches a
    budget of that many tokens cuts (per-micro-batch metrics such as the entropy are averages
    over micro-batches, so the two layouts are compared on the same ones)."""
    models = {n: a.model for n, a in compiled.agents.items() if a.trainable}
    keep = _KeepAll(models)
    ctx = dataclasses.replace(compiled.context(), options=CompileOptions(**options))
    learner = Learner(StageEnv(ctx, compiled.agents), episodes, keep)
    if cut_by_tokens is not None:
        assert options.get("max_tokens_per_micro_batch") is None

        def by_tokens():
            lengths = sum(sb.lengths for _, sb in learner.batch.sequence_items())
            return MicroBatching(rows=options.get("micro_batch_size"), tokens=cut_by_tokens, lengths=lengths)
        learner.micro_batching = by_tokens
    compiled.call_blocking(learner.prepare)
    return learner.run_updates(), keep.grads


class _KeepAll(KeepGradients):
    def __init__(self, models):
        self.models, self.grads = models, []

    def step(self) -> float:
        self.grads.append({f"{m}.{n}": p.grad.detach().clone() for m, model in self.models.items()
                           for n, p in model.named_parameters() if p.grad is not None})
        for model in self.models.values():
            model.zero_grad(set_to_none=True)
        return 0.0


def _same(padded, packed):
    metrics_a, grads_a = padded
    metrics_b, grads_b = packed
    assert sorted(metrics_a) == sorted(metrics_b)
    for k in metrics_a:
        if k.startswith("time/") or k == "stage/learner":
            continue
        assert metrics_b[k] == pytest.approx(metrics_a[k], rel=1e-6, abs=1e-9), k
    assert len(grads_a) == len(grads_b) > 0
    for ga, gb in zip(grads_a, grads_b):
        assert sorted(ga) == sorted(gb) and ga
        for n in ga:
            torch.testing.assert_close(gb[n], ga[n], rtol=0, atol=1e-6 * max(1e-12, float(ga[n].abs().max())), msg=n)


BASE = dict(group_size=2, max_new_tokens=12, seed=0, lr=1e-2)


@pytest.mark.parametrize("agg", LOSS_AGG.names())
def test_every_loss_aggregation_packed_equals_padded(agg):
    agents = _agents(lora=False, critic=False)
    recipe = _pg_with(agg)
    compiled, episodes = _episodes(recipe, agents, BASE)
    padded = _learn(compiled, episodes, {**BASE, "mini_batch_size": 4}, cut_by_tokens=48)
    packed = _learn(compiled, episodes, {**BASE, "mini_batch_size": 4, "max_tokens_per_micro_batch": 48})
    assert "kl" in {k.split("/")[-1] for k in padded[0]} and "entropy" in padded[0]
    _same(padded, packed)


def _pg_with(agg: str):
    @ml.recipe
    def pg(policy, ref_policy, prompts):
        completions = ml.generate(policy, prompts, stop=["0"], name="completions")
        logp = ml.logprobs(policy, prompts, completions, name="policy_logprobs")
        ref = ml.logprobs(ref_policy, prompts, completions, name="ref_logprobs")
        adv = ml.advantages(ml.reward("length"), name="advantages")
        ml.set_loss(ml.policy_loss(adv, logp, ref, agg=agg, kl="k3", kl_coef=0.1))
    return pg


@pytest.mark.parametrize("lora", [False, True])
def test_value_model_reference_and_lora_packed_equal_padded(lora):
    @ml.recipe
    def ppo(policy, ref_policy, value_model, prompts):
        completions = ml.generate(policy, prompts, stop=["0"], name="completions")
        logp = ml.logprobs(policy, prompts, completions, name="policy_logprobs")
        ref = ml.logprobs(ref_policy, prompts, completions, name="ref_logprobs")
        values = ml.values(value_model, prompts, completions, name="values")
        rewards = ml.reward("length", name="rewards")
        adv = ml.gae_advantages(rewards, values, name="advantages")
        ml.set_loss(ml.policy_loss(adv, logp, ref, kl="k3", kl_coef=0.1))
        ml.add_loss(ml.value_loss(values, adv.returns))

    agents = _agents(lora=lora, critic=True)
    compiled, episodes = _episodes(ppo, agents, BASE)
    padded = _learn(compiled, episodes, {**BASE, "epochs": 2}, cut_by_tokens=40)
    packed = _learn(compiled, episodes, {**BASE, "epochs": 2, "max_tokens_per_micro_batch": 40})
    assert any(k.startswith("value_loss") or "loss/" in k for k in padded[0])
    _same(padded, packed)


def test_packed_on_static_buckets_and_with_gradient_checkpointing_equal_padded():
    """``cuda_graphs=True`` buckets packed lengths (run uncaptured on the CPU, the same function
    a CUDA graph captures: the mask built from segment ids); gradient checkpointing recomputes
    each layer in the backward: both give the padded numbers."""
    agents = _agents(lora=False, critic=False)
    compiled, episodes = _episodes(_pg_with("token_mean"), agents, BASE)
    padded = _learn(compiled, episodes, BASE, cut_by_tokens=48)
    static = _learn(compiled, episodes, {**BASE, "max_tokens_per_micro_batch": 48, "cuda_graphs": True})
    _same(padded, static)
    agents["policy"].set_gradient_checkpointing(True)
    try:
        assert agents["policy"].gradient_checkpointing
        checkpointed = _learn(compiled, episodes, {**BASE, "max_tokens_per_micro_batch": 48})
        # padded and checkpointed: rows sharing a prompt then run it each (HF's checkpointed
        # layers drop the prompt's KV cache; sharing it would train on rows that never saw it)
        padded_checkpointed = _learn(compiled, episodes, BASE, cut_by_tokens=48)
    finally:
        agents["policy"].set_gradient_checkpointing(False)
    assert not agents["policy"].gradient_checkpointing
    _same(padded, checkpointed)
    _same(padded, padded_checkpointed)


def test_gradient_checkpointing_with_cuda_graphs_is_refused():
    with pytest.raises(ConfigError, match="gradient_checkpointing=True with cuda_graphs=True"):
        CompileOptions.from_kwargs(gradient_checkpointing=True, cuda_graphs=True)
