"""The updates of a run on R learner ranks (``LearnerGroup``), driven from the process that
holds the compiled step: a learner backend (``compiler.update.LearnerBackend``) whose
forward/backward/optimizer step runs on the ranks; ``Compiled.learn`` does the rest.

    ranks = RankedLearner(compiled, 2, strategy="ddp")      # after restoring a checkpoint, if any
    compiled.learn_on(ranks)                                 # every compiled.learn updates on the ranks
    ranks.pull_state()                                       # before save_checkpoint(optimizers=...)
    compiled.learn_on(None); ranks.shutdown()

The driver keeps its agents and optimizers as the run's record: the ranks start from them (a
fresh run's weights, or a restored checkpoint's weights and optimizer states), after each step
the new trainable weights are loaded into the driver's agents (so rollouts in this process,
weight publication to rollout workers, evaluation and checkpoints see them), references that
follow the policy are updated here as on the ranks, and ``pull_state`` copies the ranks'
optimizer states into the driver's optimizers for a checkpoint. The LR schedule steps the
driver's optimizers; each step sends their learning rates to the ranks.

A step that tool infrastructure failures left nothing to learn from (``Compiled.assess``) is
skipped here and on the ranks alike: no update, every version advances.

A rank that dies stops the run: ``Compiled.learn`` raises ``LearnerRankError`` naming it, nothing of
that step is kept, and the last checkpoint is the one to resume from.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import anyio

from materl import compute
from materl.compiler.compiled import Compiled
from materl.compiler.episode import Episode
from materl.compiler.update import Update
from materl.distributed.state import LearnerState

T = TypeVar("T")


class RankedLearner:
    """A ``LearnerBackend`` on a ``LearnerGroup``; see the module docstring."""

    def __init__(self, compiled: Compiled, ranks: int, *, strategy: str = "ddp", ray_address: str | None = None,
                 num_cpus: float = 1):
        from materl.distributed.ray_group import LearnerGroup

        self.compiled = compiled
        self.group = LearnerGroup(ranks, compiled.options, agents=compiled.context().agents, strategy=strategy,
                                  ray_address=ray_address, num_cpus=num_cpus)
        try:
            self.push_state()
        except BaseException:
            self.group.shutdown()
            raise

    def followers(self) -> list[str]:
        """The driver's reference agents that follow the policy (``reference="ema"``, resets)."""
        c = self.compiled
        refs = {id(ref) for ref, _, _ in c.references}
        return [n for n, a in c.agents.items() if id(a) in refs]

    def push_state(self) -> None:
        """Every rank loads the driver's weights, optimizer states and step count."""
        c = self.compiled
        names = [n for n, a in c.agents.items() if a.trainable] + self.followers()
        models = {n: c.agents[n].model.state_dict() for n in names}
        optimizers = {n: opt.state_dict() for n, opt in c.optimizers.items()}
        self.group.load_state(LearnerState(c.step_count, models, optimizers))

    def pull_state(self) -> None:
        """Copy the ranks' optimizer states into the driver's optimizers (for a checkpoint)."""
        state = self.group.state()
        for name, opt in self.compiled.optimizers.items():
            opt.load_state_dict(state.optimizers[name])

    async def update(self, compiled: Compiled, episodes: list[Episode], *, then: Callable[[Update], T]) -> T:
        """The update on the ranks (in a thread: rollouts go on meanwhile); the new weights are
        loaded into the driver's agents, then ``then`` runs in the compute thread
        (``update.LearnerBackend``)."""
        lrs = {n: [g["lr"] for g in opt.param_groups] for n, opt in compiled.optimizers.items()}
        t0 = time.perf_counter()
        result = await anyio.to_thread.run_sync(self.group.step, episodes, compiled.context(), lrs)
        t1 = time.perf_counter()
        result.weights.load_into(compiled.agents)
        learned = dict(result.metrics)
        timings = {"stage/prepare": learned.pop("time/prepare"), "stage/learner": learned.pop("time/learner"),
                   "ranks": t1 - t0, "load_weights": time.perf_counter() - t1}
        done = Update({k: v for k, v in learned.items() if not k.startswith("time/")}, result.version, timings)
        return await compute.acall(then, done)

    async def skip(self, compiled: Compiled) -> None:
        """The ranks count a skipped step too (their version advances with the driver's)."""
        await anyio.to_thread.run_sync(self.group.skip)

    def shutdown(self) -> None:
        if self.group.actors:
            self.group.shutdown()
