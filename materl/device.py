"""Where materl's tensors live and in which precision they compute: the one place that decides.

    device = resolve_device(None)                 # cuda when present, else cpu
    dtype = compute_dtype(device, None)           # bf16 on CUDA, fp32 on CPU
    with autocast(device, dtype): ...             # bf16 matmuls over fp32 weights (a no-op for fp32)
    ids = on_device(ids_B_T, like=weight)         # one explicit move, never an implicit one

Precision. Weights and optimizer state stay in the dtype they were loaded in (fp32 by default:
the master weights); a forward computes in ``compute_dtype`` under ``torch.autocast``, which is
the documented equivalent of bf16 compute with fp32 master weights (TRL/accelerate
``mixed_precision="bf16"``, verl's FSDP ``mixed_precision`` with ``param_dtype=bf16``): matmuls
and attention run in bf16, reductions such as log_softmax in fp32, gradients reach fp32 weights.
On a CPU the default is fp32, which keeps every CPU number bit for bit what it was.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from materl.errors import ConfigError, DeviceError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Compute dtypes by name (the ``dtype`` of a config's ``model`` section and ``--dtype``)."""


def cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a ``torch.device``; ``None``: ``cuda`` when CUDA is present, else ``cpu``.
    A CUDA device asked for on a machine without one is a ``DeviceError``."""
    if device is None:
        return torch.device("cuda" if cuda_available() else "cpu")
    try:
        out = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise DeviceError(f"device {device!r} is not a torch device; valid: 'cpu', 'cuda', 'cuda:N' "
                          f"or None (cuda when present)") from exc
    if out.type == "cuda" and not cuda_available():
        raise DeviceError(f"device {device!r} asked for, but this torch ({torch.__version__}) sees no CUDA "
                          f"device; use device='cpu' or None")
    return out


def compute_dtype(device: torch.device, dtype: str | torch.dtype | None) -> torch.dtype:
    """The dtype forwards compute in: ``dtype`` (a name in :data:`DTYPES` or a torch dtype), or
    by default bf16 on CUDA and fp32 elsewhere."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)} or None (bf16 on CUDA, "
                              f"fp32 on CPU)")
        return DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise ConfigError(f"unsupported compute dtype {dtype}; valid: {', '.join(DTYPES)}")
    return dtype


def autocast(device: torch.device, dtype: torch.dtype) -> AbstractContextManager:
    """``torch.autocast(device.type, dtype)`` for a lower-precision compute dtype; a no-op
    context for fp32 (then nothing about the computation changes)."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def on_device(t: torch.Tensor, *, like: torch.Tensor | torch.device) -> torch.Tensor:
    """``t`` on the device of ``like`` (a tensor or a device): one explicit copy if it is elsewhere."""
    device = like.device if isinstance(like, torch.Tensor) else like
    return t if t.device == device else t.to(device, non_blocking=t.device.type == "cpu" and device.type == "cuda")


def check_same_device(what: str, t: torch.Tensor, expected: torch.device | torch.Tensor, *, where: str) -> None:
    """A ``DeviceError`` naming ``what`` and ``where`` when ``t`` is not on ``expected``."""
    device = expected.device if isinstance(expected, torch.Tensor) else expected
    if t.device != device:
        raise DeviceError(f"{what} is on {t.device} but the model it feeds is on {device} ({where}); move the "
                          f"batch to the model's device once (materl.device.on_device) before the forward")


def cuda_graph_thread() -> None:
    """Make this thread able to run ``torch.compile(mode="reduce-overhead")`` functions.

    torch's CUDA-graph trees keep their tree managers in thread-local storage. Before torch 2.12
    that storage was filled only in the thread that imported ``torch._inductor.cudagraph_trees``
    (and the autograd threads it starts), so a captured function called from any other thread
    (materl's compute thread, when HF ``generate`` or anything else compiled first in the main
    thread) fails with a bare ``AssertionError`` in ``cudagraph_trees.get_obj`` (seen on torch
    2.11 on an H200). This fills this thread's storage the way torch >= 2.12 does on first use;
    a no-op where it is filled already. Graphs recorded in one thread are replayed in that thread
    (materl runs each engine's and each learner's captured work in its one compute thread)."""
    import threading
    from collections import defaultdict

    from torch._inductor import cudagraph_trees as trees

    if hasattr(trees.local, "tree_manager_containers") or torch._C._is_key_in_tls("tree_manager_containers"):
        return
    trees.local.tree_manager_containers = {}
    trees.local.tree_manager_locks = defaultdict(threading.Lock)
    torch._C._stash_obj_in_tls("tree_manager_containers", trees.local.tree_manager_containers)
    torch._C._stash_obj_in_tls("tree_manager_locks", trees.local.tree_manager_locks)
