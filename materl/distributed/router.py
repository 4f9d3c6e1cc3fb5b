"""Which worker runs which group.

A group (all episodes of one prompt) always goes to one worker, so its group nodes (GRPO
advantages, dynamic-sampling filters) fire there as soon as its last episode ends. Groups go to
the least-loaded live worker (fewest episodes in flight, ties to the lowest index), or, in
deterministic mode, group i of every step to worker i mod N, so a re-run makes the same batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from materl.distributed.errors import RolloutWorkersLostError


class Router:
    def __init__(self, workers: Sequence[Any], *, deterministic: bool = False):
        self.workers = list(workers)
        self.deterministic = deterministic
        self.dead: dict[int, str] = {}  # worker index -> what it died of

    @property
    def live(self) -> list[int]:
        return [i for i in range(len(self.workers)) if i not in self.dead]

    def mark_dead(self, index: int, why: str = "") -> None:
        """Stop routing to worker ``index``; ``RolloutWorkersLostError`` when none is left."""
        self.dead[index] = why
        if not self.live:
            deaths = "; ".join(f"{getattr(self.workers[i], 'name', i)}: {self.dead[i].rstrip('.') or 'no reason given'}"
                               for i in sorted(self.dead))
            raise RolloutWorkersLostError(
                f"every rollout worker has died ({len(self.workers)} of {len(self.workers)}), so the run cannot "
                f"sample any more: {deaths}. Restart the run (train.resume=true goes on from the last checkpoint), "
                f"with fewer workers or more memory if they were killed for it")

    def assign(self, groups: Sequence[int], loads: Sequence[int], episodes_per_group: int) -> dict[int, list[int]]:
        """worker index -> the groups it runs. ``loads``: each worker's episodes in flight."""
        live = self.live
        if not live:
            raise RolloutWorkersLostError("no live rollout worker to run the step's episodes")
        plan: dict[int, list[int]] = {}
        if self.deterministic:
            for g in groups:
                plan.setdefault(live[g % len(live)], []).append(g)
            return plan
        load = {i: loads[i] for i in live}
        for g in groups:
            target = min(live, key=lambda i: (load[i], i))
            plan.setdefault(target, []).append(g)
            load[target] += episodes_per_group
        return plan
