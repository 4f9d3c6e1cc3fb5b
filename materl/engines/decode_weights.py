"""Decode-time copies of a model's linear weights, laid out for fast skinny matmuls on CPU.

    weights = DecodeWeights()
    with torch.no_grad(), weights.installed(lm):  # every Linear (LoRA merged in) runs packed
        logits = lm(...)
    weights.clear()                               # drop the copies of trainable weights

Decoding multiplies a handful of rows by every weight matrix once per token, so it is bound by
how fast the weights stream from memory. On the CPUs here torch's default GEMM reaches ~10 GB/s
for 8 rows while oneDNN with a pre-packed weight layout reaches ~21 GB/s (memory sums: ~30), so
every ``nn.Linear`` (and every peft LoRA layer, as one Linear with ``W + scale * B @ A``) gets a
packed copy and its ``forward`` is pointed at oneDNN's linear inside ``installed``.

Copies are cached across decode batches and rebuilt when a source tensor changed (keyed on
each tensor's storage pointer, torch's in-place version counter, which ``load_state_dict`` and
unfused optimizer steps bump, and the optimizer steps run over it, which a fused step does not
bump: ``weights_seen.change_key``), so a multi-turn rollout packs once per weight update. They cost one
extra copy of the linear weights while they live: the engine drops the copies of trainable
weights when the rollout stage ends (``TransformersEngine.sleep``), as the learner is about to
change them. Copies of frozen weights (a LoRA policy's base MLPs and LM head, a reference model)
stay: they cannot go stale unnoticed, and repacking them was 0.1 s of every LoRA step. Where
oneDNN packing is unavailable (GPU tensors, a build without mkldnn, dtypes other than
float32/bfloat16) only the LoRA merge is applied. Results
agree with the plain path to float rounding (~1e-6 relative), not bit for bit.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
from torch import Tensor, nn

from materl.engines.models import lora_merged, merged_lora_weight, peft_lora_layer_type
from materl.engines.weights_seen import change_key


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _packed_linear(weight: Tensor, bias: Tensor | None, x: Tensor, *args, **kwargs) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [None], "")


class DecodeWeights:
    """Packed weights of one model for decoding; see the module docstring."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._cache: dict[int, tuple[tuple, Tensor, Tensor | None, bool]] = {}  # key, weight, bias, frozen
        self.packs = 0  # how many matrices were (re)packed, for tests and benchmarks

    def clear(self, *, frozen: bool = False) -> None:
        """Drop the copies of trainable weights (and of frozen ones too if ``frozen``); the memory
        goes back to the allocator, which keeps it for the learner
        (``materl.compute.tune_allocator``)."""
        self._cache = {} if frozen else {k: v for k, v in self._cache.items() if v[3]}

    @contextmanager
    def installed(self, lm: nn.Module):
        targets = self._targets(lm) if self.enabled and packing_available() else None
        if not targets:
            with lora_merged(lm):
                yield
            return
        try:
            for module in targets:
                weight, bias = self._packed(module)
                module.forward = partial(_packed_linear, weight, bias)
        except Exception:
            for module in targets:
                module.__dict__.pop("forward", None)
            raise
        try:
            yield
        finally:
            for module in targets:
                module.__dict__.pop("forward", None)

    # -- internals -----------------------------------------------------------------------------

    def _targets(self, lm: nn.Module) -> list[nn.Module]:
        """LoRA layers (not their inner Linears) and plain Linears, if all can be packed."""
        lora_type = peft_lora_layer_type()
        out: list[nn.Module] = []

        def walk(module: nn.Module) -> None:
            for child in module.children():
                if lora_type and isinstance(child, lora_type):
                    if child.merged or child.disable_adapters or not isinstance(child.get_base_layer(), nn.Linear):
                        walk(child)
                    else:
                        out.append(child)
                elif type(child) is nn.Linear:
                    out.append(child)
                else:
                    walk(child)

        walk(lm)
        ok = all(w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16)
                 for m in out for w in self._sources(m))
        return out if ok else []

    def _sources(self, module: nn.Module) -> list[Tensor]:
        if isinstance(module, nn.Linear):
            return [module.weight] + ([module.bias] if module.bias is not None else [])
        base = module.get_base_layer()
        tensors = [base.weight] + ([base.bias] if base.bias is not None else [])
        for name in module.active_adapters:
            if name in module.lora_A:
                tensors += [module.lora_A[name].weight, module.lora_B[name].weight]
        return tensors

    def _packed(self, module: nn.Module) -> tuple[Tensor, Tensor | None]:
        key = change_key(self._sources(module))
        hit = self._cache.get(id(module))
        if hit is not None and hit[0] == key:
            return hit[1], hit[2]
        with torch.no_grad():
            if isinstance(module, nn.Linear):
                weight, bias = module.weight, module.bias
            else:
                base = module.get_base_layer()
                adapters = [a for a in module.active_adapters if a in module.lora_A]
                weight, bias = merged_lora_weight(module, adapters), base.bias
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 8)
            bias = bias.detach() if bias is not None else None
        frozen = not any(t.requires_grad for t in self._sources(module))
        self._cache[id(module)] = (key, packed, bias, frozen)
        self.packs += 1
        return packed, bias
