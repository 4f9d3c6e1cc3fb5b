"""Episode failures: what failed where, and the one policy that decides when a step stops the run.

An episode that raises (a reward with the wrong signature, a custom op's bug, a missing dataset
column, a timeout) is recorded with a ``Failure`` (node, error type, message) and left out of
the update; the step goes on with the others. That is right for a few flaky episodes and wrong
for a bug that fails all of them: a run that "trains" on nothing for hours and exits 0.

``FailurePolicy`` (compile option ``max_failed_fraction``, default 0.5): a step in which more
than that fraction of its episodes failed raises ``StepFailedError``, whose message shows the
first error of each distinct kind (node, error type) with its count; so does a step that made no
update at all. Below the threshold, each new kind is logged once per compiled step (not every
step) and every step's metrics count failures per kind (``failures/<node>/<ErrorType>``).
(TRL raises on the first reward error; verl's DAPO raises once it cannot fill a batch.)
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from materl.errors import StepFailedError

log = logging.getLogger("materl")


@dataclass(frozen=True)
class Failure:
    """Why an episode failed: the node that raised, the error's type name and its message."""

    node: str
    kind: str
    message: str
    traceback: str = ""

    @classmethod
    def of(cls, node: str, exc: BaseException) -> Failure:
        return cls(node, type(exc).__name__, str(exc), traceback.format_exc(limit=4))

    @property
    def key(self) -> tuple[str, str]:
        return self.node, self.kind

    def __str__(self) -> str:
        return f"{self.kind} in node {self.node!r}: {self.message}"


class FailurePolicy:
    """Counts a step's failures, logs new kinds once, and stops a step that failed too much."""

    def __init__(self, max_failed_fraction: float):
        self.max_failed_fraction = max_failed_fraction
        self._logged: set[tuple[str, str]] = set()

    def metrics(self, episodes: Sequence[Any]) -> dict[str, float]:
        """``failures/<node>/<kind>`` counts; logs each kind the first time it is seen."""
        out: dict[str, float] = {}
        for f in _failures(episodes):
            key = f"failures/{f.node}/{f.kind}"
            out[key] = out.get(key, 0.0) + 1.0
            if f.key not in self._logged:
                self._logged.add(f.key)
                log.warning("episode failed (%s; later failures of this kind are only counted, as %s): %s",
                            f.kind, key, f)
        return out

    def check(self, episodes: Sequence[Any], *, step: int) -> None:
        """Raise ``StepFailedError`` if more than ``max_failed_fraction`` of ``episodes`` failed."""
        failures = _failures(episodes)
        if episodes and len(failures) > self.max_failed_fraction * len(episodes):
            raise StepFailedError(
                f"step {step}: {len(failures)} of {len(episodes)} episodes failed (more than max_failed_fraction="
                f"{self.max_failed_fraction:g}); the run stops rather than train on what is left\n"
                + summarize(failures))

    def check_update(self, episodes: Sequence[Any], *, step: int) -> None:
        """Raise ``StepFailedError`` when no episode is left to learn from."""
        if any(e.ok for e in episodes):
            return
        failures = _failures(episodes)
        filtered = sum(1 for e in episodes if e.error is None and e.filtered)
        why = [f"{len(failures)} failed"] * bool(failures) + [
            f"{filtered} filtered by dynamic sampling (their group's rewards were all equal)"] * bool(filtered)
        raise StepFailedError(f"step {step} made no update: of {len(episodes)} episodes, {', '.join(why) or 'none ran'}"
                              + ("\n" + summarize(failures) if failures else ""))


def summarize(failures: Sequence[Failure]) -> str:
    """One line per distinct (node, kind): its count and the first message."""
    first: dict[tuple[str, str], Failure] = {}
    counts: dict[tuple[str, str], int] = {}
    for f in failures:
        first.setdefault(f.key, f)
        counts[f.key] = counts.get(f.key, 0) + 1
    return "\n".join(f"  {counts[k]} x {first[k]}" for k in first)


def _failures(episodes: Sequence[Any]) -> list[Failure]:
    return [e.error for e in episodes if e.error is not None]
