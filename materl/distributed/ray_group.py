"""Learner ranks as Ray actors (``pip install "materl[ray]"``): N actors form one torch.distributed
group and learn together; the driver sends each step's batch once, through the object store.

    group = LearnerGroup(2, ctx.options, agents=ctx.agents, strategy="fsdp2")   # ray_address=... for a cluster
    result = group.step(episodes, ctx)               # rank 0's RankUpdate: version, metrics, weights
    result.weights.load_into(rollout_agents)         # publish (the weights came through the object store)
    state = group.state()                            # for save_checkpoint (see StateHolder)
    group.shutdown()

Ray: a group uses the Ray the process has (``ray.init(...)`` called before); without one it calls
``ray.init(address=ray_address)``: ``None`` starts a local cluster (or joins ``$RAY_ADDRESS``),
``"ray://head:10001"`` or ``"auto"`` joins an existing one. Shutting Ray down is the caller's.
Without Ray installed, constructing a group raises ``ExtraNotInstalledError``.

``agents``: a mapping of ``AgentSpec`` (a step context's ``ctx.agents``; built in float32: a spec
carries no dtype), or a picklable function that returns the agents by name (module-level, or a
``functools.partial`` of one), called in each actor after its process group is up. Each actor
reserves ``num_cpus`` CPUs (torch uses that many threads) and ``num_gpus`` GPUs (then NCCL on
the GPU Ray assigned it, untested here: no GPU); ``actor_options`` go to Ray's ``.options()``
(``runtime_env``, ``scheduling_strategy`` with a placement group, ...).

Faults. A rank whose actor dies (``kill -9``, out of memory, a lost node) or raises stops the
group: every actor is killed and ``LearnerRankError`` names the rank (its pid, what it was
doing, Ray's reason) -- a rank that died is named over ranks whose collectives then failed. The
group is not reusable after that: start a new one and ``load_state`` the last checkpoint.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from materl.compiler.context import AgentSpec, StepContext
from materl.compiler.episode import Episode
from materl.compiler.options import CompileOptions
from materl.distributed.errors import ExtraNotInstalledError, LearnerGroupClosedError, LearnerRankError
from materl.distributed.learner import STRATEGIES, DistributedLearner, RankUpdate
from materl.distributed.state import LearnerState
from materl.distributed.torchrun import free_port, init_process_group
from materl.errors import ConfigError
from materl.pids import alive

Agents = Mapping[str, AgentSpec] | Callable[[], Mapping[str, Any]]

GRACE_S = 10.0  # after one rank fails, how long the others get to report why


def require_ray():
    """The ``ray`` module, or ``ExtraNotInstalledError`` naming the extra that installs it."""
    try:
        import ray
    except ImportError as exc:
        raise ExtraNotInstalledError('learner ranks on Ray need Ray: pip install "materl[ray]" '
                                     f"(import failed: {exc})") from exc
    return ray


STOP_WAIT_S = 10.0


class _Rank:
    """One learner rank in a Ray actor (``ray.remote(_Rank)``): joins the group, builds its
    agents and a ``DistributedLearner``, then runs what the driver asks, step by step."""

    def __init__(self, num_threads: int):
        torch.set_num_threads(num_threads)
        self.learner = None

    def pid(self) -> int:
        return os.getpid()

    def address(self) -> tuple[str, int]:
        """This node's address and a free port (rank 0's are the group's rendezvous)."""
        return require_ray().util.get_node_ip_address(), free_port()

    def setup(self, rank: int, world_size: int, master: tuple[str, int], options: CompileOptions, agents: Any,
              strategy: str, gpu: bool, timeout_s: float) -> int:
        device = "cuda:0" if gpu else "cpu"  # Ray makes the actor's GPU its only visible one
        init_process_group(rank, world_size, master_addr=master[0], master_port=master[1], device=device,
                           timeout_s=timeout_s)
        built = dict(agents()) if callable(agents) else {n: spec.build() for n, spec in agents.items()}
        self.learner = DistributedLearner(built, options, strategy=strategy, device=device)
        return os.getpid()

    def step(self, episodes: list[Episode], ctx: StepContext, lrs: Mapping[str, list[float]] | None = None) -> RankUpdate:
        return self.learner.step(episodes, ctx, lrs)

    def skip(self) -> int:
        return self.learner.skip()

    def state(self) -> LearnerState | None:
        return self.learner.state()

    def load_state(self, state: LearnerState) -> int:
        self.learner.load_state(state)
        return self.learner.version


class LearnerGroup:
    """``world_size`` learner ranks as Ray actors; see the module docstring."""

    def __init__(self, world_size: int, options: CompileOptions, *, agents: Agents, strategy: str = "fsdp2",
                 num_cpus: float = 1, num_gpus: float = 0, ray_address: str | None = None,
                 actor_options: Mapping[str, Any] | None = None, timeout_s: float = 600.0):
        ray = require_ray()
        _check_arguments(world_size, agents, strategy)
        if not ray.is_initialized():
            from materl.distributed.ray_workers import connect

            connect(ray_address)  # a local cluster listens on 127.0.0.1 only
        elif ray_address is not None:
            raise ConfigError(f"LearnerGroup(ray_address={ray_address!r}): this process already runs Ray (ray.init "
                              "was called), so the address would be ignored; leave it out, or ray.shutdown() first")
        self.world_size, self.version = world_size, 0
        self.failure: LearnerRankError | None = None  # what stopped the group, once one rank failed
        remote = ray.remote(_Rank).options(num_cpus=num_cpus, num_gpus=num_gpus, **dict(actor_options or {}))
        self.actors = [remote.remote(max(1, int(num_cpus))) for _ in range(world_size)]
        self.pids: list[int | None] = [None] * world_size
        self.local_pids: list[int] = []  # the ranks' processes on this machine (``shutdown`` waits for them)
        self.pids = self._all("start-up", lambda a, r: a.pid.remote())
        addresses = self._all("finding the rendezvous", lambda a, r: a.address.remote())
        here = ray.util.get_node_ip_address()
        self.local_pids = [pid for pid, (ip, _) in zip(self.pids, addresses) if ip == here]
        master = addresses[0]
        self._all("set up", lambda a, r: a.setup.remote(r, world_size, master, options, agents, strategy,
                                                          num_gpus > 0, timeout_s))

    def step(self, episodes: list[Episode], ctx: StepContext,
             lrs: Mapping[str, list[float]] | None = None) -> RankUpdate:
        """One learner step on every rank; rank 0's ``RankUpdate`` (with the new weights).
        ``lrs``: the optimizers' learning rates for this step (``DistributedLearner.step``)."""
        ray = require_ray()
        eps, context = ray.put(episodes), ray.put(ctx)  # stored once; each actor reads them
        results = self._all(f"the step to version {self.version + 1}", lambda a, r: a.step.remote(eps, context, lrs))
        self.version = results[0].version
        return results[0]

    def skip(self) -> None:
        """Every rank counts a step that made no update (``DistributedLearner.skip``)."""
        self.version = self._all(f"skipping the step to version {self.version + 1}", lambda a, r: a.skip.remote())[0]

    def state(self) -> LearnerState:
        """The full model and optimizer states (for a checkpoint: ``runtime.checkpoint`` saves
        the models through agents and the optimizer states through ``state.StateHolder``)."""
        return self._all("gathering the state", lambda a, r: a.state.remote())[0]

    def load_state(self, state: LearnerState) -> None:
        """Every rank loads ``state`` (e.g. the last checkpoint's); the next step is version + 1."""
        ref = require_ray().put(state)
        self._all("loading a state", lambda a, r: a.load_state.remote(ref))
        self.version = state.version

    def shutdown(self) -> None:
        """Kill every rank's actor and wait (at most ``STOP_WAIT_S``) until the processes of those
        on this machine have ended: ``ray.kill`` only asks. The group cannot be used after this."""
        ray = require_ray()
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        deadline = time.monotonic() + STOP_WAIT_S
        for pid in self.local_pids:
            while time.monotonic() < deadline and alive(pid, count_self=False):
                time.sleep(0.02)

    # -- every rank at once, failing as one --
    def _all(self, what: str, call) -> list:
        ray = require_ray()
        if not self.actors:
            why = f"after {self.failure}" if self.failure else "by shutdown()"
            raise LearnerGroupClosedError(f"this learner group was stopped {why}; start a new LearnerGroup (and "
                                          "load_state the last checkpoint) to go on")
        pending = {call(a, r): r for r, a in enumerate(self.actors)}
        results: list = [None] * self.world_size
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            rank = pending.pop(ready[0])
            try:
                results[rank] = ray.get(ready[0])
            except ray.exceptions.RayError as exc:
                self._fail(what, {rank: exc}, pending)
        return results

    def _fail(self, what: str, failures: dict, pending: dict) -> None:
        """Collect the other ranks' outcomes for a moment, kill the group, raise naming the rank."""
        ray = require_ray()
        if pending:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=GRACE_S)
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as exc:
                    failures[pending[ref]] = exc
        died = [r for r, e in failures.items() if isinstance(e, ray.exceptions.RayActorError)]
        rank = min(died) if died else min(failures)
        self.shutdown()
        how = "died" if rank in died else "failed"
        others = ", ".join(f"rank {r}: {_short(e)}" for r, e in sorted(failures.items()) if r != rank)
        self.failure = LearnerRankError(
            f"learner rank {rank} (pid {self.pids[rank]}) {how} during {what}: {_short(failures[rank])}"
            + (f"; then {others}" if others else "") + ". The learner group is stopped; resume from the last "
            "checkpoint with a new LearnerGroup and load_state.", rank=rank, pid=self.pids[rank])
        raise self.failure


def _check_arguments(world_size: Any, agents: Any, strategy: str) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"LearnerGroup world_size must be an int >= 1, got {world_size!r}")
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown learner strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
    if not callable(agents) and not (isinstance(agents, Mapping) and agents
                                     and all(isinstance(a, AgentSpec) for a in agents.values())):
        raise ConfigError(f"LearnerGroup agents must be a mapping of AgentSpec (a step context's ctx.agents) or a "
                          f"function returning the agents by name; got {type(agents).__name__}")


def _short(exc: BaseException, limit: int = 400) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit] + " ..."
