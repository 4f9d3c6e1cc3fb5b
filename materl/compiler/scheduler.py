"""The rollout stage: one anyio task per episode; group nodes fire when their groups are done.

Episodes run concurrently under a limit; while some await tools, others generate, and the engine
batches whatever generation requests are pending. An episode that raises or times out is recorded
with its ``Failure`` and left out of the update; a step never hangs (every episode has a deadline).

Batching by tick. Episodes that reach the same row-local node (its ``OpSpec`` locality is "row",
e.g. the rewards) in the same event-loop tick run it as ONE batch call, and groups that finish in
the same tick fire a group-local node (locality "group", e.g. GRPO advantages, which take group
ids) in one call over all of them. "The same tick": the first arrival waits until a whole pass of
the loop's ready tasks brings no new one, so the batches do not depend on wall-clock time. If a
batched call raises, its episodes (or groups) are re-run one by one, so one bad row fails only its
own episode, as with per-episode calls.
"""

from __future__ import annotations

import inspect
import time
from contextlib import nullcontext
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import CoroutineType
from typing import Any

import anyio

from materl.compiler.context import StageEnv
from materl.compiler.episode import Episode, Outputs, make_episodes, parse_ref, split, to_tensor
from materl.compiler.failures import Failure, drop_shrunk_group, mark_infra_failure, mark_outage, outage_kind
from materl.compiler.services import Services, close
from materl.compiler.spec import Role, spec_of
from materl.engines.arrivals import settle
from materl.errors import OpOutputError, StepTimeoutError
from materl.graph.node import Node
from materl.rollout.multiturn import EpisodeState, TurnResult
from materl.rollout.types import Rollout

_NO_SCOPE = nullcontext()  # a reusable stand-in for a cancel scope that is not needed


async def call_batch(run: StageEnv, name: str, eps: list[Episode]) -> list[Any]:
    """Run group/batch node ``name`` over ``eps``; one validated value per episode. When a
    built-in node fails on a value a custom op returned, the op is blamed (``blame_op_output``)."""
    node = run.plan.nodes[name]
    refs = [ref for ref in node.inputs if not ref.startswith("@")]
    inputs = [[ep.resolve(ref) for ep in eps] for ref in refs]
    try:
        out = run.plan.impl(name).batch(run, node, eps, inputs)
        if inspect.isawaitable(out):
            out = await out
    except (TypeError, ValueError, AttributeError) as exc:
        blame_op_output(run.plan, node, refs, inputs, exc, episodes=[ep.index for ep in eps])
        raise
    return split(out, len(eps), what=f"op {_label(node)} (node {name!r})")


def blame_op_output(plan, node, refs: list[str], inputs: list[list], exc: BaseException, *,
                    episodes: list[int]) -> None:
    """Raise ``OpOutputError`` naming the custom op (``@ml.op``) whose value made built-in node
    ``node`` fail with ``exc``: the first input from a custom op holding a value that is neither a
    rollout nor numbers (a number, or a row of them). Returns when there is none (the node's own
    error stands); a custom op reading another one's value decides itself what it takes."""
    if spec_of(node).role is Role.CUSTOM:
        return
    for ref, values in zip(refs, inputs):
        producer = plan.nodes.get(ref.split(".")[0])
        if producer is None or spec_of(producer).role is not Role.CUSTOM:
            continue
        for index, value in zip(episodes, values):
            why = _not_numbers_or_rollout(value)
            if why is not None:
                raise OpOutputError(
                    f"op {_label(producer)} (node {producer.name!r}) returned {why} for episode {index}, which node "
                    f"{node.name!r} ({node.op}) reads as {ref!r}; it takes a number per episode, a row of numbers per "
                    f"token, or a rollout (it failed with {type(exc).__name__}: {str(exc)[:200]})",
                    node=producer.name) from exc


def _not_numbers_or_rollout(value: Any) -> str | None:
    """None for a rollout, a number or a flat row of numbers; else a description of ``value``."""
    if isinstance(value, (Rollout, TurnResult, EpisodeState)):
        return None
    try:
        t = to_tensor([value])
    except (TypeError, ValueError, RuntimeError):
        t = None
    if t is not None and t.dim() <= 2:
        return None
    shown = repr(value)
    return f"{shown[:80]}{'...' if len(shown) > 80 else ''} ({type(value).__name__})"


def _label(node) -> str:
    fn = node.params.get("fn")
    return repr(getattr(fn, "__name__", node.op))


class TickBatcher:
    """Episodes reaching one row-local node in the same tick share one batch call. The call runs
    in the stage's task group, outside the episodes' own scopes, so it carries their deadline
    itself: it is stopped once the last of its episodes is past its own."""

    def __init__(self, run: StageEnv, name: str, tg: anyio.abc.TaskGroup):
        self.run, self.name, self.tg = run, name, tg
        self.pending: list[tuple[Episode, anyio.Event, list, float]] = []

    async def submit(self, ep: Episode) -> Any:
        box: list = []
        done = anyio.Event()
        if not self.pending:
            self.tg.start_soon(self._flush)
        self.pending.append((ep, done, box, anyio.current_effective_deadline()))
        await done.wait()
        ok, value = box[0]
        if not ok:
            raise value
        return value

    async def _flush(self) -> None:
        await settle(lambda: len(self.pending))
        batch, self.pending = self.pending, []
        eps = [ep for ep, *_ in batch]
        results = [(False, StepTimeoutError(f"node {self.name!r} passed its episodes' deadline"))] * len(eps)
        with anyio.CancelScope(deadline=max(d for *_, d in batch)):  # every episode waiting here has timed out
            try:
                results = [(True, v) for v in await call_batch(self.run, self.name, eps)]
            except Exception as exc:  # noqa: BLE001 - isolate: one call per episode
                results = [await _alone(self.run, self.name, ep) for ep in eps] if len(eps) > 1 else [(False, exc)]
        for (_, done, box, _), result in zip(batch, results):
            box.append(result)
            done.set()


async def _alone(run: StageEnv, name: str, ep: Episode) -> tuple[bool, Any]:
    try:
        return True, (await call_batch(run, name, [ep]))[0]
    except Exception as exc:  # noqa: BLE001 - delivered to the episode's task
        return False, exc


@dataclass(frozen=True, slots=True)
class EpisodeNode:
    """One episode node as ``run_episode`` runs it, looked up once per rollout stage (not per
    node per episode): its implementation, its episode inputs parsed, its tick batcher if any."""
    name: str
    node: Node
    call: Callable | None  # the implementation's per-episode call, None: a batch of one
    refs: tuple[tuple[str, tuple[str, ...]], ...]  # (node, path) of each input read from the episode
    batcher: TickBatcher | None
    direct: Callable | None = None  # called with the inputs alone instead of ``call`` (``Impl.direct``)
    whole: str | None = None  # the one input, when it is a node's whole value (read without ``lookup``)


def episode_nodes(run: StageEnv, tg: anyio.abc.TaskGroup) -> list[EpisodeNode]:
    """The plan's episode nodes ready to run: row-local nodes with a batch call share one per tick."""
    out = []
    for name in run.plan.episode:
        node, impl = run.plan.nodes[name], run.plan.impl(name)
        batched = spec_of(node).locality_of(node) == "row" and impl.batch is not None
        refs = tuple(parse_ref(ref) for ref in node.inputs if not ref.startswith("@"))
        direct = impl.direct(node) if impl.direct is not None and impl.episode is not None else None
        whole = refs[0][0] if len(refs) == 1 and not refs[0][1] else None
        out.append(EpisodeNode(name, node, impl.episode, refs, TickBatcher(run, name, tg) if batched else None,
                               direct, whole))
    return out


async def run_episode(run: StageEnv, ep: Episode, nodes: Sequence[EpisodeNode], *, own_deadline: bool = True) -> None:
    """Run ``ep`` through the plan's episode nodes, recording a failure or a timeout on it. Per
    node this is the hot path of the rollout stage (a few microseconds matter: one clock read, no
    wrapper coroutine for an op whose function can be called as it is). ``own_deadline=False``:
    the caller's scope holds the deadline (``rollout_stage``'s one scope for episodes that start
    together) and records the timeouts."""
    name = "(start)"
    values, timings = ep.values, ep.timings
    timeout_s = run.options.episode_timeout_s
    try:
        # anyio.fail_after's own logic without its two generator context managers (a third of its cost)
        deadline = anyio.CancelScope(deadline=anyio.current_time() + timeout_s) if own_deadline else None
        with deadline or _NO_SCOPE:
            t0 = time.perf_counter()
            for en in nodes:
                name = en.name
                if en.batcher is not None:
                    value = await en.batcher.submit(ep)
                elif en.call is None:
                    value = (await call_batch(run, name, [ep]))[0]
                else:
                    if en.whole is not None:  # Episode.lookup of a whole value, inline
                        value = values[en.whole]
                        args = (value.default if isinstance(value, Outputs) else value,)
                    else:
                        args = [ep.lookup(head, path) for head, path in en.refs]
                    value = en.direct(*args) if en.direct is not None else en.call(run, en.node, ep, *args)
                    if type(value) is CoroutineType or hasattr(value, "__await__"):  # an async op or implementation
                        value = await value
                values[name] = value  # Episode.store
                t1 = time.perf_counter()  # one clock read per node: this node's end is the next one's start
                timings[name], t0 = t1 - t0, t1
        if deadline is not None and deadline.cancelled_caught and anyio.current_time() >= deadline.deadline:
            raise TimeoutError
    except TimeoutError:
        timed_out(run, ep, name)
    except Exception as e:  # recorded on the episode, never raised out of the step
        kind = outage_kind(e)
        if kind is not None:  # the agent's own tool client hit an outage: like one through a Toolbox
            mark_outage(ep, kind, e, run.options.infra_failures)
        if kind is None or run.options.infra_failures != "mask":
            ep.error = Failure.of(name, e)
    finally:
        if run.services.all:
            with anyio.CancelScope(shield=True):
                for service in run.services.all:  # per-episode tool and endpoint state ends with the episode
                    await service.end_episode(ep.uid)


def timed_out(run: StageEnv, ep: Episode, name: str) -> None:
    """Record that ``ep`` passed its deadline while at node ``name``."""
    ep.error = Failure(name, StepTimeoutError.__name__,
                       f"episode exceeded episode_timeout_s={run.options.episode_timeout_s}")


async def rollout_from_context(ctx, agents, prompts, columns=None, *, groups: Sequence[int] | None = None,
                               on_episode: Callable[[Episode], None] | None = None,
                               services: Services | None = None) -> list[Episode]:
    """What a rollout worker runs: the episodes built (``groups``: the prompts' indices in the
    step's batch) and the rollout stage run with this process's services (``services``: a
    worker's, built from the plan's specs and started, kept across its jobs; None: built from
    ``ctx.plan`` here, e.g. in another process from a pickled context, and the ones started here
    closed when the stage ends)."""
    own = services is None
    services = Services.build(ctx.plan) if own else services
    started = await services.start() if own else []
    try:
        episodes = make_episodes(ctx, prompts, columns or {}, ctx.options.group_size, groups=groups)
        await rollout_stage(StageEnv(ctx, agents, services), episodes, on_episode=on_episode)
    finally:
        if own:
            with anyio.CancelScope(shield=True):
                await close(started)
    return episodes


async def rollout_stage(run: StageEnv, episodes: list[Episode], *,
                        on_episode: Callable[[Episode], None] | None = None) -> float:
    """Run every episode and its groups' group nodes; returns the stage's wall time.

    When every episode starts at once (no ``max_concurrent_episodes`` queue), their deadlines
    are one instant: one cancel scope around the episodes' tasks holds it (an anyio scope and
    its timer per episode were half the scheduler's own cost), and the episodes it stops are
    recorded as timed out at the node they were running. Queued episodes each get their own."""
    plan = run.plan
    groups: dict[int, list[Episode]] = {}
    for ep in episodes:
        groups.setdefault(ep.group, []).append(ep)
    remaining = {g: len(members) for g, members in groups.items()}
    cap = run.options.max_concurrent_episodes  # no semaphore (two loop passes per episode) when all fit
    limit = anyio.Semaphore(cap) if len(episodes) > cap else None
    running = set(range(len(episodes)))
    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        nodes = episode_nodes(run, tg)
        firer = GroupFirer(run, tg)

        def finish(i: int, ep: Episode) -> None:
            running.discard(i)
            mark_infra_failure(ep, run.options.infra_failures)
            if on_episode is not None:
                on_episode(ep)
            remaining[ep.group] -= 1
            if remaining[ep.group] == 0:
                drop_shrunk_group(groups[ep.group], run.options.infra_failures)
                if plan.group:
                    firer.ready(groups[ep.group])

        async def one(i: int, ep: Episode) -> None:
            if limit is None:
                await run_episode(run, ep, nodes, own_deadline=False)
            else:
                async with limit:
                    await run_episode(run, ep, nodes)
            finish(i, ep)

        deadline = anyio.CancelScope(deadline=anyio.current_time() + run.options.episode_timeout_s) \
            if limit is None else _NO_SCOPE
        with deadline:  # around the episodes alone: batch calls and group nodes carry deadlines of their own
            async with anyio.create_task_group() as episode_tasks:
                for i, ep in enumerate(episodes):
                    episode_tasks.start_soon(one, i, ep)
        for i in sorted(running):  # stopped by the deadline (an outer cancellation does not get here)
            ep = episodes[i]
            timed_out(run, ep, next((en.name for en in nodes if en.name not in ep.values), "(start)"))
            finish(i, ep)
    return time.perf_counter() - t0


class GroupFirer:
    """Finished groups run the plan's group nodes; those that finish in the same tick share one
    call per group-local node (locality "group"), other group nodes get one call per group. A
    group's nodes run once its last member is done, often at that member's deadline, so they get
    ``episode_timeout_s`` of their own from then: a member left without a group node's value
    after it is recorded as timed out there."""

    def __init__(self, run: StageEnv, tg: anyio.abc.TaskGroup):
        self.run, self.tg = run, tg
        self.pending: list[list[Episode]] = []

    def ready(self, members: list[Episode]) -> None:
        if not self.pending:
            self.tg.start_soon(self._flush)
        self.pending.append(members)

    async def _flush(self) -> None:
        await settle(lambda: len(self.pending))
        groups, self.pending = self.pending, []
        with anyio.CancelScope(deadline=anyio.current_time() + self.run.options.episode_timeout_s) as scope:
            await self._fire_all(groups)
        if scope.cancelled_caught:
            for m in (m for g in groups for m in g if m.ok):
                name = next((n for n in self.run.plan.group if n not in m.values), None)
                if name is not None:
                    timed_out(self.run, m, name)

    async def _fire_all(self, groups: list[list[Episode]]) -> None:
        plan = self.run.plan
        for name in plan.group:
            node = plan.nodes[name]
            live = [[m for m in g if m.ok] for g in groups]
            live = [g for g in live if g]
            if not live:
                return
            if spec_of(node).locality_of(node) == "group" and len(live) > 1:
                if await _fire(self.run, name, [m for g in live for m in g]):
                    continue
            for g in live:  # one call per group (also the fallback when a joint call failed)
                await _fire(self.run, name, g, record=True)


async def _fire(run: StageEnv, name: str, members: Sequence[Episode], *, record: bool = False) -> bool:
    """Run group node ``name`` over ``members``; store its values. On failure: with ``record``,
    every member fails with it; else nothing is stored and False is returned (the caller retries
    per group)."""
    t0 = time.perf_counter()
    try:
        values = await call_batch(run, name, list(members))
    except Exception as e:  # noqa: BLE001
        if record:
            failure = Failure.of(name, e)
            for m in members:
                m.error = failure
        return False
    elapsed = (time.perf_counter() - t0) / len(members)
    for m, v in zip(members, values):
        m.store(name, v)
        m.timings[name] = elapsed
    return True
