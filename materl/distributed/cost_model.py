"""A cost model of the asynchronous pipeline: steps per second from measured per-stage times.

A step has three parts, measured on a run (``metrics.jsonl``: ``time/stage/rollout``,
``time/stage/prepare`` + ``time/stage/learner``, ``time/publish``):

- generation: engine time for the batch's episodes. Each rollout worker has its own engine, so
  with ``N`` workers it takes ``G * N0 / N`` (``N0``: the workers it was measured with);
- tool waiting: the batch waits for its slowest episode's tools, ``W``, whatever ``N`` is;
- learning and publishing: ``L / ranks + P`` (data-parallel ranks split the rows; the gradient
  all-reduce and the publication do not shrink).

Lock-step (``S = 0``) adds them: ``G*N0/N + W + L/ranks + P``. With ``S >= 1`` the learner works
while the next ``S`` batches roll out. A worker holds one version of the weights, so the ``S + 1``
batches that may share a version run together and end with the slowest episode among all of
them: ``W_{S+1}``, the expected longest wait of ``S + 1`` batches, which grows with the tail of the
wait distribution (``Stages.wait``). A step then costs ``max(L/ranks + P, G*N0/N, W_{S+1}/(S+1))``
when the workers and the learner have devices of their own; in one process they share one
compute thread, so ``max(G + L + P, W_{S+1}/(S+1))``. Measure ``G`` on a lock-step run whose tools
answer at once, ``W`` as the rest of a lock-step run's rollout time (``Stages.measured``), and the
tail from one episode's tool waits (call timings, or draws from a fitted distribution). Without
a tail, ``W_{S+1} = W``: an upper bound on throughput.

    from materl.distributed.cost_model import Stages, step_time
    s = Stages.measured(history, generate_s=0.3, tail=waits)  # history: ml.train(...)["history"], lock-step
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
    tail: tuple[float, ...] = ()  # one episode's tool waits, a sample of their distribution

    @classmethod
    def measured(cls, history: Sequence[dict], *, generate_s: float, workers: int = 1,
                 tail: Sequence[float] = ()) -> Stages:
        """Medians over a lock-step run's steps (the first, which loads and warms up, left out);
        ``generate_s``: the batch's rollout time with tools that answer at once; ``tail``: one
        episode's tool waits (see the module docstring)."""
        steps = list(history[1:]) or list(history)

        def med(*keys: str) -> float:
            return statistics.median(sum(m.get(k, 0.0) for k in keys) for m in steps)

        rollout = med("time/stage/rollout")
        return cls(generate_s=generate_s, tool_wait_s=max(rollout - generate_s, 0.0),
                   learn_s=med("time/stage/prepare", "time/stage/learner"), publish_s=med("time/publish"),
                   episodes=int(statistics.median(m["episodes"] for m in steps)), workers=workers,
                   tail=tuple(tail))

    def wait(self, batches: int) -> float:
        """``W_batches``: the expected longest tool wait of ``batches`` batches rolled out together,
        the measured ``W`` scaled by how the tail's expected maximum grows from one batch's
        episodes to ``batches`` times as many."""
        if not self.tail or batches == 1:
            return self.tool_wait_s
        return self.tool_wait_s * expected_max(self.tail, batches * self.episodes) / expected_max(self.tail, self.episodes)

    def scaled(self, factor: float) -> Stages:
        """The same pipeline with ``factor`` times the generation and learner work (a bigger model)."""
        return replace(self, generate_s=self.generate_s * factor, learn_s=self.learn_s * factor)


def step_time(s: Stages, *, workers: int, staleness: int, learner_ranks: int = 1, in_process: bool = False) -> float:
    """Seconds per step in steady state (see the module docstring)."""
    generate = s.generate_s * s.workers / workers
    learn = s.learn_s / learner_ranks + s.publish_s
    if staleness == 0:
        return generate + s.tool_wait_s + learn
    shared_tail = s.wait(staleness + 1) / (staleness + 1)
    if in_process:
        return max(generate + learn, shared_tail)
    return max(learn, generate, shared_tail)


def expected_max(sample: Sequence[float], n: int, *, draws: int = 2_000, seed: int = 0) -> float:
    """E[max of n draws] from an empirical sample (resampled with replacement, seeded)."""
    import random

    rng = random.Random(seed)
    return sum(max(rng.choices(sample, k=n)) for _ in range(draws)) / draws


def expected_max_lognormal(median: float, sigma: float, n: int, *, draws: int = 20_000, seed: int = 0) -> float:
    """E[max of n lognormal(median, sigma) waits], by Monte Carlo (``tool_wait_s`` of a batch of
    ``n`` episodes that each wait once)."""
    import random

    rng = random.Random(seed)
    total = 0.0
    for _ in range(draws):
        total += max(median * math.exp(sigma * rng.gauss(0.0, 1.0)) for _ in range(n))
    return total / draws
