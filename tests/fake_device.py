"""A fake accelerator on a CPU build: tensors with shapes, dtypes and a non-CPU device but no
data (``torch._subclasses.fake_tensor``), and a ``FakeTensorDeviceMismatchError`` wherever one of
them meets a CPU tensor, so a tensor made without ``device=`` is caught.

The device is torch's PrivateUse1 slot registered as a Python backend named "fakegpu", not
"cuda": a CPU build has no CUDA device guard, so fake "cuda" tensors fail on view ops (the
``x[..., None]`` in every rotary embedding) and abort the process in autograd, while the
Python backend provides a guard. What works: tensors created on the device inside the mode and
forwards under ``torch.no_grad()``. Not: ``.to(device)`` of a real tensor, backward, reading
values (``float``, ``.tolist()``)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

NAME = "fakegpu"


def fake_device() -> torch.device:
    """The fake accelerator ("fakegpu:0"), registered on first use (once per process)."""
    if torch._C._get_privateuse1_backend_name() != NAME:
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend(NAME)
        # torch.utils.checkpoint's recompute builds an autocast context for every registered
        # backend; without this answer it fails there once the fake device exists in the process
        # (gradient checkpointing tests running after a fake-device test).
        getattr(torch, NAME).get_amp_supported_dtype = lambda: [torch.float16, torch.bfloat16]
    return torch.device(NAME, 0)


def fake(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    """A fake tensor on the fake accelerator with ``t``'s shape, dtype and strides."""
    return FakeTensor(mode, t.detach().to("meta"), fake_device())


def fake_module(mode: FakeTensorMode, module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with every parameter and buffer on the fake accelerator, in place."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                sub._parameters[name] = torch.nn.Parameter(fake(mode, p), requires_grad=p.requires_grad)
        for name, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[name] = fake(mode, b)
    return module
