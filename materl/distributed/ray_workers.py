"""Rollout workers as Ray actors (``pip install "materl[ray]"``).

    store, workers = ray_workers(compiled, 2)                       # a local Ray cluster
    store, workers = ray_workers(compiled, 8, ray_address="auto")   # an existing one

Each actor gets the frozen step context once (its plan, options and agent specs, pickled), builds
its own rollout agents from the specs (engines included; trainable ones as frozen copies that
follow the published versions) and its own services from the plan's specs (tool servers, agent
endpoints, judges: ``materl.compiler.services``; a toolbox travels as its description). They
are closed when it is closed, and its tool servers die with it if its process is killed (each
server is its child process: a stdio pipe that closes).

Weights: with ``transport="object_store"`` the learner ``ray.put``s each version once and a job
carries the reference to the version it samples from (an actor fetches it only when it does
not hold that version yet; on one node that is a read from Ray's shared memory); with
``transport="disk"`` versions are safetensors files in a folder every actor can read.

``RayWorker`` is the driver's handle with ``LocalWorker``'s interface (``run``, ``aclose``,
``load``), so the pipeline treats both alike. A killed actor surfaces as Ray's
``RayActorError`` from ``run``; the pipeline re-queues its groups on another worker (and
stops with ``RolloutWorkersLostError`` once none is left).

A local cluster (no ``ray_address``, no ``$RAY_ADDRESS``) listens on 127.0.0.1 only
(``start_local_cluster``); when its actors' threads and the learner's exceed the machine's
cores, ``ray_workers`` warns with the figures.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from materl.compiler.context import StepContext
from materl.compiler.episode import Episode
from materl.distributed.versions import DiskStore, RayObjectStore, WeightStore
from materl.distributed.workers import Job, LocalWorker, rollout_agent_names
from materl.engines import ENGINES
from materl.errors import ConfigError

if TYPE_CHECKING:
    from materl.compiler.compiled import Compiled

TRANSPORTS = ("object_store", "disk")
LOOPBACK = "127.0.0.1"
log = logging.getLogger(__name__)


def import_ray():
    """``ray``, or a ConfigError naming the extra that installs it."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(f"rollout workers on Ray need Ray: pip install \"materl[ray]\" ({exc})") from None
    return ray


def connect(ray_address: str | None = None, *, num_cpus: int | None = None) -> Any:
    """Join the cluster at ``ray_address`` (``"auto"``, ``"ray://head:10001"``, or
    ``$RAY_ADDRESS``) or start a local one (``num_cpus`` logical CPUs, default the machine's)
    that listens on 127.0.0.1 only; a no-op if already connected. The local cluster's workers
    see this process's ``sys.path``, so recipes and reward functions defined in your own
    modules unpickle there."""
    ray = import_ray()
    if ray.is_initialized():
        return ray
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}}
    if ray_address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=ray_address, runtime_env=env, log_to_driver=True)
    else:
        start_local_cluster(ray, num_cpus=num_cpus or os.cpu_count() or 1, runtime_env=env, log_to_driver=True)
    return ray


def start_local_cluster(ray: Any, **init_kwargs: Any) -> None:
    """``ray.init`` a new single-node cluster whose services (GCS, raylet, object manager,
    agents, workers) listen on 127.0.0.1 only, without the dashboard: Ray's services have no
    authentication of their own worth relying on (the ShadowRay attacks), so a cluster materl
    starts for its user must not be reachable from the network. ``ray.init`` turns
    ``_node_ip_address="127.0.0.1"`` into the machine's address unless Ray treats the machine
    as a laptop (``ENABLE_RAY_CLUSTER`` false, as on macOS and Windows), which this does for the
    duration of the call; with a loopback node address Ray's gRPC servers bind 127.0.0.1."""
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(_node_ip_address=LOOPBACK, include_dashboard=False, **init_kwargs)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def warn_if_oversubscribed(workers: int, threads: int) -> str | None:
    """Warn (and return the message) when ``workers`` rollout actors of ``threads`` torch
    threads each, plus this process's own torch threads (the learner), ask for more threads
    than the machine has cores: they then take turns on the cores and every step is slower
    than in one process (measured: 2 workers on 2 cores, 200 s against 58 s)."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    driver = torch.get_num_threads()
    total = workers * threads + driver
    if total <= cores:
        return None
    message = (f"materl: {workers} rollout worker(s) x {threads} torch thread(s) + {driver} learner thread(s) in this "
               f"process = {total} threads on {cores} CPU core(s): they will compete for the cores and run slower "
               f"than sampling in this process; use fewer workers (distributed.workers), or a machine or cluster "
               f"with more cores")
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    log.warning("%s", message)
    return message


def ray_workers(compiled: Compiled, n: int, *, ray_address: str | None = None, transport: str = "object_store",
                folder: str | None = None, num_cpus: float = 1) -> tuple[WeightStore, list[RayWorker]]:
    """``n`` rollout actors for ``compiled`` and the weight store they read; each actor reserves
    ``num_cpus`` CPUs and runs torch with that many threads."""
    if n < 1:
        raise ConfigError(f"workers must be >= 1 for Ray rollout workers, got {n}")
    if transport not in TRANSPORTS:
        raise ConfigError(f"weight transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    if transport == "disk" and not folder:
        raise ConfigError("weight transport 'disk' needs a folder every worker can read")
    ctx = compiled.context()
    for name in rollout_agent_names(ctx):
        if ctx.agents[name].source is None:
            raise ConfigError(f"agent {name!r} was built from a module object: a Ray worker cannot rebuild it; "
                              f"give the Agent a model name or folder")
    if not ray_address and not os.environ.get("RAY_ADDRESS") and not import_ray().is_initialized():
        warn_if_oversubscribed(n, max(1, int(num_cpus)))  # the local cluster materl starts shares these cores
    ray = connect(ray_address, num_cpus=max(n + 2, os.cpu_count() or 1))
    store: WeightStore = RayObjectStore() if transport == "object_store" else DiskStore(folder)
    actor_cls = ray.remote(num_cpus=num_cpus, max_restarts=0)(RolloutActor)
    o = compiled.options
    workers = []
    for i in range(n):
        actor = actor_cls.options(name=None).remote(ctx, name=f"rollout-{i}", partial_rollouts=o.partial_rollouts,
                                                    deterministic=o.deterministic,
                                                    folder=folder if transport == "disk" else None,
                                                    threads=max(1, int(num_cpus)))
        workers.append(RayWorker(actor, store, name=f"rollout-{i}"))
    ray.get([w.actor.ready.remote() for w in workers])  # agents built and tool servers up, or raise here
    return store, workers


class RolloutActor:
    """The actor's side: a ``LocalWorker`` over agents and tool servers of its own."""

    def __init__(self, ctx: StepContext, *, name: str, partial_rollouts: bool, deterministic: bool,
                 folder: str | None, threads: int = 1):
        import torch

        torch.set_num_threads(threads)
        agents = {a: rollout_agent(ctx.agents[a], deterministic=deterministic) for a in rollout_agent_names(ctx)}
        self.store = _ActorStore(folder)
        self.worker = LocalWorker(ctx, agents, store=self.store, partial_rollouts=partial_rollouts, name=name,
                                  move_to_newest=not deterministic)
        self.worker.version = -1  # holds no version until a job names one (its weights are as loaded)

    async def ready(self) -> int:
        for agent in self.worker.agents.values():
            agent.model  # noqa: B018 - load the weights now, not in the first job
        await self.worker.start()
        return os.getpid()

    async def run(self, job: Job, refs: list[Mapping[int, Any]]) -> list[Episode]:
        self.store.refs.update(refs[0])
        if job.version != self.worker.version and job.version in self.store.refs:
            await self.store.fetch(job.version)  # awaited here: the actor's event loop keeps running
        try:
            return await self.worker.run(job)
        finally:
            self.store.forget_below(self.worker.oldest_needed())

    async def close(self) -> None:
        await self.worker.aclose()


def rollout_agent(spec, *, deterministic: bool):
    """The agent a worker samples with: frozen (it follows published versions), and in
    deterministic mode a transformers engine that decodes one request at a time (see
    ``launch.rollout_copy``)."""
    options = dict(spec.engine_options)
    if deterministic:
        options.update(ENGINES.get(spec.engine).deterministic_options)
    return replace(spec, trainable=False, engine_options=tuple(sorted(options.items()))).build()


class _ActorStore:
    """An actor's view of the learner's store: the references jobs brought, or the disk folder."""

    def __init__(self, folder: str | None):
        self.refs: dict[int, Any] = {}
        self.fetched: dict[int, Any] = {}
        self.disk = DiskStore(folder) if folder else None

    async def fetch(self, version: int) -> None:
        if version not in self.fetched:
            self.fetched[version] = await self.refs[version]

    def get(self, version: int):
        if self.disk is not None:
            return self.disk.get(version)
        if version not in self.fetched:
            raise ConfigError(f"no weights of version {version} were sent to this worker; have {sorted(self.refs)}")
        return self.fetched[version]

    def versions(self) -> list[int]:
        """The versions this actor can load now (fetched, or on disk)."""
        return self.disk.versions() if self.disk is not None else sorted(self.fetched)

    def forget_below(self, version: int) -> None:
        for table in (self.refs, self.fetched):
            for v in [v for v in table if v < version]:
                del table[v]


class RayWorker:
    """The driver's handle on one rollout actor (``LocalWorker``'s interface)."""

    def __init__(self, actor: Any, store: WeightStore, *, name: str):
        self.actor, self.store, self.name = actor, store, name
        self.load = 0

    async def run(self, job: Job, on_episode=None) -> list[Episode]:
        refs = {job.version: self.store.ref(job.version)} if isinstance(self.store, RayObjectStore) else {}
        self.load += len(job.rows)
        try:
            episodes = await self.actor.run.remote(job, [refs])  # a list: Ray passes the reference unresolved
        finally:
            self.load -= len(job.rows)
        if on_episode is not None:
            for ep in episodes:
                on_episode(ep)
        return episodes

    async def pid(self) -> int:
        """The actor's process id (its tool servers are its child processes)."""
        return await self.actor.ready.remote()

    async def aclose(self) -> None:
        """Stop the actor's tool servers, then the actor (a dead actor is just forgotten)."""
        import ray

        try:
            await self.actor.close.remote()
        except ray.exceptions.RayActorError:
            pass
        ray.kill(self.actor, no_restart=True)


__all__ = ["RayWorker", "RolloutActor", "connect", "import_ray", "ray_workers"]
