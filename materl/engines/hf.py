"""What materl calls on a Hugging Face causal LM: its decoder under LoRA/value-head wrappers,
its last hidden states (with a shared-prompt KV-cache pass for the learner), its LM head, the
cache keyword of its forward, and quiet loading. Used by the loaders, the engines and the
learner alike."""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from typing import Any

import torch

from materl.device import check_same_device

@contextmanager
def quiet_loading():
    """transformers' "Loading weights" progress bar off while materl loads a model (restored
    after), and peft's use of transformers' deprecated ``is_gradient_checkpointing`` not shown:
    neither is something a materl user can act on."""
    import warnings

    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*", category=FutureWarning)
            yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def cache_kwargs(module: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """``{"cache": cache}`` for models whose forward takes ``cache`` (transformers >= 5.2x),
    ``{"past_key_values": cache}`` for older ones, which then need no deprecation warning."""
    return {_cache_kwarg(type(module)): cache}


@functools.cache
def _cache_kwarg(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def causal_lm_of(model: torch.nn.Module) -> torch.nn.Module:
    """The HF causal LM inside ``model`` (unwrapping a value head and a peft wrapper; peft's
    LoRA layers live inside the base model's modules, so they stay active)."""
    model = getattr(model, "backbone", model)  # ValueHeadModel
    get_base = getattr(model, "get_base_model", None)  # PeftModel
    return get_base() if callable(get_base) else model


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that ignore padding: ``cumsum(mask) - 1`` clamped at 0, shape (B, L).

    Left- and right-padded batches then get the same positions for the same real tokens, which
    is what the generation engine uses (HF ``generate`` does the same for left padding).
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_inputs(lm: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the decoder of ``lm`` gets for ``ids``: ``{"input_ids": ids}``, or, where the input
    embedding is a plain trainable ``nn.Embedding`` (full fine-tuning), ``{"inputs_embeds": ...}``:
    the same lookup, whose gradient rows are added into ``weight.grad`` in place.

    The dense backward of an embedding zero-fills a (V, H) gradient (113 MB for SmolLM2-135M) to
    add a few hundred rows into it, and with tied weights (SmolLM2, Qwen2-0.5B) autograd then adds
    that into the LM head's (V, H) gradient. Here the lookup reads a detached alias of the weight
    (same storage, its own leaf) with ``sparse=True``; when the alias's row gradient is complete
    a hook adds it into ``weight.grad`` (or makes it the dense gradient if there is none yet), so
    ``weight.grad`` ends dense and equal to the dense lookup's, with no (V, H) temporary at the
    end of the backward, the step's memory peak. Not taken without gradients, under
    ``torch.distributed`` (DDP and FSDP2 reduce each parameter's gradient from autograd's hooks),
    or inside ``torch.compile`` (``cuda_graphs=True``: the hook breaks the graph, and the sparse
    backward failed inside the captured region on an H200).
    """
    emb = lm.get_input_embeddings()
    w = getattr(emb, "weight", None)
    if w is not None:
        check_same_device("token ids", ids, w, where="materl.engines.hf.token_inputs")
    if not (type(emb) is torch.nn.Embedding and torch.is_grad_enabled() and w.requires_grad
            and not torch.distributed.is_initialized() and not torch.compiler.is_compiling()):
        return {"input_ids": ids}
    alias = w.detach().requires_grad_()
    alias.register_post_accumulate_grad_hook(functools.partial(_add_rows, w))
    return {"inputs_embeds": torch.nn.functional.embedding(
        ids, alias, emb.padding_idx, emb.max_norm, emb.norm_type, emb.scale_grad_by_freq, sparse=True)}


def _add_rows(weight: torch.Tensor, alias: torch.Tensor) -> None:
    rows, alias.grad = alias.grad, None
    if weight.grad is None:
        weight.grad = rows.to_dense()
    else:
        weight.grad.add_(rows)


def backbone_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                           position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Last hidden layer (after the final norm) of the backbone, (B, L, H); gradients flow.

    Packed rows (``materl.compiler.packing``): ``attention_mask=None`` and ``position_ids`` that
    restart at 0 on each row (transformers then builds a block-diagonal causal mask: a boolean one
    for SDPA, a BlockMask for FlexAttention, varlen for flash attention), or a prepared 4D mask."""
    from materl.engines import decoder_forward

    lm = causal_lm_of(model)
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask)
    if decoder_forward.supports(lm):
        return decoder_forward.decoder_forward(lm, _embeds(lm, input_ids), attention_mask, position_ids)
    out = lm.get_decoder()(**token_inputs(lm, input_ids), attention_mask=attention_mask,
                           position_ids=position_ids, use_cache=False)
    return out.last_hidden_state


def _embeds(lm: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    inputs = token_inputs(lm, ids)
    return inputs["inputs_embeds"] if "inputs_embeds" in inputs else lm.get_input_embeddings()(ids)


def shared_prefix_hidden_states(
    model,
    prefix_ids: torch.Tensor,
    prefix_mask: torch.Tensor,
    owner: torch.Tensor,
    suffix_ids: torch.Tensor,
    suffix_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states of rows that share prompts, each distinct prompt run once; gradients flow.

    prefix_ids/mask (U, P): the distinct prompts, right-padded; owner (B,): which prefix row b
    continues; suffix_ids/mask (B, S): row b's tokens after its prompt, right-padded.
    Returns ``(last_prefix_B_H, suffix_B_S_H)``: the hidden state at row b's last prompt token
    (it predicts the first suffix token) and at every suffix token.

    The prefix pass fills a KV cache; its keys/values are indexed by ``owner`` (so backward sums
    the gradients of every row that read them) and the suffix pass attends to them, with
    positions continuing from each prompt's length. The result equals running every row's full
    sequence (up to float summation order) at the cost of U*P + B*S tokens instead of B*(P+S):
    a GRPO group of G samples pays for its prompt once, not G times. Right padding everywhere,
    so no query row is fully masked (the middle gap of short prompts is masked out). Where
    ``decoder_forward.supports`` the passes run layer by layer with lean activations (the same
    values; see that module), else as two decoder calls.
    """
    from transformers import DynamicCache

    from materl.engines import decoder_forward

    lm = causal_lm_of(model)
    prompt_len_B = prefix_mask.sum(-1)[owner]
    steps_S = torch.arange(suffix_ids.shape[1], device=suffix_ids.device)
    suffix_pos_B_S = prompt_len_B[:, None] + steps_S[None, :]
    suffix_mask_B_L = torch.cat([prefix_mask[owner], suffix_mask], dim=-1)
    if decoder_forward.supports(lm):  # the same values, with less memory held by the backward
        prefix = (_embeds(lm, prefix_ids), prefix_mask, position_ids_from_mask(prefix_mask))
        if suffix_ids.shape[1] == 0:
            prefix_U_P_H = decoder_forward.decoder_forward(lm, *prefix)
            last_B_H = prefix_U_P_H[owner, prompt_len_B - 1]
            return last_B_H, last_B_H.new_zeros(len(owner), 0, last_B_H.shape[-1])
        prefix_U_P_H, suffix_B_S_H = decoder_forward.shared_prefix_forward(
            lm, prefix, owner, (_embeds(lm, suffix_ids), suffix_mask_B_L, suffix_pos_B_S))
        return prefix_U_P_H[owner, prompt_len_B - 1], suffix_B_S_H
    decoder = lm.get_decoder()
    cache = DynamicCache(config=lm.config)
    prefix = decoder(**token_inputs(lm, prefix_ids), attention_mask=prefix_mask,
                     position_ids=position_ids_from_mask(prefix_mask), use_cache=True, **cache_kwargs(decoder, cache))
    last_B_H = prefix.last_hidden_state[owner, prompt_len_B - 1]
    if suffix_ids.shape[1] == 0:
        return last_B_H, last_B_H.new_zeros(len(owner), 0, last_B_H.shape[-1])
    cache.batch_select_indices(owner)
    suffix = decoder(**token_inputs(lm, suffix_ids), attention_mask=suffix_mask_B_L, position_ids=suffix_pos_B_S,
                     use_cache=True, **cache_kwargs(decoder, cache))
    return last_B_H, suffix.last_hidden_state


def output_embedding(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM head as ``(weight (V, H), bias (V,) or None)``: logits = hidden @ weight.T + bias."""
    head = causal_lm_of(model).get_output_embeddings()
    return head.weight, getattr(head, "bias", None)
