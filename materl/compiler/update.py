"""Where a step's update runs: the learner backend behind ``Compiled.learn``.

``Compiled.learn`` is the one learner step (failure policy, skip, engines' weight sync,
references, metrics); the forward/backward/optimizer part of it is a ``LearnerBackend``'s
``update``: ``InProcessLearner`` here (the compiler's ``Learner`` on the compiled step's own
agents and optimizers), or ``distributed.ranks.RankedLearner`` (R data-parallel ranks on Ray,
installed with ``compiled.learn_on(ranks)``). A backend leaves the new trainable weights in the
compiled step's agents and says which version they are; it never writes the step's state: the
step's own end (``Compiled.finish``) is the ``then`` it runs in the compute thread after the
update (the in-process learner in the same compute call as the update itself).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Protocol, TypeVar

from materl import compute
from materl.compiler.context import StageEnv
from materl.compiler.episode import Episode
from materl.compiler.learner import Learner
from materl.compiler.metrics import advantage_turn_metrics, rollout_reader

if TYPE_CHECKING:
    from materl.compiler.compiled import Compiled

T = TypeVar("T")


@dataclass
class Update:
    """What one update made: its metrics, its stage times (``stage/prepare``, ``stage/learner``,
    ...; reported as ``time/<key>``) and the version of the weights it left in the agents."""

    metrics: dict[str, float]
    version: int
    timings: dict[str, float] = field(default_factory=dict)


class LearnerBackend(Protocol):
    async def update(self, compiled: Compiled, episodes: list[Episode], *, then: Callable[[Update], T]) -> T:
        """Learn on ``episodes`` (the step's successful ones), leave the new trainable weights in
        ``compiled.agents``, then run ``then(update)`` in the compute thread (``Compiled.finish``:
        engines' weights, references, metrics) and return what it returns."""
        ...

    async def skip(self, compiled: Compiled) -> None:
        """Count a step without an update (``Compiled.skip``) wherever the learner keeps a version."""
        ...


class InProcessLearner:
    """The update in this process: the compiler's ``Learner`` on ``compiled``'s agents, stepping
    its ``Optimizers``."""

    def __init__(self) -> None:
        self.states_made = False  # AdamW states are made before the first update

    async def update(self, compiled: Compiled, episodes: list[Episode], *, then: Callable[[Update], T]) -> T:
        for agent in {id(a): a for a in compiled.agents.values()}.values():
            agent.sleep_engine()  # the rollout stage is over: free decode-only memory
        if not self.states_made:
            await compute.acall(compiled.optimizer_set.init_state)
            self.states_made = True
        learner = Learner(StageEnv(compiled.context(), compiled.agents), episodes, compiled.optimizer_set)
        turns = partial(advantage_turn_metrics, compiled.plan, episodes, rollout_reader(compiled.plan))

        def update_then() -> T:  # once prepared (the advantages exist): the update and the step's end
            metrics = turns() | learner.run_updates()
            return then(Update(metrics, compiled.step_count + 1, dict(learner.timings)))

        # in the compute call of prepare's last forwards: one thread hop each way for the whole learner
        return await learner.prepare(then=update_then)

    async def skip(self, compiled: Compiled) -> None:
        return None


__all__ = ["InProcessLearner", "LearnerBackend", "Update"]
