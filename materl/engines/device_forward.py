"""A Llama/Qwen2 forward over a slot KV cache with per-row lengths, for the device decode loop.

    cache = SlotCache.empty(lm, rows=8, length=256)           # K/V (rows, kv heads, length, head dim)
    logits_B_V = decode_forward(lm, cache, tokens_B, pos_B, rows=B, length=L)   # one token per row
    prefill_forward(lm, cache, slots, starts, chunks)         # new tokens of several rows, K/V only

The HF modules compute (embedding, norms, q/k/v/o projections, MLP, LM head, rotary tables; LoRA
layers included), so the numbers are the model's own; what is written here is how the keys and
values are stored and read. Each cache row ("slot") belongs to one request: the key/value of the
token at position p of that request sits at column p, and a row attends to columns ``<= p``.
No padding, no position shared between rows: a row's numbers do not depend on its batch-mates'
lengths (left padding in the dynamic loop shifts nothing either, but its mask covers the batch's
longest prompt).

Grouped-query heads stay grouped: the G = heads / kv heads query heads of one kv head are folded
into the query-length axis, ``q (B, Hkv, G*T, D)`` against ``K (B, Hkv, L, D)``, so
``scaled_dot_product_attention`` reads each key/value once per kv head with any backend and a
boolean mask, never a ``repeat_kv`` copy (FlashDecoding and vLLM's GQA decode kernels pack query
heads the same way). Decode reads only the first ``length`` columns (the host's bucket of the
longest live row), so the step's cost follows the rows' lengths, not the cache's capacity.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from materl.engines.hf import causal_lm_of

LAYER_TYPES = ("LlamaDecoderLayer", "Qwen2DecoderLayer")


def supports(lm: nn.Module) -> bool:
    """Whether ``lm`` (an HF causal LM, LoRA layers allowed) runs here: Llama/Qwen2 decoder
    layers, full attention, plain q/k/v/o projections (no q/k norms)."""
    lm = causal_lm_of(lm)
    try:
        decoder = lm.get_decoder()
    except AttributeError:
        return False
    layers = getattr(decoder, "layers", None)
    if not layers or not all(type(layer).__name__ in LAYER_TYPES for layer in layers):
        return False
    if not all(hasattr(decoder, a) for a in ("embed_tokens", "rotary_emb", "norm")):
        return False
    config = lm.config
    if set(getattr(config, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
        return False
    if getattr(config, "use_sliding_window", False):
        return False
    attn = layers[0].self_attn
    return all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim")) \
        and not hasattr(attn, "q_norm")


@dataclass
class SlotCache:
    """Per layer, keys and values ``(rows, kv heads, length, head dim)`` in the model's dtype."""

    keys: list[Tensor]
    values: list[Tensor]

    @classmethod
    def empty(cls, lm: nn.Module, *, rows: int, length: int) -> "SlotCache":
        lm = causal_lm_of(lm)
        decoder = lm.get_decoder()
        attn = decoder.layers[0].self_attn
        weight = attn.k_proj.weight
        shape = (rows, lm.config.num_key_value_heads, length, attn.head_dim)
        n = len(decoder.layers)
        return cls([weight.new_zeros(shape) for _ in range(n)], [weight.new_zeros(shape) for _ in range(n)])

    @property
    def rows(self) -> int:
        return self.keys[0].shape[0]

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]

    def grown(self, *, rows: int, length: int) -> "SlotCache":
        """A larger cache holding this one's contents at the same (row, column)."""
        def bigger(t: Tensor) -> Tensor:
            return t.new_zeros(rows, t.shape[1], length, t.shape[3])

        out = SlotCache([bigger(t) for t in self.keys], [bigger(t) for t in self.values])
        r, n = self.rows, self.length
        for new, old in zip(out.keys + out.values, self.keys + self.values):
            new[:r, :, :n] = old
        return out

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Columns ``[0, n)`` of row ``src`` into row ``dst`` (a shared prompt, computed once)."""
        for t in self.keys + self.values:
            t[dst, :, :n] = t[src, :, :n]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


def _rotary(attn: nn.Module):
    """The model module's own ``apply_rotary_pos_emb`` (Llama's and Qwen2's are the same)."""
    return sys.modules[type(attn).__module__].apply_rotary_pos_emb


def _attend(attn: nn.Module, x_B_T_H: Tensor, rotary: tuple[Tensor, Tensor], keys: Tensor, values: Tensor,
            write: tuple, read: Tensor | slice, bias_B1_GT_L: Tensor) -> Tensor:
    """One attention block: project, rotate, store this step's keys/values at ``write = (rows,
    columns, which tokens)``, attend over ``keys[read, :, :L]`` with the additive mask
    ``bias`` (0 or -inf; its query axis is the G grouped heads times T tokens)."""
    B, T, _ = x_B_T_H.shape
    D = attn.head_dim
    q = attn.q_proj(x_B_T_H).view(B, T, -1, D).transpose(1, 2)
    k = attn.k_proj(x_B_T_H).view(B, T, -1, D).transpose(1, 2)
    v = attn.v_proj(x_B_T_H).view(B, T, -1, D).transpose(1, 2)
    q, k = _rotary(attn)(q, k, *rotary)
    rows, cols, which = write
    keys[rows, :, cols] = k.transpose(1, 2).reshape(B * T, -1, D)[which].to(keys.dtype)
    values[rows, :, cols] = v.transpose(1, 2).reshape(B * T, -1, D)[which].to(values.dtype)
    L = bias_B1_GT_L.shape[-1]
    K, V = keys[read, :, :L], values[read, :, :L]
    q = q.reshape(B, K.shape[1], -1, D).to(K.dtype)  # query head h = kv head h // G, as repeat_kv
    out = F.scaled_dot_product_attention(q, K, V, attn_mask=bias_B1_GT_L, scale=attn.scaling)
    out = out.reshape(B, -1, T, D).transpose(1, 2).reshape(B, T, -1)
    return attn.o_proj(out.to(x_B_T_H.dtype))


def _layers(lm: nn.Module, cache: SlotCache, ids_B_T: Tensor, pos_B_T: Tensor, write, read, mask_B_T_L) -> Tensor:
    decoder = lm.get_decoder()
    h = decoder.embed_tokens(ids_B_T)
    rotary = decoder.rotary_emb(h, pos_B_T)
    B, T, L = mask_B_T_L.shape
    groups = lm.config.num_attention_heads // lm.config.num_key_value_heads
    # once per forward, not per layer: the mask over the G query heads of a kv head, additive
    bias = torch.zeros(B, 1, groups * T, L, dtype=cache.keys[0].dtype, device=h.device).masked_fill_(
        ~mask_B_T_L[:, None, None].expand(B, 1, groups, T, L).reshape(B, 1, groups * T, L), float("-inf"))
    for i, layer in enumerate(decoder.layers):
        a = _attend(layer.self_attn, layer.input_layernorm(h), rotary, cache.keys[i], cache.values[i],
                    write, read, bias)
        h = h + a
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return decoder.norm(h)


def decode_forward(lm: nn.Module, cache: SlotCache, tokens_B: Tensor, pos_B: Tensor, *, rows: int,
                   length: int) -> Tensor:
    """Logits (B, V) of rows ``0..rows-1`` of the cache, each feeding ``tokens_B[i]`` at column
    ``pos_B[i]`` (its key/value written there; columns ``< length`` and ``<= pos`` attended).
    A live row has ``pos < length``; an idle row (logits ignored) writes at its ``pos``, the
    first column past what it holds, clamped to the cache's capacity."""
    lm = causal_lm_of(lm)
    mask = torch.arange(length, device=pos_B.device)[None, None, :] <= pos_B[:, None, None]
    write = (torch.arange(rows, device=pos_B.device), pos_B.clamp(max=cache.length - 1), slice(None))
    h = _layers(lm, cache, tokens_B[:, None], pos_B[:, None], write, slice(0, rows), mask)
    return lm.lm_head(h[:, -1, :])


def prefill_forward(lm: nn.Module, cache: SlotCache, slots: list[int], starts: list[int],
                    chunks: list[list[int]]) -> None:
    """Keys and values of ``chunks[i]`` (tokens at columns ``starts[i]...``) into row ``slots[i]``;
    the rows are right-padded to one length, pad positions are neither written nor attended.
    Eager (lengths vary); no logits (the decode step feeds each request's last prompt token)."""
    lm = causal_lm_of(lm)
    device = cache.keys[0].device
    B, T = len(chunks), max(len(c) for c in chunks)
    ids = torch.zeros(B, T, dtype=torch.long)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for i, c in enumerate(chunks):
        ids[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        valid[i, : len(c)] = True
    start_B = torch.tensor(starts, dtype=torch.long)
    pos = start_B[:, None] + torch.arange(T)[None, :]
    length = int(max(s + len(c) for s, c in zip(starts, chunks)))
    mask = torch.arange(length)[None, None, :] <= pos[:, :, None]
    which = valid.reshape(-1)
    slot_B = torch.tensor(slots, dtype=torch.long)
    write = (slot_B[:, None].expand(B, T).reshape(-1)[which].to(device), pos.reshape(-1)[which].to(device),
             which.to(device))
    _layers(lm, cache, ids.to(device), pos.to(device), write, slot_B.to(device), mask.to(device))
