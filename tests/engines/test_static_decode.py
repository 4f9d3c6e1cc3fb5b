"""The transformers engine's static-KV-cache decode path (``static_cache=True``; on CUDA its
steps are captured as CUDA graphs) against its dynamic loop, on the tiny model on a CPU, where
the same path runs without capture: the same token ids, log-probs equal to float32 rounding."""

import asyncio

import pytest
import torch

import materl as ml
from materl.engines.base import SamplingParams
from materl.engines.static_decode import bucket_length, bucket_rows
from materl.engines.transformers_engine import TransformersEngine


def _generate(engine, prompts, params):
    async def go():
        return await asyncio.gather(*(engine.generate(p, q) for p, q in zip(prompts, params)))
    return asyncio.run(go())


def test_buckets():
    assert [bucket_rows(n) for n in (1, 2, 3, 5, 8, 9, 64)] == [1, 2, 4, 8, 8, 16, 64]
    assert [bucket_length(n) for n in (1, 64, 65, 200)] == [64, 64, 128, 256]


@pytest.mark.parametrize("group", [False, True])
def test_static_decode_equals_the_dynamic_loop(group):
    agent = ml.Agent("tiny-random", engine="transformers", device="cpu")
    tok = agent.tokenizer
    texts = ["hello", "a longer prompt here", "x"] if not group else ["same prompt"] * 3
    prompts = [tok.encode(t) for t in texts]
    # uneven lengths (one row stops early at 3 tokens), sampling at T=1 and one greedy row
    params = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=1),
              SamplingParams(max_new_tokens=3, temperature=1.0, seed=2),
              SamplingParams(max_new_tokens=12, temperature=0.0, seed=3)]
    dynamic = _generate(TransformersEngine(agent.model, tok, static_cache=False), prompts, params)
    static_engine = TransformersEngine(agent.model, tok, static_cache=True)
    static = _generate(static_engine, prompts, params)
    assert static_engine.static is not None and len(static_engine.static.slots) == 1  # 3 rows -> a 4-row slot
    for d, s in zip(dynamic, static):
        assert s.token_ids == d.token_ids and s.finish_reason == d.finish_reason
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(d.logprobs), rtol=0, atol=2e-5)
    again = _generate(static_engine, prompts, params)  # the slot is reused: same results
    assert [g.token_ids for g in again] == [g.token_ids for g in static]


def test_static_cache_is_the_default_only_on_cuda():
    agent = ml.Agent("tiny-random", engine="transformers", device="cpu")
    assert TransformersEngine(agent.model, agent.tokenizer).static is None


@pytest.mark.gpu
def test_static_decode_on_cuda_captured_equals_dynamic_in_fp32():
    agent = ml.Agent("tiny-random", engine="transformers", device="cuda", compute_dtype="float32")
    tok = agent.tokenizer
    prompts = [tok.encode(t) for t in ["hello", "a longer prompt here", "x", "hello"]]
    params = [SamplingParams(max_new_tokens=16, temperature=1.0, seed=i) for i in range(4)]
    dynamic = _generate(TransformersEngine(agent.model, tok, static_cache=False, device_loop=False, dtype=torch.float32),
                        prompts, params)
    engine = TransformersEngine(agent.model, tok, dtype=torch.float32, device_loop=False)
    assert engine.static is not None and engine.static.capture
    for _ in range(2):  # the second call replays the captured graphs
        static = _generate(engine, prompts, params)
        for d, s in zip(dynamic, static):
            assert s.token_ids == d.token_ids
            torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(d.logprobs), rtol=0, atol=1e-4)


@pytest.mark.gpu
def test_bf16_decode_copy_follows_weight_changes_on_cuda():
    agent = ml.Agent("tiny-random", trainable=True, engine="transformers", device="cuda")
    engine = agent.engine
    prompts, params = [agent.tokenizer.encode("hello")], [SamplingParams(max_new_tokens=4, seed=0)]
    _generate(engine, prompts, params)
    copy = engine._lowp
    assert copy is not None and next(copy.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        agent.model.lm_head.weight.add_(1.0)
    agent.sync_engine()
    _generate(engine, prompts, params)
    assert engine._lowp is copy  # refreshed in place: captured graphs keep their addresses
    torch.testing.assert_close(copy.lm_head.weight, agent.model.lm_head.weight.to(torch.bfloat16))
