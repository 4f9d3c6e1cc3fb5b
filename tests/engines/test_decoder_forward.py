"""The learner's decoder forward (``materl.engines.decoder_forward``): the same forward bits and
gradients as HF's decoder calls, fewer saved bytes, and a backward that frees each layer of the
shared prompt pass together with the completions' layer."""

import weakref

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from materl.engines import decoder_forward as dfw
from materl.engines import hf
from materl.engines.models import load_model
from tests.engines.test_row_grads import OWNER, PREFIX, PREFIX_MASK, SUFFIX, SUFFIX_MASK
from tests.tolerance import assert_close_to_scale

SHAPE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2}


def _model(kind: str, dtype=torch.float32):
    torch.manual_seed(0)
    if kind == "qwen2":  # q/k/v biases, untied head
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=False))
    elif kind == "llama-biases":  # biases on every projection, MLP included; tied head
        model = LlamaForCausalLM(LlamaConfig(**SHAPE, attention_bias=True, mlp_bias=True, tie_word_embeddings=True))
    else:  # LoRA on q/k/v/o and on the MLP's down projection (which then keeps its own path)
        model, _ = load_model("tiny-random", lora={"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"]})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "lora_B" in name:  # ones / zeros at init: make them matter
                p.normal_(mean=1.0 if "norm" in name else 0.0, std=0.3)
    return model.to(dtype)


def _hidden(model, shared: bool, lean: bool, monkeypatch):
    if not lean:
        monkeypatch.setattr(dfw, "supports", lambda lm: False)
    try:
        if shared:
            last, suffix = hf.shared_prefix_hidden_states(model, PREFIX, PREFIX_MASK, OWNER, SUFFIX, SUFFIX_MASK)
            return torch.cat([last[:, None], suffix], dim=1)
        ids = torch.cat([PREFIX[OWNER], SUFFIX], dim=1)
        return hf.backbone_hidden_states(model, ids, torch.cat([PREFIX_MASK[OWNER], SUFFIX_MASK], dim=1))
    finally:
        monkeypatch.undo()


def _forward_backward(model, shared, lean, monkeypatch):
    model.zero_grad(set_to_none=True)
    hidden = _hidden(model, shared, lean, monkeypatch)
    weights = torch.linspace(-1, 1, hidden.shape[-1], dtype=hidden.dtype)
    (hidden.sin() * weights).sum().backward()
    return hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["qwen2", "llama-biases", "lora"])
@pytest.mark.parametrize("shared", [False, True], ids=["full-rows", "shared-prompts"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_same_forward_bits_and_gradients_as_the_decoder(kind, shared, dtype, monkeypatch):
    model = _model(kind, dtype)
    assert dfw.supports(hf.causal_lm_of(model))
    hidden, grads = _forward_backward(model, shared, True, monkeypatch)
    hidden_ref, grads_ref = _forward_backward(model, shared, False, monkeypatch)
    assert torch.equal(hidden, hidden_ref)  # the same ops on the same inputs
    assert grads.keys() == grads_ref.keys() and len(grads) > 0
    # HF's RMSNorm computes in float32 whatever the dtype, so float64 agrees to float32's rounding
    for name in grads_ref:
        assert_close_to_scale(grads[name], grads_ref[name], rel=1e-5, msg=name)


def test_not_used_where_the_plain_decoder_must_run():
    """Sliding-window attention, other decoders and gradient checkpointing keep HF's decoder calls."""
    assert not dfw.supports(Qwen2ForCausalLM(Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=4)))
    model = _model("llama-biases")
    assert dfw.supports(model)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable  # 5.2x name
    enable()
    assert not dfw.supports(model)


def test_lean_functions_against_finite_differences():
    """float64 throughout (the norm's float32 cast is the identity's inverse here: inputs are float32-exact)."""
    torch.manual_seed(0)
    gate, up = (torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w, b = torch.randn(5, 6, dtype=torch.float64, requires_grad=True), torch.randn(5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(dfw._SwiGLUDown.apply, (gate, up, w, b))
    assert torch.autograd.gradcheck(lambda g, u, w: dfw._SwiGLUDown.apply(g, u, w, None), (gate, up, w))

    class Norm(torch.nn.Module):  # float32 inside: check the backward against autograd of the same formula
        weight, variance_epsilon = torch.randn(6, requires_grad=True), 1e-5

    x = torch.randn(2, 3, 6, requires_grad=True)
    g = torch.randn(2, 3, 6)
    out = dfw.rms_norm(Norm, x)
    expected = Norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.equal(out, expected)
    for got, want in zip(torch.autograd.grad(out, (x, Norm.weight), g), torch.autograd.grad(expected, (x, Norm.weight), g)):
        assert_close_to_scale(got, want, msg="rms_norm")


def _saved_bytes(model, lean: bool, monkeypatch) -> int:
    """Bytes of distinct storages (parameters aside) autograd saves for one shared-prompt forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _hidden(model, True, lean, monkeypatch)
    return sum(storages.values())


def test_saves_fewer_bytes(monkeypatch):
    """Per token and layer HF keeps the MLP's gate, silu(gate), up and product (4 x intermediate)
    and each norm's normalised input; here gate and up only (2 x intermediate) and no normalised
    input: at tiny-random's shape (hidden 64, intermediate 256) that is well under 0.75x."""
    model, _ = load_model("tiny-random")
    lean, plain = _saved_bytes(model, True, monkeypatch), _saved_bytes(model, False, monkeypatch)
    assert 0 < lean < 0.75 * plain, (lean, plain)


def test_backward_frees_each_prompt_layer_with_the_completions_layer(monkeypatch):
    """The prompt pass's saved tensors of layer l are all freed before any of the completions'
    layer l-1: the two passes' backwards alternate layer by layer."""
    model, _ = load_model("tiny-random", lora=None)
    freed: list[tuple[str, int]] = []
    where: list[tuple[str, int]] = [("", -1)]
    passes: dict[int, str] = {}
    layer_index = {id(layer): i for i, layer in enumerate(model.model.layers)}
    plain_layer = dfw._Pass.layer

    def layer(self, layer, cache):
        where[0] = (passes.setdefault(id(self), "prompt" if not passes else "completion"), layer_index[id(layer)])
        plain_layer(self, layer, cache)

    class Tag:
        def __init__(self, t):
            self.t = t
            weakref.finalize(self, freed.append, where[0])

    monkeypatch.setattr(dfw._Pass, "layer", layer)
    with torch.autograd.graph.saved_tensors_hooks(Tag, lambda tag: tag.t):
        last, suffix = hf.shared_prefix_hidden_states(model, PREFIX, PREFIX_MASK, OWNER, SUFFIX, SUFFIX_MASK)
    torch.cat([last[:, None], suffix], dim=1).square().sum().backward()
    layers = len(model.model.layers)
    assert {p for p, _ in freed if p} == {"prompt", "completion"}
    for i in range(1, layers):
        last_prompt = max(k for k, w in enumerate(freed) if w == ("prompt", i))
        first_completion_below = min(k for k, w in enumerate(freed) if w == ("completion", i - 1))
        assert last_prompt < first_completion_below, (i, freed)


def test_swiglu_backward_under_bf16_autocast_matches_autograd():
    """Under autocast (the learner's bf16 compute over fp32 master weights) the forward's linear
    ran in bf16 from the fp32 weight; the backward must too, and hand back an fp32 weight
    gradient. It used to multiply the bf16 gradient by the fp32 weight and fail (seen on an H200)."""
    torch.manual_seed(0)
    gate32, up32 = torch.randn(3, 5, 16), torch.randn(3, 5, 16)
    w = torch.nn.Parameter(torch.randn(8, 16) / 4)
    b = torch.nn.Parameter(torch.randn(8))
    grads = []
    for fused in (True, False):
        gate, up = gate32.bfloat16().requires_grad_(), up32.bfloat16().requires_grad_()
        w.grad = b.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = (dfw._SwiGLUDown.apply(gate, up, w, b) if fused
                   else torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w, b))
        assert out.dtype == torch.bfloat16
        (out.float() ** 2).sum().backward()
        grads.append((gate.grad, up.grad, w.grad, b.grad))
    for mine, ref in zip(*grads):
        assert mine.dtype == ref.dtype  # bf16 for the activations, fp32 for the master weights
        assert_close_to_scale(mine.double(), ref.double(), rel=2e-2)
