"""CUDA-graph replay of the learner's forwards: ``ml.compile(..., cuda_graphs=True)``.

With ``cuda_graphs=True`` the learner batch is padded to static shapes (lengths rounded up to a
power-of-two bucket, ``sequences.bucket``; right padding with mask 0) and each trainable agent's
log-prob forward (decoder, hidden-state gather and the chunked LM-head log-softmax) runs through
``torch.compile(mode="reduce-overhead", dynamic=False)``: torch's CUDA-graph trees capture the
forward and its backward once per shape bucket and replay them on every later micro-batch of that
shape (verl/TRL have no learner-side equivalent; it is torch's documented way to cut per-kernel
launch overhead). Prompt sharing is off under it (its prefix pass has data-dependent shapes).

Why torch.compile and not a Mojo GPU kernel: materl's Mojo kernels are CPU code called through a C
ABI with ctypes; they cannot launch on torch's current CUDA stream, so a CUDA graph could not
capture them. Inductor's Triton kernels can, and fuse the log-softmax pieces the same way.

Without CUDA the same path runs with ``capture=False`` (the plain function on the same static
shapes), which is what the CPU tests compare with the eager learner. ``cuda_graphs=True`` on a
machine or agent without CUDA is a ``CompileError`` (``check``), never silently eager.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from materl.device import cuda_graph_thread
from materl.errors import CompileError

_GRAPHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: GraphedForward}


def check(agents: Mapping[str, Any]) -> None:
    """Refuse ``cuda_graphs=True`` where it cannot capture: no CUDA, or a trainable agent that is
    not on a CUDA device."""
    if not torch.cuda.is_available():
        raise CompileError(f"cuda_graphs=True needs CUDA: torch {torch.__version__} sees no CUDA device here; "
                           f"compile with cuda_graphs=False (the default)")
    off = {n: str(a.device) for n, a in agents.items() if getattr(a, "trainable", False) and a.device.type != "cuda"}
    if off:
        raise CompileError(f"cuda_graphs=True captures the learner's forwards on CUDA, but trainable agents "
                           f"{off} are not on a CUDA device; create them with device='cuda' (the default "
                           f"where CUDA is present)")


class GraphedForward:
    """``fn`` over tensors, captured once per input-shape bucket and replayed (``capture``), or
    ``fn`` itself on the same static shapes (``capture=False``)."""

    def __init__(self, fn: Callable[..., Tensor | tuple[Tensor, ...]], *, capture: bool):
        self.fn = fn
        self.capture = capture
        self.run = torch.compile(fn, mode="reduce-overhead", dynamic=False) if capture else fn
        self.shapes: set[tuple] = set()  # the buckets seen (one captured graph each)

    def __call__(self, *tensors: Tensor):
        self.shapes.add(tuple(tuple(t.shape) for t in tensors))
        if self.capture:
            cuda_graph_thread()
        out = self.run(*tensors)
        if not self.capture:
            return out
        # a replay overwrites its output buffers: keep copies (differentiable) of what the step holds
        return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()


def graphed(model: torch.nn.Module, key: Any, make: Callable[[], Callable], *, capture: bool) -> GraphedForward:
    """The ``GraphedForward`` of ``make()`` for ``model`` under ``key``, made once per model (its
    captured graphs live as long as the model)."""
    table = _GRAPHED.setdefault(model, {})
    if key not in table:
        table[key] = GraphedForward(make(), capture=capture)
    return table[key]


def step_begin(capture: bool) -> None:
    """A new micro-step: earlier replays' outputs may be overwritten from here on."""
    if capture:
        cuda_graph_thread()
        torch.compiler.cudagraph_mark_step_begin()
