"""Packed decode weights: same logits as the plain model, rebuilt exactly when weights change."""

import asyncio

import pytest
import torch
from torch import nn

import materl as ml
from materl.engines.base import ENGINES, SamplingParams
from materl.engines.decode_weights import DecodeWeights, packing_available
from materl.engines.models import load_model
from materl.engines.transformers_engine import TransformersEngine

pytestmark = pytest.mark.skipif(not packing_available(), reason="torch built without oneDNN packing")
IDS = torch.tensor([[104, 105, 106, 107, 108], [110, 111, 112, 113, 114]])


def _randomise_lora(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)


@pytest.mark.parametrize("lora", [False, True])
def test_packed_logits_match_and_forward_is_restored(lora):
    torch.manual_seed(0)
    model, _ = load_model("tiny-random", **({"lora": dict(r=4, alpha=8)} if lora else {}))
    if lora:
        _randomise_lora(model)
    lm = model.get_base_model() if lora else model
    weights = DecodeWeights()
    with torch.no_grad():
        plain = model(IDS).logits
        with weights.installed(lm):
            patched = [m for m in lm.modules() if "forward" in m.__dict__]
            packed = model(IDS).logits
        after = model(IDS).logits
    # 2 layers x 7 projections + lm_head; LoRA layers are patched whole, not their inner Linears
    assert len(patched) == 15 and weights.packs == 15
    torch.testing.assert_close(packed, plain, atol=1e-4, rtol=1e-4)
    assert not any("forward" in m.__dict__ for m in lm.modules())
    assert torch.equal(after, plain)


def test_copies_are_reused_until_a_weight_changes():
    torch.manual_seed(0)
    model, _ = load_model("tiny-random")
    weights = DecodeWeights()
    with torch.no_grad():
        with weights.installed(model):
            model(IDS)
        with weights.installed(model):  # nothing changed: nothing repacked
            model(IDS)
        assert weights.packs == 15
        model.model.layers[0].mlp.down_proj.weight.add_(0.5)  # an in-place update, like an optimizer step
        with weights.installed(model):
            changed = model(IDS).logits
        assert weights.packs == 16  # only that matrix
        torch.testing.assert_close(changed, model(IDS).logits, atol=1e-4, rtol=1e-4)
        weights.clear()
        with weights.installed(model):
            model(IDS)
        assert weights.packs == 31


def test_clear_keeps_copies_of_frozen_weights():
    """A LoRA policy: the base MLPs and LM head are frozen (kept), the LoRA layers train (dropped)."""
    from peft.tuners.lora import LoraLayer

    torch.manual_seed(0)
    model, _ = load_model("tiny-random", lora=dict(r=4, alpha=8))
    lm = model.get_base_model()
    n_lora = sum(isinstance(m, LoraLayer) for m in lm.modules())
    assert 0 < n_lora < 15
    weights = DecodeWeights()
    with torch.no_grad():
        with weights.installed(lm):
            model(IDS)
        weights.clear()
        with weights.installed(lm):
            model(IDS)
        assert weights.packs == 15 + n_lora  # only the LoRA layers were packed again
        weights.clear(frozen=True)
        with weights.installed(lm):
            model(IDS)
        assert weights.packs == 15 + n_lora + 15


def test_disabled_or_unpackable_falls_back_to_the_plain_model():
    model, _ = load_model("tiny-random")
    weights = DecodeWeights(enabled=False)
    with torch.no_grad(), weights.installed(model):
        assert not any("forward" in m.__dict__ for m in model.modules())
    assert weights.packs == 0
    half, _ = load_model("tiny-random", dtype=torch.float16)  # oneDNN packing here is fp32/bf16 only
    weights = DecodeWeights()
    with torch.no_grad(), weights.installed(half):
        assert not any("forward" in m.__dict__ for m in half.modules())


async def test_engine_greedy_tokens_match_with_and_without_packing():
    model, tok = load_model("tiny-random")
    params = SamplingParams(max_new_tokens=12, greedy=True)
    prompts = [[104, 105, 106], [110, 111, 112, 113], [104, 105, 106]]
    runs = []
    for pack in (True, False):
        engine = TransformersEngine(model, tok, pack_weights=pack)
        gens = await asyncio.gather(*[engine.generate(p, params) for p in prompts])
        runs.append([g.token_ids for g in gens])
        assert (engine.decode_weights.packs > 0) == pack
    assert runs[0] == runs[1]
    assert runs[0][0] == runs[0][2]  # identical prompts, prefilled once, decode alike


class CountingEngine(TransformersEngine):
    """The in-process engine, counting the stage hooks the compiled step calls."""

    calls: list[str] = []

    def sleep(self):
        CountingEngine.calls.append("sleep")
        super().sleep()

    def sync_weights(self):
        CountingEngine.calls.append("sync_weights")
        super().sync_weights()


def test_compiled_step_sleeps_engines_before_learning_and_syncs_after():
    from materl.recipes import grpo

    ENGINES.register("counting-test")(CountingEngine)
    try:
        CountingEngine.calls = []
        policy = ml.Agent("tiny-random", trainable=True, engine="counting-test")
        recipe = ml.replace(grpo, "policy_loss", lambda g: ml.grpo_loss(g.advantages, g.policy_logprobs))
        recipe = ml.replace(recipe, "rewards", lambda g: ml.reward(lambda completions, **kw: [len(c) / 10 for c in completions]))
        compiled = ml.compile(recipe, policy=policy, ref_policy=policy, group_size=2, max_new_tokens=4, lr=1e-3)
        before = [p.detach().clone() for p in policy.parameters()]
        compiled.run(["a", "b"])
        compiled.close()
        assert CountingEngine.calls == ["sleep", "sync_weights"]
        assert policy.engine.decode_weights.packs > 0 and not policy.engine.decode_weights._cache  # all trainable
        assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters()))
    finally:
        ENGINES._entries.pop("counting-test", None)
