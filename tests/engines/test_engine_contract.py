"""The engine contract (materl/engines/base.py), checked on every engine.

The in-process engines (transformers, mojo) run on the tiny random Llama; the Mojo engine's
parametrisation is skipped without the mojo package. The SGLang parametrisation runs only when
MATERL_SGLANG_URL points at a server; MATERL_SGLANG_MODEL names the model (or HF folder) that
server was launched with (default: smollm2-135m-instruct), used here for tokenizing and for
the teacher-forced reference log-probs.
"""

import asyncio
import importlib.util
import os

import anyio
import anyio.lowlevel
import pytest
import torch

from materl.engines.base import Engine, SamplingParams
from materl.engines.models import load_model
from materl.errors import ConfigError, EngineError
from materl.kernels import loader

SGLANG_URL = os.environ.get("MATERL_SGLANG_URL")
HAS_MOJO = importlib.util.find_spec("mojo") is not None and not loader.disabled()
MOJO = pytest.param("mojo", marks=[pytest.mark.mojo, pytest.mark.skipif(not HAS_MOJO, reason="needs the mojo package")])
ENGINE_KINDS = [
    "transformers",
    "device-loop",  # the transformers engine's device loop (device_loop=True; uncaptured on a CPU)
    MOJO,
    pytest.param("sglang", marks=[pytest.mark.sglang, pytest.mark.skipif(
        not SGLANG_URL, reason="set MATERL_SGLANG_URL to a running SGLang server")]),
]
IN_PROCESS = ["transformers", "device-loop", MOJO]


def in_process_engine(kind, model, tokenizer, **options):
    if kind == "mojo":
        from materl.engines.mojo_engine import MojoEngine

        return MojoEngine(model, tokenizer, **options)
    from materl.engines.transformers_engine import TransformersEngine

    if kind == "device-loop":
        options = {"device_loop": True, **options}
    return TransformersEngine(model, tokenizer, **options)


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model("tiny-random")
    return model.eval(), tokenizer


@pytest.fixture(params=ENGINE_KINDS)
def setup(request, tiny):
    """(engine, model, tokenizer): the model is the one the engine samples from."""
    if request.param in ("transformers", "device-loop", "mojo"):
        model, tokenizer = tiny
        return in_process_engine(request.param, model, tokenizer), model, tokenizer
    from materl.engines.sglang_engine import SGLangEngine

    model, tokenizer = load_model(os.environ.get("MATERL_SGLANG_MODEL", "smollm2-135m-instruct"))
    return SGLangEngine(SGLANG_URL), model.eval(), tokenizer


def teacher_forced_logprobs(model, prompt, completion, temperature):
    """log_softmax(logits / T) of each completion token given everything before it."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


PROMPTS = ["hello there", "a", "a longer prompt, so the batch is left-padded"]


async def test_is_an_engine_and_ids_decode_to_text(setup):
    engine, _, tok = setup
    assert isinstance(engine, Engine)
    prompt = tok.encode(PROMPTS[0])
    gen = await engine.generate(prompt, SamplingParams(max_new_tokens=12, seed=3))
    assert 0 < len(gen.token_ids) <= 12 and len(gen.logprobs) == len(gen.token_ids)
    assert gen.prompt_len == len(prompt)
    assert tok.decode(gen.token_ids, skip_special_tokens=False) == gen.metadata["text"]
    assert gen.finish_reason in ("stop", "stop_string", "length")


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 20)])
async def test_logprobs_match_a_teacher_forced_forward(setup, temperature, top_p, top_k):
    # sampling log-probs are log_softmax(logits / T) of the unfiltered distribution, computed
    # inside a left-padded batch with a KV cache; the reference is one unpadded forward pass
    engine, model, tok = setup
    params = SamplingParams(max_new_tokens=16, temperature=temperature, top_p=top_p, top_k=top_k, seed=7)
    prompts = [tok.encode(p) for p in PROMPTS]
    gens = await asyncio.gather(*[engine.generate(p, params) for p in prompts])
    for prompt, gen in zip(prompts, gens):
        ref = teacher_forced_logprobs(model, prompt, gen.token_ids, temperature)
        assert torch.allclose(torch.tensor(gen.logprobs), ref, atol=1e-4, rtol=0), (gen.logprobs, ref)


async def test_greedy_is_deterministic_and_takes_the_argmax(setup):
    engine, model, tok = setup
    prompt = tok.encode(PROMPTS[2])
    params = SamplingParams(max_new_tokens=10, greedy=True)
    first, second = await engine.generate(prompt, params), await engine.generate(prompt, params)
    assert first.token_ids == second.token_ids
    with torch.no_grad():
        logits = model(torch.tensor([prompt + first.token_ids])).logits[0, len(prompt) - 1 : -1]
    assert logits.argmax(-1).tolist() == first.token_ids
    # greedy log-probs are at T = temperature (1 here)
    assert torch.allclose(torch.tensor(first.logprobs), logits.log_softmax(-1).max(-1).values, atol=1e-4)


async def test_same_seed_same_sample_whatever_shares_the_batch(setup):
    engine, _, tok = setup
    prompt = tok.encode(PROMPTS[0])
    params = SamplingParams(max_new_tokens=16, seed=1234)
    alone = await engine.generate(prompt, params)
    partners = [engine.generate(tok.encode(p), SamplingParams(max_new_tokens=24, seed=i)) for i, p in enumerate(PROMPTS)]
    together, *_ = await asyncio.gather(engine.generate(prompt, params), *partners)
    assert together.token_ids == alone.token_ids
    other_seed = await engine.generate(prompt, SamplingParams(max_new_tokens=16, seed=1235))
    assert other_seed.token_ids != alone.token_ids  # 16 draws from ~uniform over 512 ids


async def test_stop_string_ends_generation_once_the_text_contains_it(setup):
    engine, _, tok = setup
    prompt = tok.encode(PROMPTS[1])
    free = await engine.generate(prompt, SamplingParams(max_new_tokens=24, greedy=True))
    # pick a stop string from the middle of the free run: the first token that decodes cleanly
    k = next(i for i in range(4, len(free.token_ids)) if "\ufffd" not in tok.decode(free.token_ids[i : i + 1]))
    stop = tok.decode(free.token_ids[k : k + 1])
    stopped = await engine.generate(prompt, SamplingParams(max_new_tokens=24, greedy=True, stop_strings=(stop,)))
    n = len(stopped.token_ids)
    assert stopped.finish_reason == "stop_string"
    assert stopped.token_ids == free.token_ids[:n]  # same greedy path, cut short, stop string kept
    assert stop in tok.decode(stopped.token_ids) and stop not in tok.decode(stopped.token_ids[:-1])


async def test_stop_token_and_max_new_tokens(setup):
    engine, _, tok = setup
    prompt = tok.encode(PROMPTS[0])
    free = await engine.generate(prompt, SamplingParams(max_new_tokens=12, greedy=True))
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    stopped = await engine.generate(prompt, SamplingParams(max_new_tokens=12, greedy=True, stop_token_ids=(stop_id,)))
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[: first + 1]
    short = await engine.generate(prompt, SamplingParams(max_new_tokens=3, seed=0))
    if short.finish_reason == "length":
        assert len(short.token_ids) == 3
    else:  # an eos id came first
        assert short.finish_reason == "stop" and len(short.token_ids) <= 3


# ----------------------------------------------------------------------------- in-process only


@pytest.fixture(params=IN_PROCESS)
def engine(request, tiny):
    return in_process_engine(request.param, *tiny, max_batch=64, batch_window_s=0.005)


async def test_concurrent_requests_are_coalesced_into_fewer_batches(tiny):
    from materl.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine(*tiny, max_batch=64)
    tok = tiny[1]
    prompts = [tok.encode(f"request number {i}" + "!" * i) for i in range(16)]
    gens = await asyncio.gather(*[engine.generate(p, SamplingParams(max_new_tokens=8, seed=i)) for i, p in enumerate(prompts)])
    assert len(gens) == 16 and engine.stats.requests == 16
    assert engine.stats.batches == 1  # all ready at once: one batch, whatever the machine's load
    assert [g.metadata["batch_size"] for g in gens] == [16] * 16


async def test_batches_close_when_the_loop_has_nothing_ready_not_by_the_clock(tiny):
    """Requests reached after a few event-loop passes join the batch; one that waits on I/O (a
    tool call; here a real sleep) does not, and forms the next batch."""
    from materl.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine(*tiny, max_batch=64)
    async def after_passes(i: int, passes: int):
        for _ in range(passes):
            await anyio.lowlevel.checkpoint()
        return await engine.generate([104 + i], SamplingParams(max_new_tokens=3, seed=i))

    async def after_io(i: int):
        await anyio.sleep(0.25)  # far longer than a few loop passes, even on a loaded machine
        return await engine.generate([104 + i], SamplingParams(max_new_tokens=3, seed=i))

    gens = await asyncio.gather(*[after_passes(i, i) for i in range(5)], after_io(9))
    assert [g.metadata["batch_size"] for g in gens] == [5] * 5 + [1]
    assert engine.stats.batches == 2


@pytest.mark.parametrize("kind", IN_PROCESS)
async def test_max_batch_caps_a_batch(tiny, kind):
    engine = in_process_engine(kind, *tiny, max_batch=4)
    gens = await asyncio.gather(*[engine.generate([104 + i], SamplingParams(max_new_tokens=2, seed=i))
                                  for i in range(10)])
    assert engine.stats.largest_batch <= 4  # 10 requests, at most 4 decoding together
    assert max(g.metadata["batch_size"] for g in gens) <= 4
    if kind == "transformers":
        assert engine.stats.batches >= 3


async def test_event_loop_keeps_running_while_a_batch_decodes(tiny):
    from materl.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine(*tiny, max_batch=64, batch_window_s=0.005)
    model = tiny[0]
    state = {"ticks": 0, "at_first_forward": None}

    def note_first_forward(*_):
        if state["at_first_forward"] is None:
            state["at_first_forward"] = state["ticks"]

    hook = model.register_forward_pre_hook(note_first_forward)
    try:
        task = asyncio.ensure_future(engine.generate([104, 105], SamplingParams(max_new_tokens=64, seed=0)))
        while not task.done():  # a 1 ms tick: sleep(0) would spin the loop and starve the decode thread
            state["ticks"] += 1
            await asyncio.sleep(0.001)
        await task
    finally:
        hook.remove()
    # the loop ticked after the decode's first forward pass began, i.e. during the decode
    assert state["at_first_forward"] is not None and state["ticks"] > state["at_first_forward"]


async def test_cancelled_request_does_not_block_the_others(engine):
    slow = asyncio.ensure_future(engine.generate([104], SamplingParams(max_new_tokens=4, seed=0)))
    await asyncio.sleep(0)
    slow.cancel()
    gen = await engine.generate([105], SamplingParams(max_new_tokens=4, seed=1))
    assert len(gen.token_ids) > 0
    with pytest.raises(asyncio.CancelledError):
        await slow


async def test_generation_restores_train_mode_and_sync_is_a_noop(engine, tiny):
    model = tiny[0]
    model.train()
    try:
        await engine.generate([104], SamplingParams(max_new_tokens=2, seed=0))
        assert model.training
        engine.sync_weights()
    finally:
        model.eval()


async def test_bad_requests_fail_with_the_value_received(engine):
    with pytest.raises(ConfigError, match="top_p"):
        await engine.generate([104], SamplingParams(top_p=0.0))
    with pytest.raises(ConfigError, match="temperature"):
        await engine.generate([104], SamplingParams(temperature=-1.0))
    with pytest.raises(EngineError, match="empty prompt"):
        await engine.generate([], SamplingParams())
    empty = await engine.generate([104], SamplingParams(max_new_tokens=0))
    assert empty.token_ids == [] and empty.finish_reason == "length"


async def test_a_prompt_the_model_cannot_read_fails_alone_not_the_batch_it_arrives_with(engine, tiny):
    # token ids outside the vocabulary (a client may send ids) and a prompt that fills the context
    # arrive together with good requests: each bad one fails by itself, naming what was wrong, and
    # the good ones are served as if it had not come (the same tokens as alone)
    model = tiny[0]
    vocab, context = model.get_input_embeddings().num_embeddings, model.config.max_position_embeddings
    alone = await engine.generate([104, 105], SamplingParams(max_new_tokens=4, seed=3))
    good = [engine.generate([104, 105], SamplingParams(max_new_tokens=4, seed=3)) for _ in range(2)]
    bad = [engine.generate(ids, SamplingParams(max_new_tokens=4, seed=1))
           for ids in ([104, vocab + 5], [-1], [104] * context)]
    results = await asyncio.gather(*good, *bad, return_exceptions=True)
    assert [r.token_ids for r in results[:2]] == [alone.token_ids] * 2
    assert all(isinstance(r, EngineError) for r in results[2:]), results[2:]
    assert f"token id {vocab + 5} at position 1" in str(results[2]) and f"ids 0..{vocab - 1}" in str(results[2])
    assert "token id -1 at position 0" in str(results[3])
    assert f"the prompt has {context} tokens" in str(results[4]) and f"holds {context} positions" in str(results[4])
    longest = await engine.generate([104] * (context - 1), SamplingParams(max_new_tokens=1, seed=0))
    assert len(longest.token_ids) == 1  # one position left: still served


@pytest.mark.parametrize("kind", IN_PROCESS)
async def test_a_fused_optimizer_step_is_seen_without_sync_weights(kind):
    # AdamW(fused=True) writes the parameters without bumping their version counter; the engine's
    # cached prompt prefixes (Mojo) and packed or merged weight copies must still be dropped, so
    # the next generation is the one a fresh engine gives on the new weights
    model, tok = load_model("tiny-random")
    model.eval()
    engine = in_process_engine(kind, model, tok)
    prompt, greedy = [104, 105, 106, 107, 108], SamplingParams(max_new_tokens=6, temperature=0.0)
    before = await engine.generate(prompt, greedy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, fused=True)
    versions = [p._version for p in model.parameters()]
    model(torch.tensor([prompt])).logits[0, -1, before.token_ids[0]].backward()  # away from the old argmax
    optimizer.step()
    assert [p._version for p in model.parameters()] == versions  # what the engine could not see before
    after = await engine.generate(prompt, greedy)
    fresh = await in_process_engine(kind, model, tok).generate(prompt, greedy)
    assert fresh.token_ids != before.token_ids and after.token_ids == fresh.token_ids


def test_engine_works_across_event_loops(engine):
    # step.run() calls asyncio.run() once per step: the engine must not hold on to a dead loop
    a = asyncio.run(engine.generate([104], SamplingParams(max_new_tokens=3, seed=5)))
    b = asyncio.run(engine.generate([104], SamplingParams(max_new_tokens=3, seed=5)))
    assert a.token_ids == b.token_ids
