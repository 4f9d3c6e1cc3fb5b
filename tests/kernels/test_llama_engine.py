"""kernels/llama_engine.mojo, the Mojo engine's forward pass and sampler, against HF transformers
and materl's torch sampler; and the fallback to the transformers engine without Mojo.

Models are small random ones built here: the tiny Llama, a Llama with every linear bias, tied
embeddings and llama3 RoPE scaling, and a Qwen2 with q/k/v biases (biases randomised: HF
initialises them to zero, which would test nothing).
"""

import math
import subprocess
import sys
import textwrap

import pytest
import torch

from materl.engines.base import SamplingParams as SP
from materl.engines.models import load_model
from materl.kernels import loader

from .conftest import HAS_MOJO

needs_mojo = pytest.mark.mojo


@pytest.fixture(scope="module")
def kernel():
    return loader.load("llama_engine")


def random_model(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(1)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=False))
    else:
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
        model = LlamaForCausalLM(LlamaConfig(**shape, attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                                             rope_parameters=rope))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.5)
    return model.eval()


def models():
    tiny, _ = load_model("tiny-random")
    return {"tiny-llama": tiny.eval(), "llama-biases-tied-llama3": random_model("llama"), "qwen2": random_model("qwen2")}


def forward(kernel, model, requests, *, threads=2, reverse=False):
    """Logits of every row: requests are token lists, each with its own cache; ``reverse`` runs
    the rows in reverse order (results are put back in request order)."""
    from materl.engines.mojo_forward import MojoForward, Row, new_cache
    from materl.engines.mojo_model import ModelTable

    table = ModelTable(model)
    caches = [new_cache(table.shape, len(r) + 4) for r in requests]
    rows = [Row(t, i, caches[q]) for q, r in enumerate(requests) for i, t in enumerate(r)]
    order = list(range(len(rows)))[::-1] if reverse else list(range(len(rows)))
    fwd = MojoForward(kernel, threads=threads)
    try:
        logits = fwd.logits(table, [rows[i] for i in order], list(range(len(rows))))
    finally:
        fwd.close()
    out = torch.empty_like(logits)
    out[torch.tensor(order)] = logits
    return out


PROMPT = [104, 101, 108, 108, 111, 32, 116, 104, 101, 114, 101, 44, 32, 109, 111, 106, 111]


@needs_mojo
@pytest.mark.parametrize("name", ["tiny-llama", "llama-biases-tied-llama3", "qwen2"])
def test_prefill_logits_match_hf(kernel, name):
    model = models()[name]
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0]
    got = forward(kernel, model, [PROMPT])
    # float32, different summation order: agreement to ~1e-6 of the logits' scale
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max(), (got - ref).abs().max()


@needs_mojo
def test_a_rows_logits_do_not_depend_on_what_else_runs(kernel):
    model = models()["qwen2"]
    alone = forward(kernel, model, [PROMPT], threads=1)
    others = [[7, 8, 9], PROMPT[:5], list(range(200, 230))]
    mixed = forward(kernel, model, [others[0], PROMPT, *others[1:]], threads=2, reverse=True)
    start = len(others[0])
    assert torch.equal(mixed[start : start + len(PROMPT)], alone)  # bit for bit


@needs_mojo
def test_token_by_token_equals_one_prefill_bit_for_bit(kernel):
    from materl.engines.mojo_forward import MojoForward, Row, new_cache
    from materl.engines.mojo_model import ModelTable

    model = models()["llama-biases-tied-llama3"]
    whole = forward(kernel, model, [PROMPT])
    table, fwd = ModelTable(model), MojoForward(kernel, threads=2)
    cache = new_cache(table.shape, len(PROMPT))
    steps = [fwd.logits(table, [Row(t, i, cache)], [0])[0] for i, t in enumerate(PROMPT)]
    fwd.close()
    assert torch.equal(torch.stack(steps), whole)


@needs_mojo
def test_forward_refuses_positions_outside_the_cache(kernel):
    from materl.engines.mojo_forward import MojoForward, Row, new_cache
    from materl.engines.mojo_model import ModelTable
    from materl.errors import EngineError

    model = models()["tiny-llama"]
    table, fwd = ModelTable(model), MojoForward(kernel, threads=2)
    try:
        with pytest.raises(EngineError, match="outside its KV cache"):
            fwd.logits(table, [Row(104, 3, new_cache(table.shape, 3))], [0])
        with pytest.raises(EngineError, match="outside the vocabulary"):
            fwd.logits(table, [Row(512, 0, new_cache(table.shape, 3))], [0])
    finally:
        fwd.close()


# ----------------------------------------------------------------------------- sampling

# One row with probabilities (0.5, 0.3, 0.2) at T = 1 (vocab padded to 8 with impossible tokens).
PROBS = torch.tensor([[0.5, 0.3, 0.2, 0, 0, 0, 0, 0]])


def draw(kernel, u, logits=PROBS.log(), **params):
    from materl.engines.mojo_forward import sample_logits

    tokens, logprobs = sample_logits(kernel, logits, [SP(**params)] * len(logits), [u] * len(logits))
    return tokens[0], logprobs[0]


@needs_mojo
def test_sampler_inverse_cdf_and_unrenormalised_logprob(kernel):
    # cdf = (0.5, 0.8, 1.0): u=0.45 -> 0, u=0.55 -> 1, u=0.95 -> 2
    assert [draw(kernel, u)[0] for u in (0.45, 0.55, 0.95)] == [0, 1, 2]
    # top_p=0.6: mass before token 1 is 0.5 < 0.6 (kept), before token 2 is 0.8 (removed);
    # filtered (0.625, 0.375): u=0.95 -> token 1; its log-prob is log 0.3, not log 0.375
    tok, lp = draw(kernel, 0.95, top_p=0.6)
    assert tok == 1 and abs(lp - math.log(0.3)) < 1e-6
    # top_k=1 and greedy take the argmax whatever u is
    assert draw(kernel, 0.99, top_k=1)[0] == 0 and draw(kernel, 0.99, greedy=True)[0] == 0
    # T=2: probs ∝ sqrt(p) = (.70711, .54772, .44721), sum 1.70204; cdf (.41545, .73725, 1)
    tok, lp = draw(kernel, 0.6, temperature=2.0)
    assert tok == 1 and abs(lp - math.log(math.sqrt(0.3) / 1.70204)) < 1e-5


@needs_mojo
def test_sampler_agrees_with_the_torch_sampler(kernel):
    from materl.engines.mojo_forward import sample_logits
    from materl.engines.sampling import sample_tokens

    torch.manual_seed(0)
    logits = torch.randn(64, 4096) * 6
    for p in [SP(), SP(temperature=0.7, top_p=0.9), SP(top_k=50), SP(temperature=1.3, top_k=20, top_p=0.8),
              SP(greedy=True)]:
        u = torch.rand(64)
        tokens, logprobs = sample_logits(kernel, logits, [p] * 64, u.tolist())
        ref_tokens, ref_logprobs = sample_tokens(
            logits, u, temperature_B=torch.full((64,), p.temperature), top_k_B=torch.full((64,), p.top_k),
            top_p_B=torch.full((64,), p.top_p), greedy_B=torch.full((64,), p.greedy))
        assert tokens == ref_tokens.tolist(), p
        assert torch.allclose(torch.tensor(logprobs, dtype=torch.float64), ref_logprobs.double(), atol=1e-5, rtol=0), p


# ----------------------------------------------------------------------------- fallback

FALLBACK = textwrap.dedent("""
    import asyncio, sys, warnings
    if {block}:
        class Block:  # the mojo package, as if not installed
            def find_spec(self, name, path=None, target=None):
                if name == "mojo" or name.startswith("mojo."):
                    raise ImportError("no mojo here")
        sys.meta_path.insert(0, Block())
    import materl as ml
    from materl.engines.base import SamplingParams
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asked = ml.Agent("tiny-random", engine="mojo", engine_options=dict(threads=2, max_batch=4))
        engine = asked.engine
    gen = asyncio.run(engine.generate([104, 105], SamplingParams(max_new_tokens=3, seed=0)))
    print(type(engine).__name__, engine.max_batch, len(gen.token_ids))
    print([type(w.message).__name__ + ": " + str(w.message) for w in caught if "mojo" in str(w.message)])
""")


def test_engine_mojo_falls_back_to_transformers_without_mojo(tmp_path):
    # without mojo installed (CI's second pass) this runs as is; with mojo installed, the mojo
    # package is made unimportable in a fresh interpreter
    script = FALLBACK.format(block=HAS_MOJO)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "MATERL_CACHE_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    engine_line, warnings_line = out.stdout.strip().splitlines()[-2:]
    assert engine_line == "TransformersEngine 4 3"  # max_batch kept, 3 tokens generated
    assert "MojoFallbackWarning: materl: engine 'mojo' unavailable for 'tiny-random', using 'transformers'" \
           in warnings_line
    assert "options ['threads'] are the Mojo engine's" in warnings_line
    assert "'mojo' package is not installed" in warnings_line or "MATERL_DISABLE_MOJO=1" in warnings_line
