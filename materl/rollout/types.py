"""The records an episode produces. Token ids are exact (what the engine saw and sampled);
nothing here is ever re-tokenized.

A ``Rollout`` is a prompt plus an ordered list of ``Step``s. A ``generate`` step holds sampled
tokens and their sampling log-probs and is trained on; a ``tool`` step holds the tokens that
carried a tool's result (and the chat-template glue around it) and is never trained on.
A single-turn completion is a Rollout with one generate step.

An agent episode whose history was rewritten (``ml.agent_episodes``: a request that did not
extend the previous one) has several *segments*, token sequences each with their own prompt.
Its Rollout is the whole episode as one turn sequence (``join_segments``): segment 0's prompt and
steps, then for each later segment an untrained ``tool`` step carrying the prompt that segment
started from (marked ``metadata[SEGMENT_START]``), then its steps. Rewards and advantages read
it like any multi-turn rollout; the learner trains one row per segment (``Rollout.segments``),
whose tokens sit at ``Rollout.segment_spans`` in the episode's per-token values. The
concatenation ``prompt_ids + completion_ids`` of such a Rollout is a record, not a sequence any
forward runs on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# Why a tool call failed, recorded on its own ToolResult (``error_kind``):
#   invalid_call  the model's call could not run: unparseable, unknown tool, bad arguments
#   tool          the tool ran and reported an error (MCP ``isError``, a raised exception)
#   timeout       no answer within the call's timeout
#   crash         the server died (or the connection dropped) under the call, twice if retried
#   protocol      the server answered with something that is not a valid MCP result
#   unavailable   the server is down, restarting past its start timeout, or the toolbox is closed
ErrorKind = Literal["invalid_call", "tool", "timeout", "crash", "protocol", "unavailable"]
ERROR_KINDS: tuple[str, ...] = ("invalid_call", "tool", "timeout", "crash", "protocol", "unavailable")
# Step.metadata key of the untrained step that starts segment k >= 1 of a rewritten episode (its
# token ids are that segment's prompt); the value is k (module docstring, ``join_segments``)
SEGMENT_START = "segment_start"


@dataclass
class ToolCall:
    """One tool call parsed from model output. ``error`` is set when the call was malformed."""

    name: str
    arguments: dict[str, Any]
    id: str = ""
    raw: str = ""
    error: str | None = None


@dataclass
class ToolResult:
    """What a tool returned (or the error it raised, as text the model will see).

    ``error_kind`` says why an error result failed (see ``ErrorKind``; None when it did not);
    ``attempts`` is how many times the call was sent (2 after a retry on a restarted server);
    ``latency_s`` is the whole wait, ``server_s`` the part spent on a live server (what
    ``timeout_s`` bounds; waiting for a free slot or a restarting server is the rest);
    ``truncated`` is set when the output was cut to fit the byte or token budget:
    ``{"bytes": <original UTF-8 bytes>, "kept_bytes": ..., "tokens": <original tokens or None>,
    "kept_tokens": ...}``."""

    name: str
    content: str
    is_error: bool = False
    latency_s: float = 0.0
    call_id: str = ""
    error_kind: ErrorKind | None = None
    attempts: int = 1
    truncated: dict[str, Any] | None = None
    server_s: float = 0.0


@dataclass
class Step:
    kind: Literal["generate", "tool"]
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)  # sampling log-probs; [] for tool steps
    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)  # parsed from a generate step
    tool_results: list[ToolResult] = field(default_factory=list)  # carried by a tool step
    finish_reason: str = ""  # "stop", "length", "tool_call"
    reward: float | None = None  # step-level reward, lands on this step's last token
    latency_s: float = 0.0
    error: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def trainable(self) -> bool:
        return self.kind == "generate"

    @property
    def tool_requests(self) -> list[ToolCall]:
        return [c for c in self.tool_calls if c.error is None]


@dataclass
class Rollout:
    prompt_ids: list[int]
    steps: list[Step] = field(default_factory=list)
    prompt_text: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)  # chat history, for display
    error: str | None = None  # set when the episode failed; such rollouts are left out of updates
    metadata: dict[str, Any] = field(default_factory=dict)

    # -- token views (all over the completion: every token after the prompt) --
    @property
    def completion_ids(self) -> list[int]:
        return [t for s in self.steps for t in s.token_ids]

    @property
    def loss_mask(self) -> list[int]:
        return [int(s.trainable) for s in self.steps for _ in s.token_ids]

    @property
    def sampling_logprobs(self) -> list[float]:
        out: list[float] = []
        for s in self.steps:
            out.extend(s.logprobs if s.trainable else [0.0] * len(s.token_ids))
        return out

    @property
    def token_versions(self) -> list[int | None]:
        """Per completion token: the policy version that sampled it (None for tool tokens and
        for engines that do not record one)."""
        return [s.metadata.get("version") if s.trainable else None for s in self.steps for _ in s.token_ids]

    @property
    def step_ends(self) -> list[int]:
        """Index (into completion_ids) of each step's last token; -1 for an empty first step."""
        ends, n = [], 0
        for s in self.steps:
            n += len(s.token_ids)
            ends.append(n - 1)
        return ends

    # -- text views --
    @property
    def response_start(self) -> int:
        """Where the model's own turns begin in ``messages`` (``len(messages)`` without any): the
        one split of the chat history into the prompt and the episode's response (``question``,
        an LLM judge's transcript). Every generate step adds one assistant message, so the
        model's turns are the last n assistant messages, n the generate steps of the last
        segment (``messages`` are that segment's); a few-shot prompt's example turns come before
        them, environment observations and tool results after."""
        last_segment = max((i for i, s in enumerate(self.steps) if s.metadata.get(SEGMENT_START)), default=-1)
        assistant = [i for i, m in enumerate(self.messages) if m.get("role") == "assistant"]
        n = min(sum(s.kind == "generate" for s in self.steps[last_segment + 1:]), len(assistant))
        return assistant[len(assistant) - n] if n else len(self.messages)

    @property
    def question(self) -> str:
        """What the episode was asked: ``prompt_text`` when set, else the last user message before
        the model's first turn (``response_start``)."""
        if self.prompt_text:
            return self.prompt_text
        return last_user_message(self.messages[:self.response_start])

    @property
    def text(self) -> str:
        """The text of the last generate step (the final answer of a multi-turn episode)."""
        gens = [s for s in self.steps if s.kind == "generate"]
        return gens[-1].text if gens else ""

    @property
    def full_text(self) -> str:
        return "".join(s.text for s in self.steps)

    @property
    def generate_steps(self) -> list[Step]:
        return [s for s in self.steps if s.kind == "generate"]

    @property
    def tool_steps(self) -> list[Step]:
        return [s for s in self.steps if s.kind == "tool"]

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [c for s in self.steps for c in s.tool_calls]

    @property
    def tool_results(self) -> list[ToolResult]:
        return [r for s in self.steps for r in s.tool_results]

    @property
    def num_turns(self) -> int:
        return len(self.generate_steps)

    # -- segments (module docstring) --
    @property
    def segments(self) -> list[Rollout]:
        """The token sequences the learner trains, one row each: ``[self]``, or for an episode
        whose history was rewritten each segment's prompt and steps (sharing this Rollout's Step
        objects)."""
        if not any(s.metadata.get(SEGMENT_START) for s in self.steps):
            return [self]
        out = [Rollout(self.prompt_ids)]
        for s in self.steps:
            if s.metadata.get(SEGMENT_START):
                out.append(Rollout(list(s.token_ids)))
            else:
                out[-1].steps.append(s)
        return out

    @property
    def segment_spans(self) -> list[tuple[int, int]]:
        """(start, stop) of each segment's completion in ``completion_ids``: where its learner row's
        per-token values (rewards, advantages, log-probs) sit in the episode's; ``[(0, n)]``
        without segments."""
        spans, start, pos = [], 0, 0
        for s in self.steps:
            if s.metadata.get(SEGMENT_START):
                spans.append((start, pos))
                start = pos + len(s.token_ids)
            pos += len(s.token_ids)
        return spans + [(start, pos)]

    def step_rewards(self) -> list[float]:
        """Per completion token: each step's reward on its last token, 0 elsewhere."""
        out = [0.0] * len(self.completion_ids)
        for s, end in zip(self.steps, self.step_ends):
            if s.reward is not None and end >= 0 and s.token_ids:
                out[end] += s.reward
        return out


def last_user_message(messages: list[dict[str, Any]]) -> str:
    """The content of the last ``user`` message ("" without one): a chat prompt's question."""
    users = [m.get("content", "") for m in messages if m.get("role") == "user"]
    return str(users[-1]) if users else ""


def join_segments(segments: list[Rollout], *, metadata: dict[str, Any] | None = None) -> Rollout:
    """The episode of ``segments`` as one Rollout (module docstring): segment 0's prompt, every
    segment's steps in order, each later segment's prompt as an untrained step before its own,
    the last segment's messages. One segment is returned as it is."""
    if len(segments) == 1:
        return segments[0]
    steps = list(segments[0].steps)
    for k, seg in enumerate(segments[1:], start=1):
        steps.append(Step("tool", list(seg.prompt_ids), metadata={SEGMENT_START: k}))
        steps.extend(seg.steps)
    return Rollout(list(segments[0].prompt_ids), steps, prompt_text=segments[0].prompt_text,
                   messages=list(segments[-1].messages), metadata=dict(metadata or {}))
