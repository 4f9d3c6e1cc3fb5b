"""Policy versions and how their weights travel from the learner to the rollout side.

The version of a policy is the number of optimizer steps applied to it: the initial weights are
version 0 and step k (counting from 0) turns version k into k + 1. After each step the learner
publishes the trainable weights (for a LoRA policy, the adapters only: what changed) under the
new version; a rollout worker loads the version it is told to sample from, and every token it
generates carries that version (``Step.metadata["version"]``).

    store = InProcessStore()                                  # one node, one process
    store.publish(3, version_state(agents, ["policy"]))
    load_version(rollout_agents, store.get(3), version=3)     # in place; engines re-read them

Transports (one interface, ``WeightStore``): ``InProcessStore`` (tensors kept in memory, for
workers in the learner's process), ``RayObjectStore`` (``ray.put`` once per version, workers
``ray.get`` it: Ray's shared-memory object store on one node, its transfer between nodes on a
cluster) and ``DiskStore`` (safetensors files in a folder every worker can read: a shared
filesystem on a cluster). A store keeps the versions it is told to ``retain``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from materl.errors import ConfigError


class WeightStore(Protocol):
    def publish(self, version: int, state: Mapping[str, Tensor]) -> float:
        """Make ``state`` available as ``version``; returns the seconds it took."""

    def get(self, version: int) -> Mapping[str, Tensor]: ...

    def versions(self) -> list[int]: ...

    def retain(self, keep: Iterable[int]) -> None:
        """Forget every version not in ``keep``."""


def version_state(agents: Mapping[str, Any], names: Iterable[str]) -> dict[str, Tensor]:
    """What a new version carries: the parameters a learner step changes (all of them, a LoRA
    policy's adapters, a critic's head) of the named agents, as ``"<agent>/<parameter>"``."""
    return {f"{a}/{n}": p.detach() for a in names for n, p in agents[a].model.named_parameters() if p.requires_grad}


def load_version(agents: Mapping[str, Any], state: Mapping[str, Tensor], *, version: int) -> None:
    """Copy a version's tensors into the agents' parameters in place, then have their engines
    follow (in-place readers see them at once; the others drop packed copies) and record the
    version their generations are tagged with. Call it where decoding runs (the compute thread),
    so weights never change in the middle of a decode batch."""
    by_agent: dict[str, dict[str, Tensor]] = {}
    for key, value in state.items():
        agent, _, name = key.partition("/")
        by_agent.setdefault(agent, {})[name] = value
    for agent_name, tensors in by_agent.items():
        agent = agents[agent_name]
        params = dict(agent.model.named_parameters())
        missing = sorted(set(tensors) - set(params))
        if missing:
            raise ConfigError(f"version {version} names parameters agent {agent_name!r} does not have: {missing[:5]}")
        with torch.no_grad():
            for name, value in tensors.items():
                params[name].copy_(value)
        agent.sync_engine()
        agent.policy_version = version


class InProcessStore:
    """Versions as cloned tensors in this process (workers that share the learner's process)."""

    def __init__(self) -> None:
        self._states: dict[int, dict[str, Tensor]] = {}

    def publish(self, version: int, state: Mapping[str, Tensor]) -> float:
        t0 = time.perf_counter()
        self._states[version] = {k: v.detach().clone() for k, v in state.items()}
        return time.perf_counter() - t0

    def get(self, version: int) -> Mapping[str, Tensor]:
        return _lookup(self._states, version)

    def versions(self) -> list[int]:
        return sorted(self._states)

    def retain(self, keep: Iterable[int]) -> None:
        keep = set(keep)
        for v in [v for v in self._states if v not in keep]:
            del self._states[v]


class DiskStore:
    """Versions as ``<folder>/v<version>.safetensors`` (written to a temporary name, then renamed,
    so a reader never sees half a file): any process that can read the folder can load them."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, version: int) -> Path:
        return self.folder / f"v{version}.safetensors"

    def publish(self, version: int, state: Mapping[str, Tensor]) -> float:
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        tmp = self.folder / f".v{version}.{os.getpid()}.tmp"
        save_file({k: v.detach().contiguous() for k, v in state.items()}, str(tmp))
        os.replace(tmp, self._path(version))
        return time.perf_counter() - t0

    def get(self, version: int) -> Mapping[str, Tensor]:
        from safetensors.torch import load_file

        path = self._path(version)
        if not path.exists():
            raise ConfigError(f"no weights of version {version} in {self.folder}; have {self.versions()}")
        return load_file(str(path))

    def versions(self) -> list[int]:
        return sorted(int(p.stem[1:]) for p in self.folder.glob("v*.safetensors"))

    def retain(self, keep: Iterable[int]) -> None:
        keep = set(keep)
        for v in self.versions():
            if v not in keep:
                self._path(v).unlink(missing_ok=True)


class RayObjectStore:
    """Versions as Ray object references (``ray.put`` once; every actor ``ray.get``s the same
    shared-memory object on its node). The store object itself is what workers are handed."""

    def __init__(self) -> None:
        self._refs: dict[int, Any] = {}

    def publish(self, version: int, state: Mapping[str, Tensor]) -> float:
        import ray

        t0 = time.perf_counter()
        self._refs[version] = ray.put({k: v.detach().contiguous() for k, v in state.items()})
        return time.perf_counter() - t0

    def ref(self, version: int) -> Any:
        return _lookup(self._refs, version)

    def get(self, version: int) -> Mapping[str, Tensor]:
        import ray

        return ray.get(self.ref(version))

    def versions(self) -> list[int]:
        return sorted(self._refs)

    def retain(self, keep: Iterable[int]) -> None:
        keep = set(keep)
        for v in [v for v in self._refs if v not in keep]:
            del self._refs[v]


def _lookup(table: Mapping[int, Any], version: int) -> Any:
    if version not in table:
        raise ConfigError(f"no weights of version {version}; published: {sorted(table)}")
    return table[version]
