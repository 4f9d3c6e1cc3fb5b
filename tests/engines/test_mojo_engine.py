"""The Mojo engine beyond the shared contract (test_engine_contract.py): continuous batching, a
seeded request's output independent of its batch, its threads and a CPU-burning neighbour,
shared prompts, weights read in place (and LoRA merged), agents and a compiled GRPO step."""

import asyncio
import importlib.util
import os
import signal
import subprocess
import sys

import pytest
import torch

import materl as ml
from materl.engines.base import SamplingParams
from materl.engines.models import load_model
from materl.engines.numerics import logprob_delta, teacher_forced_logprobs
from materl.errors import ConfigError
from materl.kernels import loader

pytestmark = [pytest.mark.mojo, pytest.mark.skipif(
    importlib.util.find_spec("mojo") is None or loader.disabled(), reason="needs the mojo package")]

PROMPTS = [[104, 101, 108, 108, 111], [97], list(range(300, 340)), [104, 105, 32, 116, 104, 101, 114, 101]]


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model("tiny-random")
    return model.eval(), tokenizer


def engine_of(model, tokenizer, **options):
    from materl.engines.mojo_engine import MojoEngine

    return MojoEngine(model, tokenizer, **options)


def mixed_params(seed: int) -> list[SamplingParams]:
    """Partners with every kind of sampling and different lengths."""
    return [SamplingParams(max_new_tokens=5, seed=seed), SamplingParams(max_new_tokens=30, greedy=True),
            SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9, top_k=20, seed=seed + 1)]


async def test_a_seeded_request_is_the_same_bits_whatever_shares_its_batch(tiny):
    params = SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.95, seed=42)
    alone = await engine_of(*tiny, threads=1).generate(PROMPTS[0], params)
    engine = engine_of(*tiny, threads=2, prefill_chunk=7)  # prompts fed in chunks of 7 tokens
    partners = [engine.generate(p, q) for p, q in zip(PROMPTS[1:], mixed_params(3))]
    together = (await asyncio.gather(*partners[:2], engine.generate(PROMPTS[0], params), *partners[2:]))[2]
    assert together.token_ids == alone.token_ids
    assert together.logprobs == alone.logprobs  # bit for bit, not approximately
    assert together.metadata["batch_size"] > 1 and alone.metadata["batch_size"] == 1


async def test_a_step_that_only_feeds_a_prompt_samples_nothing(tiny):
    """prefill_chunk=2 and a 6-token prompt: the first steps feed the prompt and draw no token
    (an empty draw, once a float tensor the counter-based generator refused); then it samples
    as a request fed in one step does."""
    prompt, params = [104, 105, 106, 107, 108, 109], SamplingParams(max_new_tokens=4, seed=5)
    chunked = await engine_of(*tiny, prefill_chunk=2).generate(prompt, params)
    whole = await engine_of(*tiny).generate(prompt, params)
    assert chunked.token_ids == whole.token_ids and chunked.logprobs == whole.logprobs


async def test_requests_join_and_leave_between_decode_steps(tiny):
    engine = engine_of(*tiny)
    finished = []

    async def run(name, prompt, params):
        gen = await engine.generate(prompt, params)
        finished.append(name)
        return gen

    greedy = SamplingParams(max_new_tokens=60, greedy=True)  # no eos on this prompt: 60 steps
    long = asyncio.ensure_future(run("long", PROMPTS[2], greedy))
    while engine.stats.steps < 3:  # the long request is decoding
        await asyncio.sleep(0)
    short = await run("short", PROMPTS[0], SamplingParams(max_new_tokens=3, seed=2))
    late = await run("late", PROMPTS[1], SamplingParams(max_new_tokens=3, seed=3))
    first = await long
    assert finished == ["short", "late", "long"] and len(first.token_ids) == 60
    assert short.metadata["batch_size"] == 2 and late.metadata["batch_size"] == 2  # they ran beside it
    # joining and leaving a running batch changed nothing for the long request
    assert first.logprobs == (await engine_of(*tiny).generate(PROMPTS[2], greedy)).logprobs


BURNER = "import time\nend = time.time() + 120\nwhile time.time() < end:\n    pass\n"


async def test_same_bits_with_a_cpu_burning_neighbour(tiny):
    params = [SamplingParams(max_new_tokens=24, seed=i, temperature=0.9, top_k=40) for i in range(len(PROMPTS))]

    async def run():
        engine = engine_of(*tiny, threads=2)
        return await asyncio.gather(*[engine.generate(p, q) for p, q in zip(PROMPTS, params)])

    quiet = await run()
    burners = [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in range(2)]  # one per core
    try:
        loaded = [await run() for _ in range(3)]
    finally:
        for b in burners:
            os.kill(b.pid, signal.SIGKILL)
            b.wait()
    for run_ in loaded:
        assert [g.token_ids for g in run_] == [g.token_ids for g in quiet]
        assert [g.logprobs for g in run_] == [g.logprobs for g in quiet]


async def test_identical_prompts_run_once_and_sample_apart(tiny):
    engine = engine_of(*tiny)
    prompt = PROMPTS[2]
    gens = await asyncio.gather(*[engine.generate(prompt, SamplingParams(max_new_tokens=8, seed=s)) for s in range(4)])
    assert engine.stats.prompt_tokens == len(prompt)  # four requests, one prefill
    assert len({tuple(g.token_ids) for g in gens}) > 1  # seeds differ, samples differ
    solo = [await engine_of(*tiny).generate(prompt, SamplingParams(max_new_tokens=8, seed=s)) for s in range(4)]
    assert [g.logprobs for g in gens] == [g.logprobs for g in solo]


async def test_shared_prefixes_are_computed_once_and_change_no_bits(tiny):
    system = list(range(300, 332))  # a 32-token "system prompt" two requests share
    a, b = system + [104, 105], system + [106, 107, 108]
    params = SamplingParams(max_new_tokens=6, seed=9)
    engine = engine_of(*tiny)
    together = await asyncio.gather(engine.generate(a, params), engine.generate(b, params))
    assert engine.stats.reused_tokens == 32 and engine.stats.prompt_tokens == len(a) + len(b) - 32
    solo = [await engine_of(*tiny, prefix_cache_mb=0).generate(p, params) for p in (a, b)]
    assert [g.logprobs for g in together] == [g.logprobs for g in solo]
    # a second turn: the first turn's prompt + its completion + a tool's answer; its cache is reused
    turn2 = a + together[0].token_ids + [116, 111, 111, 108]
    before = engine.stats.reused_tokens
    second = await engine.generate(turn2, params)
    assert engine.stats.reused_tokens - before == len(a) + len(together[0].token_ids) - 1
    assert second.logprobs == (await engine_of(*tiny, prefix_cache_mb=0).generate(turn2, params)).logprobs
    assert len(engine.pool) == 3


async def test_kept_prefixes_are_dropped_when_weights_change():
    model, tok = load_model("tiny-random")
    engine = engine_of(model.eval(), tok)
    params = SamplingParams(max_new_tokens=4, seed=1)
    first = await engine.generate(PROMPTS[2], params)
    assert len(engine.pool) == 1
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(0.1)  # no sync_weights: the step notices
    again = await engine.generate(PROMPTS[2] + first.token_ids, params)
    assert engine.stats.reused_tokens == 0  # nothing computed with the old weights was reused
    ref = teacher_forced_logprobs(model, PROMPTS[2] + first.token_ids, again.token_ids)
    assert torch.allclose(torch.tensor(again.logprobs, dtype=torch.float64), ref, atol=1e-5)


async def test_logprobs_match_the_teacher_forced_model(tiny):
    model, tok = tiny
    engine = engine_of(model, tok)
    gens = await asyncio.gather(*[engine.generate(p, SamplingParams(max_new_tokens=16, seed=i, temperature=0.7))
                                  for i, p in enumerate(PROMPTS)])
    ref = [teacher_forced_logprobs(model, p, g.token_ids, temperature=0.7) for p, g in zip(PROMPTS, gens)]
    pad = torch.nn.utils.rnn.pad_sequence
    delta = logprob_delta(pad([torch.tensor(g.logprobs) for g in gens], batch_first=True),
                          pad(ref, batch_first=True), pad([torch.ones(len(g.token_ids)) for g in gens], batch_first=True))
    assert delta.tokens == sum(len(g.token_ids) for g in gens)
    assert delta.max < 1e-5  # log-probs of a 512-token vocabulary; float32 rounding only


async def test_weights_are_read_in_place_and_updates_are_seen_at_once(tiny):
    model, tok = load_model("tiny-random")
    engine = engine_of(model.eval(), tok)
    params = SamplingParams(max_new_tokens=6, greedy=True)
    before = await engine.generate(PROMPTS[3], params)
    assert engine.table.copies == 0  # float32 contiguous parameters: nothing copied
    with torch.no_grad():  # an optimizer step updates parameters in place
        model.lm_head.weight.mul_(3.0)
    after = await engine.generate(PROMPTS[3], params)
    ref = teacher_forced_logprobs(model, PROMPTS[3], after.token_ids)
    assert torch.allclose(torch.tensor(after.logprobs, dtype=torch.float64), ref, atol=1e-5)
    assert after.logprobs != before.logprobs and engine.table.copies == 0


async def test_lora_layers_are_merged_and_only_changed_ones_remerged():
    model, tok = load_model("tiny-random", lora=dict(r=4, alpha=8))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    engine = engine_of(model.eval(), tok)
    params = SamplingParams(max_new_tokens=8, seed=5)
    gen = await engine.generate(PROMPTS[0], params)
    assert engine.table.copies == 8  # q, k, v, o of 2 layers, merged once
    ref = teacher_forced_logprobs(model, PROMPTS[0], gen.token_ids)
    assert torch.allclose(torch.tensor(gen.logprobs, dtype=torch.float64), ref, atol=1e-5)
    with torch.no_grad():
        model.base_model.model.model.layers[1].self_attn.v_proj.lora_B["default"].weight.add_(0.3)
    engine.sync_weights()
    gen = await engine.generate(PROMPTS[0], params)
    assert engine.table.copies == 9  # only the changed layer
    ref = teacher_forced_logprobs(model, PROMPTS[0], gen.token_ids)
    assert torch.allclose(torch.tensor(gen.logprobs, dtype=torch.float64), ref, atol=1e-5)
    engine.sleep()  # the merged copies of trainable layers go; the next step merges again
    await engine.generate(PROMPTS[0], params)
    assert engine.table.copies == 17


def test_agent_engine_names_and_the_seed_spelling():
    from materl.engines.mojo_engine import MojoEngine

    assert isinstance(ml.Agent("tiny-random", engine="mojo").engine, MojoEngine)
    seed_style = ml.Agent("tiny-random", generation_backend="mojo", engine_options=dict(threads=1))
    assert isinstance(seed_style.engine, MojoEngine) and seed_style.engine.forward.threads == 1
    assert repr(seed_style) == "Agent('tiny-random', engine='mojo')"
    with pytest.raises(ConfigError, match="name two engines"):
        ml.Agent("tiny-random", engine="transformers", generation_backend="mojo")
    with pytest.raises(ConfigError, match="threads must be an int >= 1"):
        ml.Agent("tiny-random", engine="mojo", engine_options=dict(threads=0)).engine  # noqa: B018


def test_a_compiled_grpo_step_runs_on_the_mojo_engine():
    from materl.recipes import grpo

    policy = ml.Agent("tiny-random", trainable=True, engine="mojo")
    recipe = ml.replace(grpo, "policy_loss", lambda g: ml.grpo_loss(g.advantages, g.policy_logprobs))
    recipe = ml.replace(recipe, "rewards", lambda g: ml.reward(lambda completions, **kw: [len(c) / 10 for c in completions]))
    compiled = ml.compile(recipe, policy=policy, ref_policy=policy, group_size=2, max_new_tokens=6, lr=1e-3)
    before = [p.detach().clone() for p in policy.parameters()]
    metrics = compiled.run(["a", "b"])
    compiled.close()
    assert type(policy.engine).__name__ == "MojoEngine" and policy.engine.stats.requests == 4
    assert metrics["step"] == 1.0
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters()))
    # the engine samples from the updated weights
    prompt = policy.tokenizer.encode("a")
    gen = asyncio.run(policy.engine.generate(prompt, SamplingParams(max_new_tokens=4, seed=0)))
    ref = teacher_forced_logprobs(policy.model, prompt, gen.token_ids)
    assert torch.allclose(torch.tensor(gen.logprobs, dtype=torch.float64), ref, atol=1e-5)


@pytest.mark.slow
async def test_smollm2_logprobs_within_1e4_of_the_learners_recomputation():
    model, tok = load_model("smollm2-135m-instruct")
    model.eval()
    engine = engine_of(model, tok)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
               for q in ("What is 17 * 23?", "Name three colours.", "Why is the sky blue?", "Say hi.")]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    gens = await asyncio.gather(*[engine.generate(p, SamplingParams(max_new_tokens=24, seed=i))
                                  for i, p in enumerate(prompts)])
    ref = [teacher_forced_logprobs(model, p, g.token_ids) for p, g in zip(prompts, gens)]
    pad = torch.nn.utils.rnn.pad_sequence
    delta = logprob_delta(pad([torch.tensor(g.logprobs) for g in gens], batch_first=True), pad(ref, batch_first=True),
                          pad([torch.ones(len(g.token_ids)) for g in gens], batch_first=True))
    assert delta.mean <= 1e-4 and delta.max <= 1e-3, delta
