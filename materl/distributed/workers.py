"""Rollout workers: what runs a step's episodes, in this process or in a Ray actor.

A worker holds the frozen plan (a ``StepContext`` it was given once), its own rollout agents
(engines, tokenizers, and for trainable agents its own copy of the weights at some version) and
its own services (``materl.compiler.services``: tool servers, agent endpoints and judges built
from the plan's specs and started in the worker; an in-process worker shares the compiled
step's). A ``Job`` names the step,
the prompts (with their group indices in the step's batch) and the policy version to sample
from; the worker loads that version from the weight store if it holds another, runs the rollout
stage (``rollout_from_context``) and returns the finished episodes, every token tagged with the
version that sampled it.

A job names the newest version (``version``) and the oldest it may use (``oldest``: the staleness
bound). With ``partial_rollouts=False`` episodes finish on the version they started with, so a
worker whose episodes are still running keeps its version for a new job as long as it is not
older than ``oldest`` (the new batch starts at once, overlapping the old batch's stragglers);
an idle worker moves to the newest version; a worker behind the bound waits for its episodes to
finish, then moves: to the job's version, or, with ``move_to_newest`` (runs that are not
deterministic), to the newest version in the store by then, so the next ``S`` batches can start
on it at once instead of each waiting for the one before it to drain. With ``partial_rollouts=True`` it loads the newest version as soon as a job
asks for it, between engine batches, and episodes in flight continue on it (their later turns
carry the new version). Deterministic runs give ``oldest == version``: exactly that version.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio

from materl import compute
from materl.compiler.context import StepContext
from materl.compiler.episode import Episode
from materl.compiler.scheduler import rollout_from_context
from materl.compiler.services import Services, close
from materl.distributed.versions import WeightStore, load_version


@dataclass(frozen=True)
class Job:
    step: int  # the step these episodes are for (their seeds depend on it)
    rows: list  # prompts (or rows with "prompt"/"messages" and columns)
    groups: tuple[int, ...]  # each row's index in the step's batch
    version: int  # the newest policy version (the one to move to)
    columns: Mapping[str, list] = field(default_factory=dict)
    rollout_id: str = ""
    mode: str = "train"
    oldest: int | None = None  # the oldest version the job may sample from (None: exactly `version`)


def rollout_agent_names(ctx: StepContext) -> list[str]:
    """The agents the rollout stage uses (the agents of its episode-scope nodes)."""
    plan = ctx.plan
    return sorted({a for name in plan.episode for a in plan.nodes[name].agents})


def mirrored_agents(agents: Mapping[str, Any], ctx: StepContext) -> list[str]:
    """The rollout agents the learner trains: the ones whose weights a worker must follow
    version by version."""
    return [a for a in rollout_agent_names(ctx) if ctx.agents[a].trainable]


class LocalWorker:
    """Runs jobs in this process (a Ray actor wraps one of these in its own process)."""

    def __init__(self, ctx: StepContext, agents: Mapping[str, Any], *, store: WeightStore | None = None,
                 partial_rollouts: bool = False, name: str = "local", move_to_newest: bool = False,
                 services: Services | None = None):
        self.ctx, self.agents, self.store, self.name = ctx, dict(agents), store, name
        # the live services episodes use: the compiled step's in process, else built here from the plan
        self.services = services if services is not None else Services.build(ctx.plan)
        self.partial_rollouts, self.move_to_newest = partial_rollouts, move_to_newest
        self.followed = mirrored_agents(self.agents, ctx)
        self.version = min((self.agents[a].policy_version for a in self.followed), default=0)
        self.inflight: dict[int, int] = {}  # version -> episodes running on it
        self.waiting: dict[int, int] = {}  # version -> jobs naming it that have not started yet
        self._changed = anyio.Condition()
        self._starting = anyio.Lock()
        self._started: list = []  # the services this worker started (and stops on aclose)

    async def start(self) -> None:
        """Start the worker's services that are not running (later calls return at once). In
        process they are the compiled step's, which may have started them already."""
        async with self._starting:
            self._started += await self.services.start()

    async def run(self, job: Job, on_episode=None) -> list[Episode]:
        await self.start()
        self.waiting[job.version] = self.waiting.get(job.version, 0) + 1
        try:
            await self._use(job.version, job.version if job.oldest is None else job.oldest)
        finally:
            self.waiting[job.version] -= 1
        self.inflight[self.version] = self.inflight.get(self.version, 0) + len(job.rows)
        started = self.version
        try:
            ctx = self.ctx.next(step=job.step, rollout_id=job.rollout_id or f"{self.name}:{job.step}", mode=job.mode)
            return await rollout_from_context(ctx, self.agents, job.rows, dict(job.columns), groups=job.groups,
                                              on_episode=on_episode, services=self.services)
        finally:
            self.inflight[started] -= len(job.rows)
            async with self._changed:
                self._changed.notify_all()

    async def _use(self, version: int, oldest: int) -> None:
        """Hold weights of a version in ``[oldest, version]`` before a job starts (see the module
        docstring)."""
        if version == self.version or not self.followed:
            return
        busy = any(self.inflight.values())
        if not self.partial_rollouts and busy and oldest <= self.version <= version:
            return  # keep sampling with the version still in use
        if self.store is None:
            raise RuntimeError(f"worker {self.name!r} holds version {self.version} and has no weight store to "
                               f"load version {version} from")
        async with self._changed:
            while not self.partial_rollouts and any(n for v, n in self.inflight.items() if v != version):
                await self._changed.wait()
            if self.move_to_newest:
                version = max([v for v in self.store.versions() if v >= version], default=version)
            if version != self.version:
                await compute.acall(_load, self.agents, self.store, version)
                self.version = version

    async def aclose(self) -> None:
        """Close the services this worker started (the compiled step closes its own)."""
        started, self._started = self._started, []
        await close(started)

    @property
    def load(self) -> int:
        return sum(self.inflight.values())

    def oldest_needed(self) -> int:
        """The oldest version this worker may still load or sample with (older ones can go)."""
        used = [v for table in (self.inflight, self.waiting) for v, n in table.items() if n]
        return min(used + [self.version])


def _load(agents: Mapping[str, Any], store: WeightStore, version: int) -> None:
    """Fetch a version (a file read, or a Ray object) and copy it in, off the event loop."""
    load_version(agents, store.get(version), version=version)
