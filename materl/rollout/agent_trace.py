"""One agent episode's token record: the chat requests an agent sends to materl's endpoint, kept
as exact token ids.

    trace = AgentTrace(tokenizer)
    state = trace.context(messages, tools)              # the ids the engine continues
    result = await model_turn(engine, tokenizer, state, params)
    turn = trace.answer(result, messages)               # turn.reply: the OpenAI assistant message
    trace.keep(turn)                                    # once the answer was delivered
    rollout = trace.rollout()

A request whose messages extend the previous one (its messages, then the assistant message as
materl answered it, then new messages) continues the same token sequence: previous ids + the
sampled ids + the tokenization of only the new messages' template text (``append_turn``, the
way ``generate_step`` keeps multi-turn ids exact). Nothing sampled is ever re-tokenized, so the
ids the learner trains on are the ids the engine sampled (the drift verl #6501 / #3960 and
SkyRL's docs describe comes from re-rendering the chat each turn).

A request that does not extend it (the agent edited, dropped or reordered messages, or changed
its tools) starts a new *segment*: a fresh prompt from its messages. Each segment is a Rollout
of its own; ``rollout()`` returns the last one with every segment in ``metadata["segments"]`` and
their count in ``metadata["num_segments"]``. ``episode()`` is what ``ml.agent_episodes`` yields:
the whole episode as one turn sequence (``materl.rollout.types.join_segments``), so rewards and
advantages see every segment's steps in order and the learner trains one row per segment
(``Rollout.segments``); with one segment it is ``rollout()`` itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from materl.errors import EpisodeError
from materl.rollout.multiturn import EpisodeState, TurnResult, append_turn
from materl.rollout.types import Rollout, ToolResult, join_segments


def message_text(content: Any) -> str:
    """An OpenAI message's content as text: a string, None, or a list of ``{"type": "text"}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
                raise EpisodeError(f"message content part {part!r} is not text; the endpoint takes text parts only")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise EpisodeError(f"message content must be a string or a list of text parts, got {type(content).__name__}")


def _arguments(raw: Any) -> str:
    """Tool-call arguments in one canonical JSON text (clients echo them as a JSON string)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            return raw
    return json.dumps(raw, sort_keys=True)


def _calls(message: dict) -> tuple:
    out = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        out.append((fn.get("name", ""), _arguments(fn.get("arguments", {}))))
    return tuple(out)


def normalized(message: dict) -> tuple:
    """What must be equal for a message to count as unchanged: role, text (stripped), tool calls
    (name and arguments, not their ids) and the id a tool result answers."""
    return (message.get("role"), message_text(message.get("content")).strip(), _calls(message),
            message.get("tool_call_id") or "", message.get("name") or "")


def chat_message(message: dict) -> dict:
    """A request message as the chat template renders it: text content, OpenAI tool calls kept."""
    role = message.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise EpisodeError(f"message role {role!r} is not one of system, developer, user, assistant, tool")
    out = {"role": "system" if role == "developer" else role, "content": message_text(message.get("content"))}
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": c.get("id", ""), "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": json.loads(_arguments(c["function"].get("arguments", {})))}}
                             for c in message["tool_calls"]]
    for key in ("tool_call_id", "name"):
        if message.get(key):
            out[key] = message[key]
    return out


@dataclass(frozen=True)
class Turn:
    """A sampled answer not yet recorded (``AgentTrace.answer``)."""

    result: TurnResult
    step: Any
    message: dict
    reply: dict
    messages: list[dict]
    request: int


class AgentTrace:
    """The segments of one agent episode; see the module docstring."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.done: list[Rollout] = []  # closed segments
        self.state: EpisodeState | None = None  # the open segment
        self.expected: list[tuple] = []  # normalized messages a continuing request starts with
        self.tools: list[dict] | None = None
        self.requests = 0
        self.log: list[tuple[list[dict], dict]] = []  # each answered request's messages and the reply
        self._pending: tuple = ([], None, True)

    def context(self, messages: list[dict], tools: list[dict] | None) -> EpisodeState:
        """The episode state a request's answer is sampled after: the open segment extended by
        the request's new messages, or a new segment when the request rewrote the history.
        Nothing changes until ``keep`` records the answer (a failed request leaves no trace)."""
        if not messages:
            raise EpisodeError("a chat request needs at least one message; got messages=[]")
        seen = [normalized(m) for m in messages]
        tools = list(tools) if tools else None
        n = len(self.expected)
        if self.state is not None and tools == self.tools and len(seen) > n and seen[:n] == self.expected:
            new = [chat_message(m) for m in messages[n:]]
            state = append_turn(self.tokenizer, self.state, new, results=self._tool_results(new))
        else:
            state = EpisodeState.start(self.tokenizer, [chat_message(m) for m in messages], tools=tools)
        self._pending = (seen, tools, not state.steps)  # a new segment has no steps yet
        return state

    def _tool_results(self, new: list[dict]) -> list[ToolResult]:
        """The tool messages among ``new`` as ToolResults (named after the call they answer)."""
        calls = {c.id: c.name for c in self.state.pending_calls} if self.state is not None else {}
        return [ToolResult(name=m.get("name") or calls.get(m.get("tool_call_id", ""), "tool"), content=m["content"],
                           call_id=m.get("tool_call_id", "")) for m in new if m["role"] == "tool"]

    def answer(self, result: TurnResult, messages: list[dict]) -> Turn:
        """A sampled turn (ids, log-probs, parsed calls) answering ``messages``, with the OpenAI
        assistant message to send (``Turn.reply``); calls without an id get ``call_<request>_<i>``.
        Nothing is recorded until ``keep`` (the endpoint keeps a turn once it was delivered)."""
        step, message = result.step, dict(result.history.messages[-1])
        calls = [c if c.id else replace(c, id=f"call_{self.requests}_{i}") for i, c in enumerate(step.tool_calls)]
        step = replace(step, tool_calls=calls, metadata={**step.metadata, "request": self.requests})
        reply: dict[str, Any] = {"role": "assistant", "content": message["content"]}
        good = [c for c in calls if c.error is None]
        if good:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in good]
            reply["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in good]
            reply["content"] = message["content"] or None
        return Turn(result, step, message, reply, messages, self.requests)

    def keep(self, turn: Turn) -> None:
        """Record ``turn`` (from ``answer`` after the last ``context``) as the episode's next turn."""
        if turn.request != self.requests:
            raise EpisodeError(f"turn {turn.request} was answered after turn {self.requests - 1} was kept")
        seen, tools, new_segment = self._pending
        if new_segment and self.state is not None:
            self.done.append(self.state.to_rollout())
        state = turn.result.history
        self.state = replace(state, messages=state.messages[:-1] + [turn.message], steps=state.steps[:-1] + [turn.step])
        self.expected, self.tools = seen + [normalized(turn.reply)], tools
        self.log.append((turn.messages, turn.reply))
        self.requests += 1

    def record(self, result: TurnResult, messages: list[dict]) -> dict:
        """``answer`` and ``keep`` at once; returns the assistant message."""
        turn = self.answer(result, messages)
        self.keep(turn)
        return turn.reply

    @property
    def num_segments(self) -> int:
        return len(self.done) + (self.state is not None)

    def generate_step(self, request: int):
        """The generate Step that answered request ``request`` (in whichever segment)."""
        for seg in self.done + [self.state.to_rollout()] if self.state is not None else self.done:
            for step in seg.steps:
                if step.kind == "generate" and step.metadata.get("request") == request:
                    return step
        raise EpisodeError(f"no generate step answered request {request}")

    def rollout(self) -> Rollout:
        """The last segment's Rollout, with all segments in ``metadata["segments"]``."""
        if self.state is None or not self.state.steps:
            raise EpisodeError("the agent made no chat request to the endpoint, so the episode has no tokens")
        segments = self.done + [self.state.to_rollout()]
        last = segments[-1]
        last.metadata.update(segments=segments, num_segments=len(segments), requests=self.requests)
        return last

    def episode(self) -> Rollout:
        """The whole episode as one Rollout (module docstring), with the same metadata as
        ``rollout()``; the last segment itself when the history was never rewritten."""
        last = self.rollout()
        return join_segments(last.metadata["segments"], metadata=last.metadata)
