"""Full (unsharded) tensors in and out of a learner rank: the weights it publishes after each
step, and the state a checkpoint holds.

Under FSDP2 each rank holds one shard of every parameter and of its optimizer state (DTensors);
``full`` all-gathers one (a collective: every rank calls it, in the same order). Under DDP, or
in one process, tensors are already whole and nothing is communicated.

Optimizer states keep torch's own layout (``state`` keyed by parameter index, ``param_groups``),
so a state saved by a 2-rank FSDP2 learner loads into a 1-process ``ml.compile`` step, a DDP
learner or an FSDP2 learner of another size, and the other way round.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from materl.errors import ConfigError


@dataclass(frozen=True)
class Weights:
    """The trainable weights after step ``version`` (version n: n steps taken, a skipped one too):
    agent name -> parameter name (as in ``agent.model.named_parameters()``) -> CPU tensor.
    LoRA agents publish their adapters (and value head), full fine-tuning every parameter."""
    version: int
    tensors: Mapping[str, Mapping[str, Tensor]]

    def load_into(self, agents: Mapping[str, Any]) -> None:
        """Copy the weights into ``agents[name].model`` (e.g. a rollout worker's agents); every
        published name must exist there."""
        for name, tensors in self.tensors.items():
            if name not in agents:
                raise ConfigError(f"weights v{self.version} are for agent {name!r}; agents given: "
                                  f"{', '.join(agents) or '(none)'}")
            params = dict(agents[name].model.named_parameters())
            unknown = sorted(set(tensors) - set(params))
            if unknown:
                raise ConfigError(f"weights v{self.version} of agent {name!r} name parameters the model lacks: "
                                  f"{unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
            with torch.no_grad():
                for key, value in tensors.items():
                    params[key].copy_(value)


@dataclass(frozen=True)
class LearnerState:
    """What a checkpoint holds of a learner: the version, each trainable agent's full model
    state dict and its optimizer's full state dict (torch's layout)."""
    version: int
    models: Mapping[str, Mapping[str, Tensor]]
    optimizers: Mapping[str, Mapping[str, Any]]


class StateHolder:
    """A state dict with ``state_dict``/``load_state_dict``, so ``runtime.checkpoint``'s
    ``save_checkpoint``/``restore`` can save and load a learner's optimizer states, which live
    on the ranks, from the driver."""

    def __init__(self, state: Mapping[str, Any] | None = None):
        self.state = state

    def state_dict(self) -> Mapping[str, Any]:
        if self.state is None:
            raise ConfigError("this StateHolder is empty: load a checkpoint into it, or give it a state")
        return self.state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.state = state


def full(t: Tensor) -> Tensor:
    """A CPU copy of the whole tensor (all-gathered when ``t`` is sharded: a collective)."""
    t = t.detach()
    if isinstance(t, DTensor):
        t = t.full_tensor()
    elif t.device.type == "cpu":
        return t.clone()
    return t.cpu()


def like(value: Tensor, target: Tensor) -> Tensor:
    """``value`` (whole) laid out as ``target``: this rank's shard when ``target`` is sharded
    (cut locally: every rank holds the whole ``value``; no communication)."""
    value = value.to(device=target.device, dtype=target.dtype)
    if isinstance(target, DTensor):
        return distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
    return value


def trainable_weights(model: nn.Module, *, keep: bool) -> dict[str, Tensor]:
    """Full copies of ``model``'s trainable parameters; ``keep=False`` (ranks other than 0)
    joins the all-gathers but keeps nothing."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            t = full(p)
            if keep:
                out[name] = t
    return out


def full_model_state(model: nn.Module, *, keep: bool) -> dict[str, Tensor]:
    out = {}
    for name, t in model.state_dict().items():
        t = full(t)
        if keep:
            out[name] = t
    return out


def load_model_state(model: nn.Module, state: Mapping[str, Tensor]) -> None:
    targets = model.state_dict()
    missing, unknown = sorted(set(targets) - set(state)), sorted(set(state) - set(targets))
    if missing or unknown:
        raise ConfigError(f"model state does not match the model: missing {missing[:5]}, unknown {unknown[:5]}")
    model.load_state_dict({k: like(v, targets[k]) for k, v in state.items()})


def full_optimizer_state(opt: torch.optim.Optimizer, *, keep: bool) -> dict[str, Any]:
    sd = opt.state_dict()
    state = {}
    for idx, entry in sd["state"].items():
        gathered = {k: full(v) if isinstance(v, Tensor) else v for k, v in entry.items()}
        if keep:
            state[idx] = gathered
    return {"state": state, "param_groups": sd["param_groups"]} if keep else {}


def load_optimizer_state(opt: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Load a full optimizer state: per-parameter tensors shaped like their parameter are cut
    to this rank's shard; scalars (Adam's ``step``) stay whole."""
    params = [p for g in opt.param_groups for p in g["params"]]
    entries = {}
    for idx, entry in state["state"].items():
        p = params[int(idx)]
        entries[idx] = {k: like(v, p) if isinstance(v, Tensor) and v.shape == p.shape and v.dim() else v
                        for k, v in entry.items()}
    opt.load_state_dict({"state": entries, "param_groups": state["param_groups"]})
