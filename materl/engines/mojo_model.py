"""The Mojo engine's view of an HF Llama-family model: its shape, a table of weight addresses for
``kernels/llama_engine.mojo``, and RoPE tables.

    shape = model_shape(lm)            # EngineError naming what the Mojo forward cannot run
    table = ModelTable(lm)
    addresses = table.addresses(n)     # int64 tensor for a forward reaching position n - 1
    table.invalidate()                 # after weights changed: the next call re-reads the model

Weights are read in place: a float32, contiguous CPU parameter's own storage goes into the table
(``tensor.data_ptr()``), so an optimizer step, which updates parameters in place, is seen by the
next forward with nothing copied. A copy is made only where the layout does not allow reading
in place: a peft LoRA layer (one merged weight ``W + scale * B @ A`` per layer, as
``decode_weights.py`` does for the transformers engine) or a tensor that is not float32 and
contiguous. Copies are keyed on their sources' storage pointers, in-place version counters and
optimizer steps (``weights_seen.change_key``) and rebuilt only when one of those changed, so
after a learner update only the layers whose weights changed are merged again. The table is re-read from the model after ``invalidate()``
(the engine calls it from ``sync_weights``, ``sleep`` and whenever a batch starts from idle),
not every step: walking ~250 tensors costs milliseconds. ``clear()`` drops the copies of
trainable weights (the engine's ``sleep``); copies of frozen weights stay.

RoPE: cos/sin for positions 0..n-1 come from the model's own rotary module (``rotary_emb``), so
every rope type whose frequencies depend only on the position (default, linear, llama3, yarn, ...)
matches HF exactly; "dynamic" and "longrope", which change frequencies with the sequence length,
are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from materl.engines.hf import causal_lm_of
from materl.engines.models import merged_lora_weight, peft_lora_layer_type
from materl.engines.weights_seen import change_key
from materl.errors import EngineError

# Table layout: mirrors the M_* constants of kernels/llama_engine.mojo.
M_LAYERS, M_HIDDEN, M_HEADS, M_KV_HEADS, M_HEAD_DIM, M_INTER, M_VOCAB = range(7)
M_EMBED, M_NORM, M_LM_HEAD, M_LM_BIAS, M_COS, M_SIN, M_ROPE_POSITIONS = range(7, 14)
M_LAYER0, PER_LAYER = 16, 16
LINEARS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
           ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))
# per-layer slot of each linear's weight (its bias is the next slot), then the two norms
LINEAR_SLOTS = (1, 3, 5, 7, 10, 12, 14)
IN_NORM, POST_NORM = 0, 9

MODEL_TYPES = ("llama", "qwen2")
ROPE_TYPES_REFUSED = ("dynamic", "longrope")


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    eps: float
    scale: float  # attention logits are q . k * scale


def model_shape(model) -> Shape:
    """The shape of ``model`` (an HF Llama/Qwen2 causal LM, possibly inside peft or a value head)
    if the Mojo forward can run it; EngineError saying what it cannot run otherwise."""
    lm = causal_lm_of(model)
    config = lm.config
    kind = getattr(config, "model_type", None)
    if kind not in MODEL_TYPES:
        raise EngineError(f"the Mojo engine runs model types {', '.join(MODEL_TYPES)}; got {kind!r}")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise EngineError(f"the Mojo engine's MLP is SwiGLU (hidden_act='silu'); got {config.hidden_act!r}")
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"} or getattr(config, "use_sliding_window", False):
        raise EngineError(f"the Mojo engine has full attention only; the model's layer types: {sorted(layer_types)}")
    decoder = lm.get_decoder()
    rope_type = getattr(getattr(decoder, "rotary_emb", None), "rope_type", None)
    if rope_type is None or rope_type in ROPE_TYPES_REFUSED:
        raise EngineError(f"the Mojo engine needs position-only RoPE; got rope type {rope_type!r}")
    attn = decoder.layers[0].self_attn
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = attn.head_dim
    shape = Shape(
        layers=len(decoder.layers), hidden=config.hidden_size, heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, inter=config.intermediate_size, vocab=lm.get_output_embeddings().weight.shape[0],
        eps=float(decoder.norm.variance_epsilon), scale=float(attn.scaling),
    )
    bad = {name: v for name, v in [("hidden_size", shape.hidden), ("intermediate_size", shape.inter),
                                     ("head_dim", shape.head_dim), ("vocab_size", shape.vocab)] if v % 8}
    if bad or heads % kv_heads:
        raise EngineError(f"the Mojo engine needs hidden_size, intermediate_size, head_dim and vocab_size divisible "
                          f"by 8 and heads divisible by kv heads; got {bad or {'heads': heads, 'kv_heads': kv_heads}}")
    devices = {p.device.type for p in lm.parameters()}
    if devices != {"cpu"}:
        raise EngineError(f"the Mojo engine runs on CPU; the model's parameters are on {sorted(devices)}")
    return shape


def _in_place(t: Tensor) -> bool:
    return t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"


class ModelTable:
    """Addresses of every weight the Mojo forward reads; see the module docstring."""

    def __init__(self, model):
        self.lm = causal_lm_of(model)
        self.shape = model_shape(model)
        self.copies = 0  # matrices copied or merged so far (tests and benchmarks read it)
        self._copied: dict[int, tuple[tuple, Tensor, Tensor | None, bool]] = {}  # id -> key, weight, bias, frozen
        self._cos = self._sin = torch.empty(0)
        self._table: Tensor | None = None
        self._lora = peft_lora_layer_type()

    @property
    def rope_positions(self) -> int:
        return self._cos.shape[0]

    def clear(self, *, frozen: bool = False) -> None:
        """Drop copies of trainable weights (of frozen ones too if ``frozen``)."""
        self._copied = {} if frozen else {k: v for k, v in self._copied.items() if v[3]}
        self._table = None

    def invalidate(self) -> None:
        """Re-read the model's weights at the next ``addresses`` call."""
        self._table = None

    def addresses(self, positions: int = 1) -> Tensor:
        """The table for the model's weights (as of the last ``invalidate``) with RoPE tables for
        positions 0..positions-1."""
        if positions > self.rope_positions:
            self._ensure_rope(positions)
            self._table = None
        if self._table is None:
            self._table = self._read()
        return self._table

    # -- internals -----------------------------------------------------------------------------

    def _read(self) -> Tensor:
        s = self.shape
        t = [0] * (M_LAYER0 + PER_LAYER * s.layers)
        t[:M_EMBED] = [s.layers, s.hidden, s.heads, s.kv_heads, s.head_dim, s.inter, s.vocab]
        decoder = self.lm.get_decoder()
        t[M_EMBED] = self._address(decoder.embed_tokens.weight)
        t[M_NORM] = self._address(decoder.norm.weight)
        t[M_LM_HEAD], t[M_LM_BIAS] = self._linear(self.lm.get_output_embeddings())
        t[M_COS], t[M_SIN], t[M_ROPE_POSITIONS] = self._cos.data_ptr(), self._sin.data_ptr(), self.rope_positions
        for i, layer in enumerate(decoder.layers):
            base = M_LAYER0 + i * PER_LAYER
            t[base + IN_NORM] = self._address(layer.input_layernorm.weight)
            t[base + POST_NORM] = self._address(layer.post_attention_layernorm.weight)
            for (block, name), slot in zip(LINEARS, LINEAR_SLOTS):
                t[base + slot], t[base + slot + 1] = self._linear(getattr(getattr(layer, block), name))
        return torch.tensor(t, dtype=torch.int64)

    def _address(self, tensor: Tensor) -> int:
        if _in_place(tensor):
            return tensor.data_ptr()
        return self._copy(tensor, [tensor], lambda: (tensor.detach().float().contiguous(), None))[0].data_ptr()

    def _linear(self, module: nn.Module) -> tuple[int, int]:
        """(weight address, bias address or 0) of a Linear or an active peft LoRA layer."""
        lora = self._lora
        if lora and isinstance(module, lora) and not module.merged and not module.disable_adapters:
            base = module.get_base_layer()
            adapters = [a for a in module.active_adapters if a in module.lora_A]
            sources = [base.weight] + ([base.bias] if base.bias is not None else [])
            for a in adapters:
                sources += [module.lora_A[a].weight, module.lora_B[a].weight]

            def merge():
                weight = merged_lora_weight(module, adapters)
                bias = base.bias.detach().float().contiguous() if base.bias is not None else None
                return weight.float().contiguous(), bias

            weight, bias = self._copy(module, sources, merge)
            return weight.data_ptr(), (bias.data_ptr() if bias is not None else 0)
        if isinstance(module, lora):
            module = module.get_base_layer()
        if not isinstance(module, nn.Linear):
            raise EngineError(f"the Mojo engine reads nn.Linear or peft LoRA projections; got {type(module).__name__}")
        bias = self._address(module.bias) if module.bias is not None else 0
        return self._address(module.weight), bias

    def _copy(self, owner, sources: list[Tensor], make) -> tuple[Tensor, Tensor | None]:
        key = change_key(sources)
        hit = self._copied.get(id(owner))
        if hit is not None and hit[0] == key:
            return hit[1], hit[2]
        with torch.no_grad():
            weight, bias = make()
        frozen = not any(t.requires_grad for t in sources)
        self._copied[id(owner)] = (key, weight, bias, frozen)
        self.copies += 1
        return weight, bias

    def _ensure_rope(self, positions: int) -> None:
        if positions <= self.rope_positions:
            return
        n = max(positions, 2 * self.rope_positions, 256)
        rotary = self.lm.get_decoder().rotary_emb
        with torch.no_grad():
            cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(n)[None, :])
        self._cos, self._sin = cos[0].float().contiguous(), sin[0].float().contiguous()
