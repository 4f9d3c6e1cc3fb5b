"""Whether a tensor's values may have changed since an engine last read them.

    key = change_key(tensors)    # compare with the key saved when a copy or cache was made

A tensor's key is its storage address, its in-place version counter and how many optimizer steps
have run over it. The version counter alone misses updates: a fused optimizer step
(``torch.optim.AdamW(fused=True)``) writes the parameters without bumping it (measured: +0 fused,
+2 unfused), so an engine keyed on it alone kept serving prefixes cached under, and LoRA weights
merged from, the weights before the update. Every optimizer's ``step()`` is counted per parameter
by a global post-step hook (``torch.optim.optimizer.register_optimizer_step_post_hook``, once, when
this module is imported), whichever optimizer and loop ran it.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_post_hook

STEPS = "_materl_optimizer_steps"  # the count, an attribute of each stepped parameter (a dict lookup to read)


def _count_step(optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            setattr(p, STEPS, getattr(p, STEPS, 0) + 1)


_HOOK = register_optimizer_step_post_hook(_count_step)


def change_key(tensors: Iterable[Tensor]) -> tuple:
    """Equal keys: no tensor was replaced, written in place or stepped by an optimizer between."""
    return tuple((t.data_ptr(), t._version, getattr(t, STEPS, 0)) for t in tensors)
