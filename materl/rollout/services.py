"""The seam between a compiled step and what it runs beside its episodes.

An ``EpisodeService`` is a live object the rollout stage needs: a ``Toolbox`` (tool servers), an
``AgentEndpoint`` (an HTTP server), a ``Judge`` or ``PrincipleJudge`` (semaphores, HTTP
connection pools). A recipe never holds one: its node holds a ``ServiceSpec`` (small, frozen,
picklable: ``EndpointSpec``, ``JudgeSpec``, ``PrinciplesSpec``) in a parameter that the op table
names (``OpSpec.services``), and the compiled step (or a rollout worker, from a pickled context)
builds the live service from it, starts it before the episodes run, tells it when each episode
ends and closes it when the step closes (``materl.compiler.services``).

    spec = JudgeSpec("http://127.0.0.1:8000/v1", "Is it correct?")    # what ml.judge stores
    judge = spec.build()                                                # a fresh Judge, not started
    await judge.start(); ...; await judge.end_episode(uid); ...; await judge.aclose()

A ``Toolbox`` is its own spec (``build`` returns it): the recipe's one object, whose servers the
steps compiled from it start and stop, and which a pickled context carries as its description.
(torchtune's ``recipe_interfaces`` plays this part for its recipes' components.)
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class EpisodeService(Protocol):
    """A live service of the rollout stage. ``start``: ready it (again after ``aclose``; a no-op
    when started); ``end_episode``: the episode is over, drop its state (never raises);
    ``aclose``: release everything it holds (servers, processes, connections)."""

    @property
    def started(self) -> bool: ...

    async def start(self) -> object: ...

    async def end_episode(self, episode_id: str) -> None: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class ServiceSpec(Protocol):
    """What a recipe node holds in place of a service: ``build()`` makes the live one (not
    started). Frozen and picklable, validated when the recipe is written."""

    def build(self) -> EpisodeService: ...


__all__ = ["EpisodeService", "ServiceSpec"]
