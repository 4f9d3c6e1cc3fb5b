"""Rollout workers: what runs a step's episodes, in this process or in a Ray actor.

A worker holds the frozen plan (a ``StepContext`` it was given once), its own rollout agents
(engines, tokenizers, and for trainable agents its own copy of the weights at some version) and
its own tool servers (the plan's toolboxes, started in the worker). A ``Job`` names the step,
the prompts (with their group indices in the step's batch) and the policy version to sample
from; the worker loads that version from the weight store if it holds another, runs the rollout
stage (``rollout_from_context``) and returns the finished episodes, every token tagged with the
version that sampled it.

A job names the newest version (``version``) and the oldest it may use (``oldest``: the staleness
bound). With ``partial_rollouts=False`` episodes finish on the version they started with, so a
worker whose episodes are still running keeps its version for a new job as long as it is not
older than ``oldest`` (the new batch starts at once, overlapping the old batch's stragglers);
an idle worker moves to the newest version; a worker behind the bound waits for its episodes to
finish, then moves. With ``partial_rollouts=True`` it loads the newest version as soon as a job
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
from materl.compiler.scheduler import plan_toolboxes, rollout_from_context
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


@dataclass
class _Slot:
    """One set of rollout agents at one policy version, and the episodes running on it."""
    agents: dict[str, Any]
    version: int
    inflight: int = 0


class LocalWorker:
    """Runs jobs in this process (a Ray actor wraps one of these in its own process).

    Without partial rollouts a worker may hold up to ``max_versions`` versions at once, each in
    its own copy of the followed agents (a "slot", with its own engine): a batch that must use a
    newer version than the episodes still running starts at once in another slot instead of
    waiting for them. With ``max_staleness = S`` at most S + 1 versions are ever in flight, so
    ``max_versions = S + 1`` never waits; memory grows by one model copy per extra slot."""

    def __init__(self, ctx: StepContext, agents: Mapping[str, Any], *, store: WeightStore | None = None,
                 partial_rollouts: bool = False, name: str = "local", max_versions: int = 1):
        self.ctx, self.store, self.name = ctx, store, name
        self.partial_rollouts = partial_rollouts
        self.max_versions = 1 if partial_rollouts else max(1, max_versions)
        self.followed = mirrored_agents(agents, ctx)
        first = min((agents[a].policy_version for a in self.followed), default=0)
        self.slots = [_Slot(dict(agents), first)]
        self._changed = anyio.Condition()
        self._starting = anyio.Lock()

    @property
    def agents(self) -> dict[str, Any]:
        return self.slots[0].agents

    @property
    def version(self) -> int:
        """The newest version this worker holds."""
        return max(slot.version for slot in self.slots)

    @version.setter
    def version(self, value: int) -> None:  # a worker that holds no known version yet (a new actor): -1
        self.slots[0].version = value

    @property
    def load(self) -> int:
        return sum(slot.inflight for slot in self.slots)

    async def start(self) -> None:
        """Start the plan's tool servers in this worker (once; later calls return at once)."""
        async with self._starting:
            for toolbox in plan_toolboxes(self.ctx.plan):
                await toolbox.start()

    async def run(self, job: Job, on_episode=None) -> list[Episode]:
        await self.start()
        slot = await self._slot(job.version, job.version if job.oldest is None else job.oldest)
        slot.inflight += len(job.rows)
        try:
            ctx = self.ctx.next(step=job.step, rollout_id=job.rollout_id or f"{self.name}:{job.step}", mode=job.mode)
            return await rollout_from_context(ctx, slot.agents, job.rows, dict(job.columns), groups=job.groups,
                                              on_episode=on_episode)
        finally:
            slot.inflight -= len(job.rows)
            async with self._changed:
                self._changed.notify_all()

    async def _slot(self, version: int, oldest: int) -> _Slot:
        """A slot holding a version in ``[oldest, version]`` (see the class docstring)."""
        if not self.followed:
            return self.slots[0]
        async with self._changed:
            while True:
                usable = [s for s in self.slots if oldest <= s.version <= version and (s.inflight or s.version == version)]
                if usable:
                    return max(usable, key=lambda s: s.version)
                if self.partial_rollouts:  # the one slot moves now; episodes in flight continue on it
                    return await self._move(self.slots[0], version)
                idle = [s for s in self.slots if not s.inflight]
                if idle:
                    return await self._move(idle[0], version)
                if len(self.slots) < self.max_versions:
                    slot = _Slot({**self.slots[0].agents, **{a: self.slots[0].agents[a].copy(trainable=False)
                                                            for a in self.followed}}, -1)
                    self.slots.append(slot)
                    return await self._move(slot, version)
                await self._changed.wait()  # every slot busy on a version the bound no longer allows

    async def _move(self, slot: _Slot, version: int) -> _Slot:
        if slot.version != version:
            if self.store is None:
                raise RuntimeError(f"worker {self.name!r} holds version {slot.version} and has no weight store to "
                                   f"load version {version} from")
            await compute.acall(_load, slot.agents, self.store, version)
            slot.version = version
        return slot

    async def aclose(self) -> None:
        """Stop the tool servers this worker started."""
        for toolbox in plan_toolboxes(self.ctx.plan):
            await toolbox.aclose()


def _load(agents: Mapping[str, Any], store: WeightStore, version: int) -> None:
    """Fetch a version (a file read, or a Ray object) and copy it in, off the event loop."""
    load_version(agents, store.get(version), version=version)
