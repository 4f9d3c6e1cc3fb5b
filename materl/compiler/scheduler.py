"""The rollout stage: one anyio task per episode; group nodes fire when their group is done.

Episodes run concurrently under a limit; while some await tools, others generate, and the
engine batches whatever generation requests are pending. An episode that raises or times out is
recorded with its error and left out of the update; a step never hangs (every episode has a
deadline).
"""

from __future__ import annotations

import inspect
import time
import traceback

import anyio

from materl.compiler.impls import IMPLS, end_tool_episodes
from materl.compiler.values import Episode, resolve, split
from materl.errors import StepTimeoutError


def store(ep: Episode, node, value) -> None:
    if node.op == "advantages" and isinstance(value, dict):
        ep.values[node.name] = value["advantages"]
        ep.values[node.name + ":returns"] = value["returns"]
    else:
        ep.values[node.name] = value


async def run_batch_node(rt, name: str, eps: list[Episode]) -> None:
    """Run a group/batch node over ``eps`` and store its output per episode."""
    plan = rt.plan
    node = plan.nodes[name]
    impl = IMPLS[node.op][plan.impls[name]].batch
    inputs = [[resolve(ep, ref) for ep in eps] for ref in node.inputs if not ref.startswith("@")]
    t0 = time.perf_counter()
    out = impl(rt, node, eps, inputs)
    if inspect.isawaitable(out):
        out = await out
    rt.timings[name] = rt.timings.get(name, 0.0) + time.perf_counter() - t0
    for ep, v in zip(eps, split(out, len(eps))):
        store(ep, node, v)


async def run_episode(rt, ep: Episode) -> None:
    plan = rt.plan
    try:
        with anyio.fail_after(rt.options.episode_timeout_s):
            for name in plan.episode:
                node = plan.nodes[name]
                impl = IMPLS[node.op][plan.impls[name]]
                args = [resolve(ep, ref) for ref in node.inputs if not ref.startswith("@")]
                t0 = time.perf_counter()
                if impl.episode is not None:
                    value = await impl.episode(rt, node, ep, *args)
                else:
                    value = impl.batch(rt, node, [ep], [[a] for a in args])
                    value = (await value) if inspect.isawaitable(value) else value
                    value = split(value, 1)[0]
                ep.timings[name] = time.perf_counter() - t0
                store(ep, node, value)
    except TimeoutError:
        ep.error = f"{StepTimeoutError.__name__}: episode exceeded episode_timeout_s={rt.options.episode_timeout_s}"
    except Exception as e:  # recorded on the episode, never raised out of the step
        ep.error = f"{type(e).__name__}: {e}"
        ep.metrics["traceback"] = traceback.format_exc(limit=4)
    finally:
        await end_tool_episodes(rt, ep)  # per-episode tool state ends with the episode


async def rollout(rt, episodes: list[Episode]) -> None:
    """Run every episode; fire each group's nodes as soon as its last episode finishes."""
    plan = rt.plan
    groups: dict[int, list[Episode]] = {}
    for ep in episodes:
        groups.setdefault(ep.group, []).append(ep)
    remaining = {g: len(members) for g, members in groups.items()}
    limit = anyio.Semaphore(rt.options.max_concurrent_episodes)

    async def one(ep: Episode) -> None:
        async with limit:
            await run_episode(rt, ep)
        remaining[ep.group] -= 1
        if remaining[ep.group] == 0 and plan.group:
            await fire_group(rt, [m for m in groups[ep.group] if m.error is None])

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for ep in episodes:
            tg.start_soon(one, ep)
    rt.timings["stage/rollout"] = time.perf_counter() - t0


async def fire_group(rt, members: list[Episode]) -> None:
    if not members:
        return
    for name in rt.plan.group:
        live = [m for m in members if m.error is None and not m.filtered]
        if not live:
            return
        try:
            await run_batch_node(rt, name, live)
        except Exception as e:
            for m in live:
                m.error = f"group node {name!r} failed: {type(e).__name__}: {e}"
            return
