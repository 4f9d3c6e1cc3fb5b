"""The "tiny-random" named model: a 2-layer random Llama and a byte-level tokenizer, built from
code with a fixed seed (no hub access). A full GRPO step on it takes ~0.03 s on a CPU, which is
what unit tests across materl use it for. Registered in :mod:`materl.engines.models`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from materl.engines.chat import CHATML_TOOLS_TEMPLATE


def build_tiny_random(folder: Path, *, seed: int = 0) -> None:
    """A 2-layer random Llama (hidden 64, 4 heads, vocab 512) and a byte-level tokenizer, built
    from code with a fixed seed (no hub access); a full GRPO step on it takes ~0.03 s."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")],
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")


def byte_tokenizer(vocab_size: int = 512):
    """Byte-level tokenizer: ids 0-255 are the bytes, then <|endoftext|> (256), <|im_start|>
    (257), <|im_end|> (258, eos), <|pad|> (259), then ``<|reserved_i|>`` specials up to
    ``vocab_size`` so every id a random model can sample decodes to something."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast


    byte_chars = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={byte_chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    n_reserved = vocab_size - 256 - len(TINY_SPECIAL_TOKENS)
    specials = list(TINY_SPECIAL_TOKENS) + [f"<|reserved_{i}|>" for i in range(n_reserved)]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>", unk_token=None
    )
    tokenizer.chat_template = CHATML_TOOLS_TEMPLATE
    return tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map (what the ByteLevel pre-tokenizer uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out
