"""Errors of the distributed learner (``MaterlError`` subclasses that also inherit the builtin they
stand for)."""

from __future__ import annotations

from materl.errors import MaterlError


class LearnerRankError(MaterlError, RuntimeError):
    """A learner rank died or failed; the run stops (the ranks' group cannot continue without it).

    ``rank``: the rank that failed first (a rank whose process died is preferred over ranks
    whose collectives then failed because of it); ``pid`` its process id, if known."""

    def __init__(self, message: str, *, rank: int, pid: int | None = None):
        super().__init__(message)
        self.rank, self.pid = rank, pid

    def __reduce__(self):  # picklable (to cross a process boundary) with its keyword fields
        return _rank_error, (str(self), self.rank, self.pid)


def _rank_error(message: str, rank: int, pid: int | None) -> LearnerRankError:
    return LearnerRankError(message, rank=rank, pid=pid)


class LearnerGroupClosedError(MaterlError, RuntimeError):
    """A learner group was used after it stopped (shut down, or after a rank failed)."""


class ExtraNotInstalledError(MaterlError, ImportError):
    """An optional dependency group (``pip install "materl[ray]"``) is needed and missing."""


class RolloutWorkersLostError(MaterlError, RuntimeError):
    """Every rollout worker died (its process was killed, ran out of memory, or its node was
    lost): the run cannot sample any more. ``materl train`` reports it and exits 2."""
