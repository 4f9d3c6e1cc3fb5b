"""The live services of one process's rollout stage, built from the specs a plan's nodes hold.

The op table says which of a node's params hold a service (``OpSpec.services``: ``tools`` of
generate_step and call_tools, ``endpoint`` of agent_episodes, ``judge`` and ``principles`` of the
judge kinds); a value there that is a ``ServiceSpec`` (``materl.rollout.services``) is built into
its live ``EpisodeService`` once per ``Services``. The compiled step holds one (its in-process
rollout worker shares it); a Ray rollout worker builds its own from the pickled plan.

    services = Services.build(plan)            # live objects, nothing started
    started = await services.start()           # those not running; the caller closes these
    await rollout_stage(StageEnv(ctx, agents, services), episodes)
    await close(started)

Implementations read their service from ``StageEnv.service(node, param)``, never from the node.
A ``Toolbox`` is its own spec, so every ``Services`` of a process shares the recipe's toolbox;
an endpoint or a judge is built afresh by each (two steps compiled from one recipe have two).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import anyio

from materl.compiler.spec import spec_of
from materl.errors import UnknownNameError
from materl.rollout.services import EpisodeService, ServiceSpec

log = logging.getLogger("materl")


class Services:
    """Live services by (node name, param). ``all``: each service once."""

    def __init__(self, live: Mapping[tuple[str, str], EpisodeService] | None = None):
        self.live = dict(live or {})
        self.all: tuple[EpisodeService, ...] = tuple({id(s): s for s in self.live.values()}.values())

    @classmethod
    def build(cls, plan) -> Services:
        """Build the service of every spec a node of ``plan`` holds where the op table names one;
        a spec object two nodes share gives one service."""
        built: dict[int, EpisodeService] = {}
        live = {}
        for node in plan.nodes.values():
            for param in spec_of(node).services:
                spec = node.params.get(param)
                if isinstance(spec, ServiceSpec):
                    if id(spec) not in built:
                        built[id(spec)] = spec.build()
                    live[node.name, param] = built[id(spec)]
        return cls(live)

    def get(self, node: str, param: str) -> EpisodeService | None:
        return self.live.get((node, param))

    def of(self, node: str, param: str | None = None) -> EpisodeService:
        """The service of ``node`` (``param``: which, when it holds several); UnknownNameError
        naming the services there are otherwise."""
        keys = [k for k in self.live if k[0] == node and (param is None or k[1] == param)]
        if len(keys) != 1:
            held = ", ".join(f"{n}.{p}" for n, p in self.live) or "none"
            raise UnknownNameError(f"{'no' if not keys else 'more than one'} service for node {node!r}"
                                   f"{f' param {param!r}' if param else ''}; services: {held}")
        return self.live[keys[0]]

    async def start(self) -> list[EpisodeService]:
        """Start the services that are not running, one after the other; the ones started now (the
        caller closes them). When one cannot start, those started before it are closed and its
        error raised."""
        started: list[EpisodeService] = []
        try:
            for service in self.all:
                if not service.started:
                    await service.start()
                    started.append(service)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await close(started, raise_first=False)
            raise
        return started

    async def end_episode(self, episode_id: str) -> None:
        for service in self.all:
            await service.end_episode(episode_id)

    def __repr__(self) -> str:
        return f"Services({', '.join(f'{n}.{p}={s!r}' for (n, p), s in self.live.items())})"


async def close(services: list[EpisodeService], *, raise_first: bool = True) -> None:
    """Close each of ``services`` (those a caller started), every one even when one raises; then
    the first error is raised (``raise_first``; the others are logged) or all are logged."""
    error = None
    for service in services:
        try:
            await service.aclose()
        except Exception as exc:  # noqa: BLE001 - the others still close
            if error is None and raise_first:
                error = exc
            else:
                log.warning("closing %r failed: %s: %s", service, type(exc).__name__, exc)
    if error is not None:
        raise error


__all__ = ["Services", "close"]
