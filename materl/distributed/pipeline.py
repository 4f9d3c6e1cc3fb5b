"""Training steps with rollouts running ahead of the learner by at most ``max_staleness`` versions.

Step k (counting from 0) learns from batch k, whose rollouts were sampled from policy versions
>= k - S (``S = max_staleness``; the learner starts step k from version k). A producer draws
batch j and hands its groups to the rollout workers as soon as version j - S exists, so while
the learner trains step k the workers already sample batches k + 1 .. k + S, and a slow tool
call or a long episode holds up only its own batch. With S = 0 and the in-process worker this
is lock-step training, bit for bit ``Compiled.run`` per step.

- Versions: after step k the trainable weights are published as version k + 1 (see
  ``versions.py``); a batch may be sampled from any version from j - S to the newest when it
  is dispatched (a worker still finishing the previous batch's episodes keeps its version, so
  the new batch starts at once; see ``workers.py``), or, in deterministic mode, from exactly
  version max(0, j - S). Every token records its version.
- The bound: before learning, an episode with a trained token more than S versions old is
  dropped with its whole group and counted (``async/dropped_stale``); the dispatch rule keeps
  this from happening unless a worker fell behind.
- Faults: a job whose worker dies is run again on another worker (``async/requeued``); the
  event is logged. A step whose episodes fail is judged by the compiled step's failure policy;
  one that a tool outage left nothing to learn from is skipped and still publishes its version
  (the same weights), so the batches waiting for it go on.
- Learner: ``compiled.learn`` (its update in this process or on the learner backend it was
  given, ``Compiled.learn_on``: ``ranks.RankedLearner`` for R data-parallel ranks on Ray), or
  ``learner=`` an object wrapping it with the same ``async learn(episodes, rollout_s=)``; the
  new weights are in ``compiled``'s agents, its step count the version, published from there.
- Deterministic mode also routes group i to worker i mod N, so a re-run (or a resume from a
  checkpoint, which keeps the S versions the next batches need) repeats every batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from materl.compiler.episode import Episode
from materl.distributed.router import Router
from materl.distributed.versions import WeightStore, version_state
from materl.distributed.workers import Job, mirrored_agents

if TYPE_CHECKING:
    from materl.compiler.compiled import Compiled

log = logging.getLogger("materl")


@dataclass
class _Batch:
    rows: list
    version: int
    groups_left: int
    tick: Callable[[Episode], None] | None = None
    episodes: dict[int, list[Episode]] = field(default_factory=dict)  # group -> its episodes
    started: float = 0.0
    finished: float = 0.0
    done: anyio.Event = field(default_factory=anyio.Event)
    error: BaseException | None = None


class Learns(Protocol):
    """What a pipeline's steps learn with: ``Compiled`` itself, or a wrapper of its ``learn``."""

    async def learn(self, episodes: list[Episode], *, rollout_s: float | None = None) -> dict[str, float]: ...


class Pipeline:
    """Drives ``compiled`` through steps (``run``); see the module docstring."""

    def __init__(self, compiled: Compiled, workers: Sequence[Any], store: WeightStore, *, next_batch: Callable[[int], list],
                 max_staleness: int = 0, deterministic: bool = False,
                 progress: Callable[[int, int], Callable[[Episode], None]] | None = None, learner: Learns | None = None):
        self.compiled, self.workers, self.store = compiled, list(workers), store
        self.learner = learner if learner is not None else compiled
        self.next_batch = next_batch
        self.progress = progress  # (step, episodes) -> a callback per finished episode
        self.S = max_staleness
        self.deterministic = deterministic
        self.router = Router(self.workers, deterministic=deterministic)
        self.followed = mirrored_agents(compiled.agents, compiled.context())
        self.loads = [0] * len(self.workers)
        self.batches: dict[int, _Batch] = {}
        self._created: dict[int, anyio.Event] = {}
        self.requeued = 0
        self._version_changed = anyio.Condition()

    @property
    def version(self) -> int:
        return self.compiled.step_count

    def publish(self) -> float:
        """Publish the current weights as version ``self.version``."""
        return self.store.publish(self.version, version_state(self.compiled.agents, self.followed))

    def needed_versions(self, next_step: int) -> set[int]:
        """Versions batches ``next_step`` and later may still sample from."""
        return {v for v in self.store.versions() if v >= max(0, next_step - self.S)}

    async def run(self, start: int, end: int, after_step: Callable[[int, dict], Awaitable[None]]) -> None:
        """Steps ``start`` .. ``end - 1``, each followed by ``await after_step(k, metrics)``
        (logging, evaluation, checkpoints) before the next one learns; rollouts run ahead
        meanwhile. An error in a step is raised as itself (not inside an exception group)."""
        if self.version not in self.store.versions():
            self.publish()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._produce, start, end, tg)
                for k in range(start, end):
                    t0 = time.perf_counter()
                    batch = await self._wait(k)
                    metrics = await self._learn(k, batch, waited_s=time.perf_counter() - t0)
                    await after_step(k, metrics)
                tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            leaves = _leaves(group)
            raise leaves[0] if len(leaves) == 1 else group

    # -- producer ----------------------------------------------------------------------------

    async def _produce(self, start: int, end: int, tg) -> None:
        for j in range(start, end):
            async with self._version_changed:
                while self.version < j - self.S:
                    await self._version_changed.wait()
            rows = self.next_batch(j)
            version = max(0, j - self.S) if self.deterministic else self.version
            tick = self.progress(j, len(rows) * self.compiled.episodes_per_prompt) if self.progress else None
            batch = self.batches[j] = _Batch(rows, version, len(rows), tick=tick, started=time.perf_counter())
            self._event(j).set()
            self._dispatch(j, batch, list(range(len(rows))), tg)

    def _event(self, j: int) -> anyio.Event:
        if j not in self._created:
            self._created[j] = anyio.Event()
        return self._created[j]

    def _dispatch(self, j: int, batch: _Batch, groups: list[int], tg) -> None:
        per_group = self.compiled.episodes_per_prompt
        for w, assigned in self.router.assign(groups, self.loads, per_group).items():
            job = Job(step=j, rows=[batch.rows[g] for g in assigned], groups=tuple(assigned), version=batch.version,
                      rollout_id=f"s{j}w{w}v{batch.version}", oldest=batch.version if self.deterministic else max(0, j - self.S))
            self.loads[w] += len(assigned) * per_group
            tg.start_soon(self._run, j, w, job, tg)

    async def _run(self, j: int, w: int, job: Job, tg) -> None:
        batch = self.batches[j]
        try:
            episodes = await self.workers[w].run(job, on_episode=batch.tick)
        except Exception as exc:  # noqa: BLE001 - a dead worker: run its groups elsewhere
            self.loads[w] -= len(job.groups) * self.compiled.episodes_per_prompt
            if not _worker_died(exc):
                batch.error = exc
                batch.done.set()
                return
            log.warning("rollout worker %s died running step %d's groups %s (%s); running them on another worker",
                        getattr(self.workers[w], "name", w), j, list(job.groups), exc)
            self.requeued += len(job.groups)
            try:
                self.router.mark_dead(w, _first_line(exc))
            except RuntimeError as dead:
                batch.error = dead
                batch.done.set()
                return
            self._dispatch(j, batch, list(job.groups), tg)
            return
        self.loads[w] -= len(job.groups) * self.compiled.episodes_per_prompt
        for g in job.groups:
            batch.episodes[g] = [e for e in episodes if e.group == g]
        batch.groups_left -= len(job.groups)
        if batch.groups_left == 0:
            batch.finished = time.perf_counter()
            batch.done.set()

    # -- learner -------------------------------------------------------------------------------

    async def _wait(self, k: int) -> _Batch:
        await self._event(k).wait()
        batch = self.batches[k]
        await batch.done.wait()
        if batch.error is not None:
            raise batch.error
        return batch

    async def _learn(self, k: int, batch: _Batch, *, waited_s: float) -> dict[str, float]:
        episodes = [e for g in sorted(batch.episodes) for e in batch.episodes[g]]
        stale = self._drop_stale(episodes)
        metrics = await self.learner.learn(episodes, rollout_s=batch.finished - batch.started)
        publish_s = self.publish()
        self.store.retain(self.needed_versions(k + 1))
        del self.batches[k], self._created[k]
        async with self._version_changed:
            self._version_changed.notify_all()
        metrics.update(self._metrics(batch, episodes, stale))
        metrics.update({"time/publish": publish_s, "time/wait_for_batch": waited_s})
        return metrics

    def _drop_stale(self, episodes: list[Episode]) -> int:
        """Groups with a trained token older than ``version - S`` are left out (the bound)."""
        stale_groups = set()
        for ep in episodes:
            rollout = self.compiled.episode_rollout(ep) if ep.error is None else None
            versions = [v for v in (rollout.token_versions if rollout else []) if v is not None]
            if versions and self.version - min(versions) > self.S:
                stale_groups.add(ep.group)
        for ep in episodes:
            if ep.group in stale_groups:
                ep.filtered = True
        return sum(ep.group in stale_groups for ep in episodes)

    def _metrics(self, batch: _Batch, episodes: list[Episode], stale: int) -> dict[str, float]:
        """Staleness of the trained tokens: the learner's starting version minus the token's."""
        versions = [v for e in episodes if e.error is None and (r := self.compiled.episode_rollout(e)) is not None
                    for v in r.token_versions if v is not None]
        lag = [(self.version - 1) - v for v in versions] or [0]
        return {"async/batch_version": float(batch.version), "async/staleness_mean": sum(lag) / len(lag),
                "async/staleness_max": float(max(lag)), "async/dropped_stale": float(stale),
                "async/requeued": float(self.requeued)}


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300]}" if lines else type(exc).__name__


def _worker_died(exc: BaseException) -> bool:
    """A Ray actor that died (its process was killed, or it crashed) rather than a job that raised."""
    try:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    except ImportError:
        return False
    return isinstance(exc, (RayActorError, ActorDiedError, ActorUnavailableError))


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out
