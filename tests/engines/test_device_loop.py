"""The device decode loop (``device_loop=True``) against the transformers engine's dynamic loop
on the tiny model on a CPU, where the same code runs without capture: the same token ids and
log-probs equal to float32 rounding, with and without continuous batching, with and without KV
reuse; prefilled vs reused prompt tokens across an episode's turns and a group's prompt."""

import asyncio

import pytest
import torch

import materl as ml
from materl.engines.arrivals import Request
from materl.engines.base import SamplingParams
from materl.engines.device_loop import DeviceLoop, LoopOptions
from materl.engines.sampling import counter_uniforms, seed_words
from materl.engines.transformers_engine import TransformersEngine
from materl.errors import ConfigError

M32 = 0xFFFFFFFF


def _mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & M32
    return x ^ (x >> 16)


def _uniform(seed: int, index: int) -> float:
    """counter_uniforms written with Python ints (no wrap-around to worry about)."""
    lo, hi = seed & M32, (seed >> 32) & M32
    key = _mix32(lo ^ _mix32((hi + 0x9E3779B9) & M32))
    return (_mix32(key ^ _mix32((index * 0x9E3779B1) & M32)) >> 8) / 2**24


def test_counter_uniforms_equal_the_python_hash_and_are_uniform():
    seeds = [0, 1, 7, 2**40 + 3, 2**62 - 1, -5]
    lo, hi = seed_words(seeds)
    for index in (0, 1, 999):
        got = counter_uniforms(lo, hi, torch.full((len(seeds),), index)).tolist()
        assert got == [_uniform(s, index) for s in seeds]
    # 20000 draws of one seed: mean 1/2 and variance 1/12 within 5 standard errors
    u = counter_uniforms(*seed_words([123] * 20000), torch.arange(20000)).double()
    assert 0 <= float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 5 * (1 / 12 / 20000) ** 0.5
    assert abs(float(u.var()) - 1 / 12) < 0.005


@pytest.fixture(scope="module")
def tiny():
    agent = ml.Agent("tiny-random", engine="transformers", device="cpu")
    return agent.model, agent.tokenizer


def _generate(engine, prompts, params):
    async def go():
        return await asyncio.gather(*(engine.generate(p, q) for p, q in zip(prompts, params)))
    return asyncio.run(go())


def _same(got, want, atol=2e-5):
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=atol)


def _requests(tok):
    prompts = [tok.encode(t) for t in ["hello", "a longer prompt here", "x", "same prompt", "same prompt"]]
    params = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=1),
              SamplingParams(max_new_tokens=3, temperature=0.7, seed=2),
              SamplingParams(max_new_tokens=12, temperature=0.0, seed=3),
              SamplingParams(max_new_tokens=10, temperature=1.0, top_k=5, seed=4),
              SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.8, seed=5)]
    return prompts, params


@pytest.mark.parametrize("options", [dict(), dict(continuous=False), dict(kv_reuse=False), dict(read_every=1),
                                     dict(read_every=5, prefill_tokens=1)])
def test_device_loop_equals_the_dynamic_loop(tiny, options):
    model, tok = tiny
    prompts, params = _requests(tok)
    want = _generate(TransformersEngine(model, tok), prompts, params)
    engine = TransformersEngine(model, tok, device_loop=True, **options)
    assert engine.loop is not None
    _same(_generate(engine, prompts, params), want)
    _same(_generate(engine, prompts, params), want)  # again, over the kept slots


def test_the_device_loop_is_off_by_default_on_a_cpu(tiny):
    assert TransformersEngine(*tiny).loop is None


def test_a_seeded_request_does_not_depend_on_its_batch(tiny):
    model, tok = tiny
    prompts, params = _requests(tok)
    engine = TransformersEngine(model, tok, device_loop=True)
    alone = _generate(engine, prompts[:1], params[:1])[0]
    together = _generate(engine, prompts, params)[0]
    assert together.token_ids == alone.token_ids


def test_stop_strings_and_stop_ids_end_rows_between_read_backs(tiny):
    model, tok = tiny
    prompt = tok.encode("hello")
    free = _generate(TransformersEngine(model, tok), [prompt], [SamplingParams(max_new_tokens=16, seed=9)])[0]
    text = tok.decode(free.token_ids[3:6], skip_special_tokens=False)
    params = [SamplingParams(max_new_tokens=16, seed=9, stop_strings=(text,)),
              SamplingParams(max_new_tokens=16, seed=9, stop_token_ids=(free.token_ids[4],))]
    want = _generate(TransformersEngine(model, tok), [prompt] * 2, params)
    got = _generate(TransformersEngine(model, tok, device_loop=True, read_every=8), [prompt] * 2, params)
    _same(got, want)
    assert got[0].finish_reason == "stop_string" and got[1].finish_reason == "stop"
    assert len(got[1].token_ids) == free.token_ids.index(free.token_ids[4]) + 1


def test_the_next_turn_prefills_only_its_new_tokens(tiny):
    model, tok = tiny
    engine = TransformersEngine(model, tok, device_loop=True)
    first_prompt = tok.encode("turn one")
    params = SamplingParams(max_new_tokens=6, seed=11)
    first = _generate(engine, [first_prompt], [params])[0]
    tool = tok.encode(" tool says 42")
    second_prompt = first_prompt + first.token_ids + tool
    second = _generate(engine, [second_prompt], [params])[0]
    # the first turn's cache holds its prompt and all its tokens but the last (never fed)
    assert second.metadata["reused"] == len(first_prompt) + len(first.token_ids) - 1
    assert second.metadata["prefilled"] == len(tool) + 1
    fresh = _generate(TransformersEngine(model, tok), [second_prompt], [params])[0]
    _same([second], [fresh])
    off = TransformersEngine(model, tok, device_loop=True, kv_reuse=False)
    _generate(off, [first_prompt], [params])
    assert _generate(off, [second_prompt], [params])[0].metadata["prefilled"] == len(second_prompt)


def test_a_request_never_copies_a_cache_still_being_prefilled(tiny):
    """Two next turns admitted together: the first takes over the parked cache and prefills the
    rest of its prompt; the second shares that whole prompt but must not copy its columns
    before they are computed (it prefills itself, and samples what the dynamic loop samples)."""
    model, tok = tiny
    engine = TransformersEngine(model, tok, device_loop=True)
    prompt = tok.encode("turn one")
    params = SamplingParams(max_new_tokens=5, seed=4)
    first = _generate(engine, [prompt], [params])[0]
    extended = prompt + first.token_ids + tok.encode(" result")
    longer = extended + tok.encode(" and more")
    got = _generate(engine, [extended, longer], [params, params])
    assert got[0].metadata["reused"] == len(prompt) + len(first.token_ids) - 1
    _same(got, _generate(TransformersEngine(model, tok), [extended, longer], [params, params]))


def test_a_group_prompt_is_prefilled_once(tiny):
    model, tok = tiny
    engine = TransformersEngine(model, tok, device_loop=True)
    prompt = tok.encode("one shared group prompt")
    params = [SamplingParams(max_new_tokens=5, seed=s) for s in range(4)]
    gens = _generate(engine, [prompt] * 4, params)
    assert [g.metadata["prefilled"] for g in gens] == [len(prompt), 1, 1, 1]
    assert engine.stats.prefilled_tokens == len(prompt) + 3
    assert engine.stats.reused_tokens == 3 * (len(prompt) - 1)
    _same(gens, _generate(TransformersEngine(model, tok), [prompt] * 4, params))


def _request(prompt, **params):
    return Request(prompt, SamplingParams(**params), params.get("seed", 0), token=None)


def test_a_newcomer_joins_the_running_batch_only_when_continuous(tiny):
    model, tok = tiny
    for continuous in (True, False):
        loop = DeviceLoop(tok, frozenset(), options=LoopOptions(read_every=4, continuous=continuous))
        first, second = _request([5, 6, 7], max_new_tokens=20, seed=1), _request([8, 9], max_new_tokens=20, seed=2)
        assert loop.round(model, [first], 0) == []
        loop.round(model, [second], 0)
        running = sorted(len(s.ids) for s in loop.seqs.values())
        assert running == ([4, 8] if continuous else [8])
        assert (second in loop.ready) == (not continuous)


def test_a_finished_row_frees_its_slot_and_a_weight_change_drops_kept_caches(tiny):
    model, tok = tiny
    loop = DeviceLoop(tok, frozenset(), options=LoopOptions(read_every=4, max_rows=1))
    short, waiting = _request([5, 6, 7], max_new_tokens=3, seed=1), _request([8, 9], max_new_tokens=3, seed=2)
    assert loop.round(model, [short, waiting], 0) == [short]  # one slot: the second waits
    assert waiting in loop.ready and 0 in loop.parked
    loop.forget()
    assert loop.round(model, [], 0) == [waiting]
    assert waiting.result.metadata["reused"] == 0


def test_loop_options_without_the_loop_are_an_error(tiny):
    with pytest.raises(ConfigError, match=r"\['kv_reuse', 'read_every'\].*device_loop=True"):
        TransformersEngine(*tiny, read_every=4, kv_reuse=False)  # the loop is off on a CPU by default


def test_bad_loop_options_name_the_value():
    with pytest.raises(ConfigError, match="'bogus'"):
        LoopOptions(capture="bogus")
    with pytest.raises(ConfigError, match="read_every"):
        LoopOptions(read_every=0)


def test_step_metrics_count_prefilled_and_reused_prompt_tokens():
    from materl.recipes import grpo

    policy = ml.Agent("tiny-random", trainable=True, engine="transformers", device="cpu",
                      engine_options=dict(device_loop=True))
    step = ml.compile(grpo, policy=policy, ref_policy=policy, group_size=4, max_new_tokens=4, lr=1e-3, seed=0)
    metrics = step.run(["one prompt", "another prompt"])
    step.close()
    stats = policy.engine.stats
    assert metrics["engine/prefilled_tokens"] == stats.prefilled_tokens
    assert metrics["engine/reused_tokens"] == stats.reused_tokens
    # every prompt token is either computed or reused; each group's prompt (P tokens, 4 requests,
    # 4P in all) is computed once and its three twins reuse all of it but the last token, 3(P - 1):
    # with 2 groups, reused >= 3/4 of all prompt tokens - 6 (more where the two prompts share a prefix)
    total = stats.prefilled_tokens + stats.reused_tokens
    assert stats.reused_tokens >= 3 * total / 4 - 6


@pytest.mark.gpu
def test_captured_device_loop_on_cuda_equals_the_dynamic_loop_in_fp32():
    """Raw CUDA graphs (the default); gpu_check's decode rows run capture="compile" too."""
    agent = ml.Agent("tiny-random", engine="transformers", device="cuda", compute_dtype="float32")
    model, tok = agent.model, agent.tokenizer
    prompts, params = _requests(tok)
    want = _generate(TransformersEngine(model, tok, device_loop=False, static_cache=False, dtype=torch.float32),
                     prompts, params)
    engine = TransformersEngine(model, tok, dtype=torch.float32)
    assert engine.loop is not None  # the default on CUDA
    for _ in range(2):  # the second call replays the recorded graphs over kept slots
        _same(_generate(engine, prompts, params), want, atol=1e-4)
    assert engine.loop.graphs  # steps were recorded, not run eagerly


@pytest.mark.gpu
def test_device_loop_keeps_an_episode_cache_on_cuda_in_bf16():
    agent = ml.Agent("tiny-random", engine="transformers", device="cuda")
    engine, tok = agent.engine, agent.tokenizer
    first_prompt = tok.encode("turn one")
    params = SamplingParams(max_new_tokens=6, seed=11)
    first = _generate(engine, [first_prompt], [params])[0]
    second = _generate(engine, [first_prompt + first.token_ids + tok.encode(" ok")], [params])[0]
    assert second.metadata["reused"] == len(first_prompt) + len(first.token_ids) - 1
    assert 0 < len(second.token_ids) <= 6 and all(lp <= 0 for lp in second.logprobs)


def _fused_step_is_seen(device: str) -> None:
    """A fused AdamW step (no version counter bumped) without ``sync_weights``: the next greedy
    generation is a fresh engine's on the new weights (no parked cache, no stale bf16 copy)."""
    agent = ml.Agent("tiny-random", engine="transformers", device=device, trainable=True)
    engine, tok, model = agent.engine, agent.tokenizer, agent.model
    prompt, greedy = tok.encode("turn one"), SamplingParams(max_new_tokens=6, temperature=0.0)
    before = _generate(engine, [prompt], [greedy])[0]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.5, fused=True)
    model(torch.tensor([prompt], device=device)).logits[0, -1, before.token_ids[0]].float().backward()
    optimizer.step()
    after = _generate(engine, [prompt], [greedy])[0]
    fresh = _generate(TransformersEngine(model, tok, dtype=engine.dtype), [prompt], [greedy])[0]
    assert fresh.token_ids != before.token_ids and after.token_ids == fresh.token_ids, (before, after, fresh)


@pytest.mark.gpu
def test_a_fused_optimizer_step_on_cuda_is_seen_without_sync_weights():
    _fused_step_is_seen("cuda")  # the captured device loop over its bf16 copy (the CPU engines: test_engine_contract)
