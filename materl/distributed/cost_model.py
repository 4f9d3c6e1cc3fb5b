"""A cost model of the asynchronous pipeline: steps per second from measured per-stage times.

A step has three parts, measured on a run (``metrics.jsonl``: ``time/stage/rollout``,
``time/stage/prepare`` + ``time/stage/learner``, ``time/publish``):

- generation: engine time for the batch's episodes. Each rollout worker has its own engine, so
  with ``N`` workers it takes ``G * N0 / N`` (``N0``: the workers it was measured with);
- tool waiting: the batch waits for its slowest episode's tools, ``W``, whatever ``N`` is;
- learning and publishing: ``L / ranks + P`` (data-parallel ranks split the rows; the gradient
  all-reduce and the publication do not shrink).

Lock-step (``S = 0``) adds them: ``G*N0/N + W + L/ranks + P``. With ``S >= 1`` the learner works
while the next ``S`` batches roll out and ``S + 1`` batches share the tail (a straggler holds up
only its own batch), so a step costs ``max(L/ranks + P, G*N0/N, W/(S+1))`` when the workers and
the learner have devices of their own; in one process they share one compute thread, so
``max(G + L + P, W/(S+1))``. Measure ``G`` on a lock-step run whose tools answer at once, and
``W`` as the rest of a lock-step run's rollout time (``Stages.measured``).

    from materl.distributed.cost_model import Stages, step_time
    s = Stages.measured(history, generate_s=0.3)      # history: ml.train(...)["history"], lock-step
    for n in (8, 64):
        print(n, s.episodes / step_time(s, workers=n, staleness=2), "episodes/s")
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Stages:
    generate_s: float  # G: engine time of one batch on `workers` workers
    tool_wait_s: float  # W: the batch's wait for its slowest tool call
    learn_s: float  # L: the learner on one rank (prepare + updates)
    publish_s: float  # P: publishing a version
    episodes: int  # per batch
    workers: int = 1  # N0: rollout workers during the measurement

    @classmethod
    def measured(cls, history: Sequence[dict], *, generate_s: float, workers: int = 1) -> Stages:
        """Medians over a lock-step run's steps (the first, which loads and warms up, left out);
        ``generate_s``: the batch's rollout time with tools that answer at once."""
        steps = list(history[1:]) or list(history)

        def med(*keys: str) -> float:
            return statistics.median(sum(m.get(k, 0.0) for k in keys) for m in steps)

        rollout = med("time/stage/rollout")
        return cls(generate_s=generate_s, tool_wait_s=max(rollout - generate_s, 0.0),
                   learn_s=med("time/stage/prepare", "time/stage/learner"), publish_s=med("time/publish"),
                   episodes=int(statistics.median(m["episodes"] for m in steps)), workers=workers)

    def scaled(self, factor: float) -> Stages:
        """The same pipeline with ``factor`` times the generation and learner work (a bigger model)."""
        return replace(self, generate_s=self.generate_s * factor, learn_s=self.learn_s * factor)


def step_time(s: Stages, *, workers: int, staleness: int, learner_ranks: int = 1, in_process: bool = False) -> float:
    """Seconds per step in steady state (see the module docstring)."""
    generate = s.generate_s * s.workers / workers
    learn = s.learn_s / learner_ranks + s.publish_s
    if staleness == 0:
        return generate + s.tool_wait_s + learn
    if in_process:
        return max(generate + learn, s.tool_wait_s / (staleness + 1))
    return max(learn, generate, s.tool_wait_s / (staleness + 1))


def expected_max_lognormal(median: float, sigma: float, n: int, *, draws: int = 20_000, seed: int = 0) -> float:
    """E[max of n lognormal(median, sigma) waits], by Monte Carlo (``tool_wait_s`` of a batch of
    ``n`` episodes that each wait once)."""
    import random

    rng = random.Random(seed)
    total = 0.0
    for _ in range(draws):
        total += max(median * math.exp(sigma * rng.gauss(0.0, 1.0)) for _ in range(n))
    return total / draws
