"""The in-place decode cache gives the logits HF's concatenating DynamicCache gives."""

import pytest
import torch
from transformers import DynamicCache

from materl.engines.hf import cache_kwargs
from materl.engines.kv_cache import GrowingLayer, decode_cache
from materl.engines.models import load_model


def _decode(lm, cache, prompt_ids, steps, keep_after=None):
    """Greedy decode from ``prompt_ids``; after step ``keep_after[0]`` keep rows ``keep_after[1]``."""
    mask = torch.ones_like(prompt_ids)
    out = lm(input_ids=prompt_ids, attention_mask=mask, use_cache=True, **cache_kwargs(lm, cache))
    logits, seen = out.logits[:, -1], [out.logits[:, -1]]
    for t in range(steps):
        tokens = logits.argmax(-1)
        if keep_after is not None and t == keep_after[0]:
            index = torch.tensor(keep_after[1])
            cache.batch_select_indices(index)
            mask, tokens = mask[index], tokens[index]
        mask = torch.cat([mask, mask.new_ones(len(mask), 1)], dim=-1)
        out = lm(input_ids=tokens[:, None], attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1,
                 use_cache=True, **cache_kwargs(lm, cache))
        logits = out.logits[:, -1]
        seen.append(logits)
    return seen


@pytest.mark.parametrize("reserve", [8, 2])  # 2: the buffers must grow past the reserve
def test_growing_cache_matches_dynamic_cache(reserve):
    torch.manual_seed(0)
    lm, _ = load_model("tiny-random")
    prompts = torch.tensor([[104, 105, 106, 107], [110, 111, 112, 113], [120, 121, 122, 123]])
    with torch.no_grad():
        cache = decode_cache(lm.config, reserve=reserve)
        assert all(isinstance(layer, GrowingLayer) for layer in cache.layers)
        ours = _decode(lm, cache, prompts, steps=6, keep_after=(3, [0, 2]))
        theirs = _decode(lm, DynamicCache(config=lm.config), prompts, steps=6, keep_after=(3, [0, 2]))
    assert len(ours) == len(theirs) == 7
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert cache.get_seq_length() == 4 + 6 and cache.layers[0].keys.shape[0] == 2


def test_growing_layer_appends_in_place():
    layer = GrowingLayer(reserve=3)
    k = torch.arange(2 * 1 * 2 * 4, dtype=torch.float32).reshape(2, 1, 2, 4)
    keys, _ = layer.update(k, -k)
    buffer = layer._keys
    step = torch.full((2, 1, 1, 4), 7.0)
    keys, values = layer.update(step, -step)
    assert layer._keys is buffer  # written into, not reallocated
    assert torch.equal(keys, torch.cat([k, step], dim=-2)) and torch.equal(values, -keys)
    for _ in range(3):  # 2 + 1 + 3 = 6 > 2 + 3: grows, keeping what was written
        keys, _ = layer.update(step, -step)
    assert layer.get_seq_length() == 6 and torch.equal(keys[..., :2, :], k)
