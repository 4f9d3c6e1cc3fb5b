"""The learner's forward through an HF Llama/Qwen2 decoder, laid out for the backward's memory.

    out = decoder_forward(lm, embeds_B_L_H, mask_B_L, position_ids_B_L)          # one pass
    prefix_U_P_H, suffix_B_S_H = shared_prefix_forward(lm, prefix, owner_B, suffix)  # prompts once

Same modules, same arithmetic as ``decoder(...)`` (the forward's bits are equal; the gradients
agree to float rounding), two differences in what the backward holds:

- **Lean activations.** HF's RMSNorm keeps its input, its normalised input and the reciprocal
  RMS for the backward; its SwiGLU MLP keeps ``gate(x)``, ``silu(gate(x))``, ``up(x)`` and their
  product (four (N, I) tensors per layer). Here RMSNorm keeps its input and the reciprocal RMS,
  and the MLP keeps ``gate(x)`` and ``up(x)``; the backward recomputes the rest (elementwise work,
  ~1% of the layer's FLOPs). For SmolLM2-135M that is a third fewer saved bytes (0.67x, weights aside).
- **Interleaved prompt pass.** With shared prompts (a GRPO group pays for its prompt once) the
  prompt pass and the completion pass used to be two decoder calls. autograd runs ready nodes
  newest first, so the whole completion backward ran before any of the prompt's: at its end
  every weight gradient existed while every prompt activation (and each layer's key/value
  gradient) was still held. Here the two passes run layer by layer (prompt layer l, then the
  completions' layer l), so the backward also alternates and frees the prompt's layer l with
  the completions'.

Used where ``supports(lm)``: decoder layers of Llama or Qwen2 with full attention only, a
transformers whose ``create_causal_mask`` and attention take ``cache`` (5.x), no gradient
checkpointing (``activation_checkpointing_enable()`` keeps HF's layers), and one process (under
torch.distributed each layer's own forward runs: FSDP2 gathers a layer's weights in its forward
hooks). Elsewhere the learner keeps the plain decoder calls (``materl.engines.hf``), which give
the same values with more memory.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LAYER_TYPES = ("LlamaDecoderLayer", "Qwen2DecoderLayer")
NORM_TYPES = ("LlamaRMSNorm", "Qwen2RMSNorm")


def supports(lm: nn.Module) -> bool:
    """Whether ``lm``'s decoder (an HF causal LM, LoRA layers allowed) runs here."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return False
    decoder = lm.get_decoder()
    layers = getattr(decoder, "layers", None)
    config = lm.config
    if not layers or not all(hasattr(decoder, a) for a in ("embed_tokens", "rotary_emb", "norm")):
        return False
    if set(getattr(config, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
        return False
    if getattr(config, "use_sliding_window", False):
        return False
    if any(getattr(m, "gradient_checkpointing", False) for m in (decoder, *layers)):
        return False  # the layers' own forwards recompute their activations instead
    from transformers import masking_utils

    if not _takes_cache(getattr(masking_utils, "create_causal_mask", None)):
        return False
    return all(type(layer).__name__ in LAYER_TYPES and type(layer.input_layernorm).__name__ in NORM_TYPES
               and type(layer.post_attention_layernorm).__name__ in NORM_TYPES
               and _takes_cache(type(layer.self_attn).forward) for layer in layers)


@functools.cache
def _takes_cache(fn) -> bool:
    """Whether ``fn`` takes the KV cache as ``cache`` (transformers 5.x; 4.x named it past_key_values)."""
    return fn is not None and "cache" in inspect.signature(fn).parameters


class _Pass:
    """One batch of rows going through the decoder: its hidden states, mask and rotary tables."""

    def __init__(self, decoder: nn.Module, embeds: Tensor, mask_B_L: Tensor, position_ids: Tensor):
        self.decoder, self.h, self.mask_B_L, self.position_ids = decoder, embeds, mask_B_L, position_ids
        self.rotary = decoder.rotary_emb(embeds, position_ids=position_ids)
        self.mask = None

    def make_mask(self, cache) -> None:
        """The 4D mask for this pass's queries against what ``cache`` holds (call before layer 0)."""
        from transformers.masking_utils import create_causal_mask

        self.mask = create_causal_mask(config=self.decoder.config, inputs_embeds=self.h,
                                       attention_mask=self.mask_B_L, cache=cache, position_ids=self.position_ids)

    def layer(self, layer: nn.Module, cache) -> None:
        """``layer(h, ...)`` (an HF Llama/Qwen2 decoder layer's forward) with lean activations."""
        residual = self.h
        x = rms_norm(layer.input_layernorm, self.h)
        attn, _ = layer.self_attn(hidden_states=x, attention_mask=self.mask, position_ids=self.position_ids,
                                  position_embeddings=self.rotary, use_cache=cache is not None, cache=cache)
        h = residual + attn
        self.h = h + swiglu(layer.mlp, rms_norm(layer.post_attention_layernorm, h))


def decoder_forward(lm: nn.Module, embeds_B_L_H: Tensor, mask_B_L: Tensor, position_ids_B_L: Tensor) -> Tensor:
    """Last hidden states (after the final norm) of one pass; ``decoder(inputs_embeds=...)``."""
    decoder = lm.get_decoder()
    rows = _Pass(decoder, embeds_B_L_H, mask_B_L, position_ids_B_L)
    rows.make_mask(None)
    for layer in decoder.layers:
        rows.layer(layer, None)
    return rms_norm(decoder.norm, rows.h)


def shared_prefix_forward(lm: nn.Module, prefix: tuple[Tensor, Tensor, Tensor], owner_B: Tensor,
                          suffix: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """Prompts (U rows) and the rows continuing them (B rows, row b continues prompt
    ``owner_B[b]``), each ``(embeds, 2D mask, position_ids)``; the suffix mask covers the prompt
    and the suffix. Returns the last hidden states of both passes, ``(U, P, H), (B, S, H)``."""
    from transformers import DynamicCache

    decoder = lm.get_decoder()
    cache = DynamicCache(config=lm.config)
    first, then = _Pass(decoder, *prefix), _Pass(decoder, *suffix)
    first.make_mask(cache)
    for i, layer in enumerate(decoder.layers):
        first.layer(layer, cache)
        cache.layers[i].batch_select_indices(owner_B)  # the prompt's keys/values, one copy per row
        if i == 0:
            then.make_mask(cache)  # sees the prompt's length in layer 0
        then.layer(layer, cache)
    return rms_norm(decoder.norm, first.h), rms_norm(decoder.norm, then.h)


# -- lean autograd functions ----------------------------------------------------------------------

def rms_norm(norm: nn.Module, x: Tensor) -> Tensor:
    """HF's RMSNorm, ``weight * (x * rsqrt(mean(x^2) + eps))`` in float32, saving x and the rsqrt."""
    return _RMSNorm.apply(x, norm.weight, norm.variance_epsilon)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        x32 = x.to(torch.float32)
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, g: Tensor):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.to(torch.float32) * rstd
        g_weight = None
        if ctx.needs_input_grad[1]:
            g_weight = (g * xhat.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0)
        g_x = None
        if ctx.needs_input_grad[0]:  # d/dx of xhat = x * rstd:  rstd * (g_xhat - xhat * mean(g_xhat * xhat))
            g_xhat = (g * weight).to(torch.float32)
            g_x = (rstd * (g_xhat - xhat * (g_xhat * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return g_x, g_weight, None


def swiglu(mlp: nn.Module, x: Tensor) -> Tensor:
    """HF's Llama MLP, ``down(silu(gate(x)) * up(x))``. gate and up run as the modules (LoRA
    layers included); where ``down`` is a plain ``nn.Linear``, the product is recomputed in the
    backward instead of kept (with ``silu(gate)``), else the module's own path runs."""
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    down = mlp.down_proj
    if type(down) is not nn.Linear or not _is_silu(mlp.act_fn):
        return down(mlp.act_fn(gate) * up)
    return _SwiGLUDown.apply(gate, up, down.weight, down.bias)


def _is_silu(act: nn.Module) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


class _SwiGLUDown(torch.autograd.Function):
    """``linear(silu(gate) * up, weight, bias)``, saving gate and up only."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(gate, up, weight)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return F.linear(F.silu(gate) * up, weight, bias)

    @staticmethod
    def backward(ctx, g_out: Tensor):
        gate, up, weight = ctx.saved_tensors
        need_gate, need_up, need_w, need_b = ctx.needs_input_grad
        # Under autocast the forward's linear computed in g_out's dtype (bf16) from the fp32
        # weight; the backward does the same, and hands each gradient back in its input's dtype
        # (as autocast's cast would): fp32 for the master weight.
        weight = weight.to(g_out.dtype)
        silu = F.silu(gate)  # as the forward computed it
        g_w = g_b = None
        if need_w:
            g_w = (g_out.reshape(-1, g_out.shape[-1]).T @ (silu * up).reshape(-1, up.shape[-1]).to(g_out.dtype))
            g_w = g_w.to(ctx.dtypes[0])
        if need_b:  # False when there is no bias
            g_b = g_out.reshape(-1, g_out.shape[-1]).sum(0).to(ctx.dtypes[1])
        g_h = g_out @ weight
        g_up = g_h * silu if need_up else None
        g_gate = torch.ops.aten.silu_backward(g_h * up, gate) if need_gate else None  # autograd's own kernel
        return g_gate, g_up, g_w, g_b
