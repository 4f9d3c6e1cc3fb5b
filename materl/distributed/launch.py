"""Building the rollout side of a run: its weight store and workers.

    store, workers = rollout_side(compiled)                         # one in-process worker
    store, workers = rollout_side(compiled, workers=4)              # 4 Ray actors (local cluster)
    store, workers = rollout_side(compiled, workers=8, ray_address="ray://head:10001")

In process, with ``max_staleness=0``, the worker samples with the learner's own agents (lock-step,
no copy). With ``max_staleness > 0`` it samples with a copy of each trainable rollout agent,
which follows the published versions, so the learner can update its weights meanwhile. It uses
the compiled step's services (``compiled.services``: one endpoint, one judge per node); a Ray
worker builds its own from the pickled plan.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from materl.distributed.versions import InProcessStore, WeightStore
from materl.engines import ENGINES
from materl.distributed.workers import LocalWorker, mirrored_agents

if TYPE_CHECKING:
    from materl.agent import Agent
    from materl.compiler.compiled import Compiled


def rollout_copy(agent: Agent, *, deterministic: bool) -> Agent:
    """A frozen copy of ``agent`` for sampling (its own weights and engine). In deterministic mode
    the engine's ``deterministic_options`` apply (the transformers engine decodes one request at
    a time: its row arithmetic depends on the batch, and batches depend on when tool results
    arrive; the Mojo engine's does not)."""
    clone = agent.copy(trainable=False)
    clone.policy_version = agent.policy_version
    if deterministic:
        clone.engine_options = {**clone.engine_options, **ENGINES.get(clone.engine_name).deterministic_options}
    return clone


def in_process_worker(compiled: Compiled, store: WeightStore) -> LocalWorker:
    o, ctx = compiled.options, compiled.context()
    agents = dict(compiled.agents)
    if o.max_staleness > 0:
        for name in mirrored_agents(agents, ctx):
            agents[name] = rollout_copy(agents[name], deterministic=o.deterministic)
    return LocalWorker(ctx, agents, store=store, partial_rollouts=o.partial_rollouts, name="in-process",
                       move_to_newest=not o.deterministic, services=compiled.services)


def rollout_side(compiled: Compiled, *, workers: int = 0, ray_address: str | None = None,
                 transport: str = "object_store", folder: str | None = None) -> tuple[WeightStore, list[Any]]:
    """The weight store and the rollout workers: ``workers=0`` one in-process worker; ``N >= 1``
    N Ray actors (``transport``: ``"object_store"``, or ``"disk"`` in ``folder``)."""
    if workers == 0:
        store = InProcessStore()
        return store, [in_process_worker(compiled, store)]
    from materl.distributed.ray_workers import ray_workers

    return ray_workers(compiled, workers, ray_address=ray_address, transport=transport, folder=folder)
