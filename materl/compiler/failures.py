"""Episode failures: what failed where, and the one policy that decides when a step stops the run.

An episode that raises (a reward with the wrong signature, a custom op's bug, a missing dataset
column, a timeout) is recorded with a ``Failure`` (node, error type, message) and left out of
the update; the step goes on with the others. That is right for a few flaky episodes and wrong
for a bug that fails all of them: a run that "trains" on nothing for hours and exits 0.

``FailurePolicy`` (compile option ``max_failed_fraction``, default 0.5): a step in which more
than that fraction of its episodes failed raises ``StepFailedError``, whose message shows the
first error of each distinct kind (node, error type) with its count; so does a step that made no
update at all, except after an outage (below). Below the threshold, each new kind is logged once
per compiled step (not every step) and every step's metrics count failures per kind
(``failures/<node>/<ErrorType>``).
(TRL raises on the first reward error; verl's DAPO raises once it cannot fill a batch.)

Infrastructure failures (compile option ``infra_failures``). A tool call that failed for a reason
that is not the model's (``INFRA_ERROR_KINDS``: timeout, crash, protocol, unavailable; not
``invalid_call``, the model's own malformed call, nor ``tool``, the tool's own error result)
marks its episode (``Episode.infra``), and so does an outage that an agent's own tool client
raised (``outage_kind``: its MCP server refused the connection, died or timed out; the MCP SDK
raises these inside exception groups). With ``"mask"`` (the default) such an episode is left out
of its group's baseline and of the update, and the rest of its group is normalised without it; a
group that infrastructure failures leave with fewer than two episodes is dropped whole (one
episode has no baseline to compare with). ``"keep"`` trains on them as real rewards. Either way
the step's metrics count failed calls per kind (``infra_failures/<kind>``), the episodes left out
(``infra_failures/episodes_masked``) and the groups dropped (``infra_failures/groups_dropped``).
(rLLM #710: time-limited episodes trained as done; NeMo-Gym #3351: masked rows still entered the
group baseline.)

An outage (compile option ``max_skipped_steps``, default 3). A step in which no episode is left
to learn from only because ``"mask"`` left them out (every other episode failed within
``max_failed_fraction``; none was filtered by dynamic sampling) is skipped, not the end of the
run: a warning names the step and the failure kinds, no optimizer step is taken, and the step is
counted like any other (its number, the policy version, the LR schedule, logging and checkpoints
advance; weights, optimizer states and reference policies stay), with
``infra_failures/update_skipped`` = 1 in its metrics (0 on other steps). One skipped step more in a
row than ``max_skipped_steps`` raises ``StepFailedError`` naming the limit (the count is this
process's: a resumed run starts it again). The schedule advances
as verl's does when it skips an optimizer step over a non-finite gradient norm (it still steps
its LR scheduler), so step k trains with the LR planned for step k, outage or not; TRL's Trainer
counts such a step but holds its scheduler back (accelerate's ``optimizer_step_was_skipped``).
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from materl.errors import OpOutputError, StepFailedError
from materl.rollout.multiturn import EpisodeState, TurnResult
from materl.rollout.types import Rollout, ToolResult

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
        """The failure of ``exc`` raised while running ``node``: an ``OpOutputError`` is the failure
        of the op it names; an exception group (anyio/asyncio TaskGroups raise them) is named by
        the errors inside it, not as "unhandled errors in a TaskGroup"."""
        node = exc.node if isinstance(exc, OpOutputError) else node  # the op that returned the value
        leaves = leaf_errors(exc)
        if leaves and (len(leaves) > 1 or leaves[0] is not exc):
            kind = "/".join(dict.fromkeys(type(e).__name__ for e in leaves))
            message = "; ".join(f"{type(e).__name__}: {e}" for e in leaves[:3]) + (
                f" (and {len(leaves) - 3} more)" if len(leaves) > 3 else "")
            return cls(node, kind, f"{message} (inside {type(exc).__name__})", traceback.format_exc(limit=4))
        return cls(node, type(exc).__name__, str(exc), traceback.format_exc(limit=4))

    @property
    def key(self) -> tuple[str, str]:
        return self.node, self.kind

    def __str__(self) -> str:
        return f"{self.kind} in node {self.node!r}: {self.message}"


class FailurePolicy:
    """Counts a step's failures, logs new kinds once, and stops a step that failed too much."""

    def __init__(self, max_failed_fraction: float, *, max_skipped_steps: int = 3):
        self.max_failed_fraction = max_failed_fraction
        self.max_skipped_steps = max_skipped_steps
        self.skipped = 0  # steps in a row skipped after tool infrastructure failures
        self._logged: set[tuple[str, str]] = set()

    def metrics(self, episodes: Sequence[Any]) -> dict[str, float]:
        """``failures/<node>/<kind>`` and ``infra_failures/*`` counts; logs each failure kind the
        first time it is seen."""
        out: dict[str, float] = infra_metrics(episodes)
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

    def check_update(self, episodes: Sequence[Any], *, step: int) -> bool:
        """True when some episode is left to learn from. False when none is, only because tool
        infrastructure failures left them out (an outage: the step is skipped, with a warning),
        up to ``max_skipped_steps`` such steps in a row; otherwise ``StepFailedError``."""
        if any(e.ok for e in episodes):
            self.skipped = 0
            return True
        failures = _failures(episodes)
        filtered = sum(1 for e in episodes if e.error is None and e.filtered)
        masked = sum(1 for e in episodes if e.error is None and not e.filtered and e.excluded is not None)
        why = [f"{len(failures)} failed"] * bool(failures) + [
            f"{filtered} filtered by dynamic sampling (their group's rewards were all equal)"] * bool(filtered) + [
            f"{masked} left out after tool infrastructure failures (infra_failures='mask'; "
            f"{_kinds(episodes)})"] * bool(masked)
        message = f"step {step} made no update: of {len(episodes)} episodes, {', '.join(why) or 'none ran'}"
        outage = masked > 0 and not filtered  # nothing else took the episodes away
        if outage and self.skipped < self.max_skipped_steps:
            self.skipped += 1
            log.warning("%s; the step is skipped (no optimizer step; %d in a row of at most max_skipped_steps=%d) "
                        "and the run goes on", message, self.skipped, self.max_skipped_steps)
            return False
        if outage:
            message += (f"\nsteps in a row without an update after tool infrastructure failures: {self.skipped + 1}, "
                        f"more than max_skipped_steps={self.max_skipped_steps}; to ride out a longer outage raise it "
                        f"(compile option max_skipped_steps, compile.max_skipped_steps in a config)")
        raise StepFailedError(message + ("\n" + summarize(failures) if failures else ""))


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


# ---------------------------------------------------------------------------- infrastructure failures

INFRA_ERROR_KINDS = ("timeout", "crash", "protocol", "unavailable")
INFRA_POLICIES = ("mask", "keep")


_TURNS = (TurnResult, EpisodeState)  # values holding a rollout
_HOLDERS = (dict, Rollout, *_TURNS)  # values that may hold tool results (dict: a node's named outputs)


def tool_results(episode: Any) -> list[ToolResult]:
    """Every tool result of an episode (each once, from whichever of its stored rollouts has it).
    Other values are skipped with one type check."""
    seen: dict[int, ToolResult] = {}
    for value in episode.values.values():
        if not isinstance(value, _HOLDERS):
            continue
        for v in value.values() if isinstance(value, dict) else (value,):
            if isinstance(v, _TURNS):
                v = v.rollout
            if isinstance(v, Rollout):
                for r in v.tool_results:
                    seen.setdefault(id(r), r)
    return list(seen.values())


def leaf_errors(exc: BaseException) -> list[BaseException]:
    """The exceptions inside ``exc``, exception groups (nested ones too) flattened; ``[exc]`` for
    any other exception."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in leaf_errors(sub)]
    return [exc]


def outage_kind(exc: BaseException) -> str | None:
    """The ``INFRA_ERROR_KINDS`` kind of an error that an agent's own tool client raised because
    its tool server could not be reached or went away, else None (the agent's own error).

    Agent code that talks to MCP servers itself (the MCP SDK's client, an agent framework's MCP
    support) sees an outage as an exception, usually inside an exception group from the SDK's
    task groups: refused or failed connections (``"unavailable"``), a transport that broke under
    a request or an MCP session closed by its server (``"crash"``), and MCP's request timeout
    (``"timeout"``). Every error in the group must be one of those; a chain (``raise ... from``)
    is followed, except through the OpenAI client's errors (the endpoint materl serves is not a
    tool server)."""
    kinds = [_outage_leaf(e) for e in leaf_errors(exc)]
    return kinds[0] if kinds and all(kinds) else None


# httpx-family errors (httpx, httpx2 that the MCP SDK uses, their httpcore) by class name
_HTTP_MODULES = ("httpx", "httpx2", "httpcore", "httpcore2")
_HTTP_OUTAGES = {"ConnectError": "unavailable", "ConnectTimeout": "unavailable", "RemoteProtocolError": "crash",
                 "ReadError": "crash", "WriteError": "crash"}


def _outage_leaf(exc: BaseException, depth: int = 0) -> str | None:
    import anyio

    if type(exc).__module__.startswith("openai") or depth > 8:
        return None
    if type(exc).__module__.split(".")[0] in _HTTP_MODULES:
        kind = next((_HTTP_OUTAGES[c.__name__] for c in type(exc).__mro__ if c.__name__ in _HTTP_OUTAGES), None)
        if kind is not None:
            return kind
    if isinstance(exc, ConnectionRefusedError):
        return "unavailable"
    if isinstance(exc, (ConnectionResetError, BrokenPipeError, anyio.BrokenResourceError, anyio.ClosedResourceError,
                        anyio.EndOfStream)):
        return "crash"
    code = _mcp_error_code(exc)
    if code is not None:
        return code
    cause = exc.__cause__
    if isinstance(cause, BaseExceptionGroup):
        return outage_kind(cause)
    return _outage_leaf(cause, depth + 1) if cause is not None else None


def _mcp_error_code(exc: BaseException) -> str | None:
    """An MCP SDK error for a closed connection ("crash") or a request timeout ("timeout")."""
    try:
        from mcp.shared import exceptions
        from mcp.types import CONNECTION_CLOSED, REQUEST_TIMEOUT
    except ImportError:  # pragma: no cover - mcp is a dependency
        return None
    types = tuple(t for t in (getattr(exceptions, "MCPError", None), getattr(exceptions, "McpError", None)) if t)
    if not isinstance(exc, types):
        return None
    code = getattr(exc, "code", None)
    code = getattr(getattr(exc, "error", None), "code", None) if code is None else code
    if code == CONNECTION_CLOSED and "connection closed" in str(exc).lower():  # servers may reuse -32000
        return "crash"
    return "timeout" if code == REQUEST_TIMEOUT else None


def mark_outage(episode: Any, kind: str, exc: BaseException, policy: str) -> None:
    """An episode whose own tool client raised ``exc`` for an outage (``outage_kind``): marked as
    an infrastructure failure of ``kind`` and, with ``"mask"``, left out like an outage through a
    Toolbox; with ``"keep"`` it fails (there is no rollout to train on)."""
    episode.infra, episode.infra_raised = kind, True
    if policy == "mask":
        leaves = "; ".join(f"{type(e).__name__}: {e}" for e in leaf_errors(exc)[:2])
        episode.excluded = f"tool infrastructure failure ({kind}) raised by the agent's own tool client: {leaves}"


def mark_infra_failure(episode: Any, policy: str) -> None:
    """Set ``episode.infra`` to its first infrastructure failure's kind; with ``"mask"``, leave it out."""
    if getattr(episode, "infra_raised", False):
        return  # already marked by mark_outage
    episode.infra = next((r.error_kind for r in tool_results(episode) if r.error_kind in INFRA_ERROR_KINDS), None)
    if episode.infra is not None and policy == "mask" and episode.error is None:
        episode.excluded = f"tool infrastructure failure ({episode.infra})"


def drop_shrunk_group(members: Sequence[Any], policy: str) -> None:
    """With ``"mask"``: a group that masked infrastructure failures leave with fewer than two
    episodes has no baseline; its remaining episode is left out too."""
    if policy != "mask" or not any(m.infra is not None and m.excluded is not None for m in members):
        return
    live = [m for m in members if m.ok]
    if len(live) < 2:
        for m in live:
            m.excluded = "its group has fewer than two episodes left after tool infrastructure failures"


def infra_metrics(episodes: Sequence[Any]) -> dict[str, float]:
    """``infra_failures/<kind>`` (failed calls), ``infra_failures/episodes_masked`` and
    ``infra_failures/groups_dropped``."""
    out: dict[str, float] = {}
    for e in episodes:
        kinds = [r.error_kind for r in tool_results(e) if r.error_kind in INFRA_ERROR_KINDS]
        if getattr(e, "infra_raised", False):  # an agent's own tool client raised it (mark_outage)
            kinds.append(e.infra)
        for kind in kinds:
            out[f"infra_failures/{kind}"] = out.get(f"infra_failures/{kind}", 0.0) + 1.0
    masked = [e for e in episodes if e.excluded is not None]
    if out or masked:
        out["infra_failures/episodes_masked"] = float(len(masked))
        hit = {e.group for e in masked if e.infra is not None}
        out["infra_failures/groups_dropped"] = float(sum(
            sum(1 for e in episodes if e.group == g and e.ok) < 2 for g in hit))
    return out


def _kinds(episodes: Sequence[Any]) -> str:
    m = infra_metrics(episodes)
    return ", ".join(f"{int(v)} x {k.split('/')[1]}" for k, v in m.items() if k.split("/")[1] in INFRA_ERROR_KINDS)
