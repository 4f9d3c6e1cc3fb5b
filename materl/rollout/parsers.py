"""Tool-call formats: model text in, ``ParsedMessage(content, calls)`` out.

    TOOL_PARSERS.get("hermes")('I will add. <tool_call>{"name": "calculate", '
                               '"arguments": {"expression": "2+3"}}</tool_call>')
    # ParsedMessage(content='I will add.', calls=[ToolCall(name='calculate', ...)])
    choose_format(tokenizer, "auto")   # (tool_formats) the format the model's chat template declares

Guarantees of every built-in format (``hermes``, ``json``, ``qwen3_coder``, ``llama3_json``,
``mistral``, ``harmony``, and ``response_template`` over transformers' parser):

- it never raises on model output: a call the model got wrong (bad JSON, no name, arguments
  that are not an object, an unclosed tag, nesting deeper than 64 levels, a call longer than
  256 KiB) comes back as ``ToolCall(name="", arguments={}, raw=<its text>, error=<what is
  wrong>)``, which the episode answers with ``error_result(call)`` so the model learns from it;
- it runs in time linear in the text (no regex backtracking over the message, no re-parsing
  from every brace) and searches only the first 1 MiB of a message for calls;
- invalid Unicode (lone surrogates from ``"\\ud800"`` escapes) in names and arguments is
  replaced by U+FFFD, so it can neither break a tokenizer nor a server connection.

A format is a ``ToolCallFormat``: its ``parse(text, tools)`` (``tools``: the OpenAI function
specs the model was shown, used by XML formats to give arguments their schema types; every call
of the text, in order), whether a turn may hold several calls (``parallel``; harmony: one call
per message), the ``stop_strings`` an engine stops at after one call when parallel tool calls
are off (``turn_stop_strings``), whether it needs the text decoded *with* special
tokens (``[TOOL_CALLS]``, harmony's ``<|channel|>``... are special tokens), and the
``markers`` that identify it in a chat template. ``tool_formats.choose_format(tokenizer, "auto")``
picks:
the tokenizer's ``response_template`` (transformers' declarative response parser) when it
has one, else the first format whose markers all appear in the chat template, else hermes.

verl: ``verl.experimental.agent_loop.tool_parser`` (hermes, gpt-oss; drops malformed calls with
a log line, materl keeps them as error calls). TRL: ``trl.chat_template_utils.parse_response``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from materl.registry import Registry
from materl.rollout._json_calls import (
    CALL_START,
    MAX_PARSE_CHARS,
    bad_call,
    call_from_json,
    call_from_obj,
    fences,
    join_content,
    load_json,
    looks_like_call,
    scan_json_calls,
)
from materl.rollout.types import ToolCall, ToolResult

__all__ = ["NOT_RUN_SERIAL", "TOOL_PARSERS", "ParsedMessage", "ToolCallFormat", "choose_format", "error_result",
           "one_call_per_turn", "parse_safely", "stop_strings", "tool_format"]


@dataclass
class ParsedMessage:
    """A model message split into the text the user sees and the tool calls it makes."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ToolCallFormat:
    """One way models write tool calls; calling it parses (``fmt(text, tools=None)``)."""

    name: str
    parse: Callable[[str, list[dict] | None], ParsedMessage]
    stop_strings: tuple[str, ...] = ()
    special_tokens: bool = False  # parse the text decoded with special tokens kept
    markers: tuple[str, ...] = ()  # all present in a chat template -> this format
    uses_prefix: bool = False  # parse(text, tools, prefix): also needs the prompt's tail text
    parallel: bool = True  # the format writes several calls in one turn (harmony: one per message)

    def turn_stop_strings(self, *, parallel_tool_calls: bool = True) -> tuple[str, ...]:
        """The stop strings of one model turn: none with parallel calls (the turn ends at the
        end-of-turn token, after as many calls as the model writes), else ``stop_strings`` (the
        turn ends after its first complete call)."""
        return () if parallel_tool_calls and self.parallel else self.stop_strings

    def __call__(self, text: str, tools: list[dict] | None = None, *, prefix: str = "") -> ParsedMessage:
        return self.parse(text, tools, prefix) if self.uses_prefix else self.parse(text, tools)


TOOL_PARSERS: Registry[ToolCallFormat] = Registry("tool_parser")
# "auto" checks formats in this order (the more specific markers first).


def tool_format(name: str, *, stop: tuple[str, ...] = (), special_tokens: bool = False,
                markers: tuple[str, ...] = (), parallel: bool = True):
    """Register ``fn(text, tools) -> ParsedMessage`` as the format ``name`` (``parallel``: whether
    a turn may hold several calls; ``stop``: where a turn with one call ends)."""

    def decorator(fn):
        TOOL_PARSERS.register(name, ToolCallFormat(name, fn, stop, special_tokens, markers, parallel=parallel))
        return fn

    return decorator


def as_format(obj: Any, name: str = "custom") -> ToolCallFormat:
    """A ``ToolCallFormat`` from one, or from a plain ``fn(text) -> ParsedMessage``."""
    if isinstance(obj, ToolCallFormat):
        return obj
    return ToolCallFormat(name, lambda text, tools: obj(text))


def parse_safely(fmt: ToolCallFormat, text: str, tools: list[dict] | None = None, *,
                 prefix: str = "") -> ParsedMessage:
    """``fmt(text, tools)``, but a format that raises (a user-registered one, or a bug) gives one
    malformed call instead of failing the episode."""
    try:
        return fmt(text, tools, prefix=prefix)
    except Exception as exc:  # noqa: BLE001 - model output must never end an episode
        return ParsedMessage(text.strip(), [bad_call(text, 0, f"the {fmt.name!r} tool-call parser failed: "
                                                               f"{type(exc).__name__}: {exc}")])


def split_parse_region(text: str) -> tuple[str, str]:
    """The part of a message searched for calls, and the rest (content only)."""
    return (text, "") if len(text) <= MAX_PARSE_CHARS else (text[:MAX_PARSE_CHARS], text[MAX_PARSE_CHARS:])


# -- hermes ------------------------------------------------------------------------------------

_CALL_OPEN, _CALL_CLOSE = "<tool_call>", "</tool_call>"


def tagged_blocks(text: str, open_tag: str, close_tag: str):
    """Yield ``("text", piece)`` and ``("block", start, body_start, end_or_None)`` in order.

    A block without its close tag before the next open tag (or the end) is unclosed
    (``end=None``) and runs to the next open tag. Tag positions are found once each, so this is
    linear even for thousands of unclosed tags."""
    opens, closes = _positions(text, open_tag), _positions(text, close_tag)
    pos, ci = 0, 0
    for k, start in enumerate(opens):
        if start < pos:
            continue
        yield "text", text[pos:start]
        body_start = start + len(open_tag)
        while ci < len(closes) and closes[ci] < body_start:
            ci += 1
        nxt = opens[k + 1] if k + 1 < len(opens) else len(text)
        if ci < len(closes) and closes[ci] < nxt:
            yield "block", start, body_start, closes[ci]
            pos = closes[ci] + len(close_tag)
        else:
            yield "block", start, body_start, None
            pos = nxt
    yield "text", text[pos:]


def _positions(text: str, tag: str) -> list[int]:
    out, pos = [], 0
    while (pos := text.find(tag, pos)) >= 0:
        out.append(pos)
        pos += len(tag)
    return out


@tool_format("hermes", stop=(_CALL_CLOSE,), markers=(_CALL_OPEN,))
def hermes(text: str, tools: list[dict] | None = None) -> ParsedMessage:
    """Hermes / Qwen2.5 / Qwen3 format: each call is ``<tool_call>{json}</tool_call>``.

    Content is the text outside the tags, stripped. A ``<tool_call>`` without its closing tag
    (generation cut by max tokens) is a malformed call; a stray ``</tool_call>`` is content.
    Engines must keep the stop string ``</tool_call>`` in the returned text.
    """
    region, rest = split_parse_region(text)
    calls: list[ToolCall] = []
    pieces: list[str] = []
    for item in tagged_blocks(region, _CALL_OPEN, _CALL_CLOSE):
        if item[0] == "text":
            pieces.append(item[1])
            continue
        _, start, body_start, end = item
        if end is None:
            stop = region.find(_CALL_OPEN, body_start)
            calls.append(bad_call(region[start : stop if stop >= 0 else len(region)], len(calls),
                                  "unclosed <tool_call> tag (no </tool_call>)"))
        else:
            calls.append(call_from_json(region[body_start:end], len(calls)))
    return ParsedMessage(content=join_content(pieces + [rest]), calls=calls)


# -- json --------------------------------------------------------------------------------------


@tool_format("json")
def json_calls(text: str, tools: list[dict] | None = None) -> ParsedMessage:
    """Calls written as bare JSON objects anywhere in the text, fenced (```json) or not.

    An object is a call when it has a ``"name"``, ``"arguments"`` or ``"parameters"`` key; a
    fenced list of such objects is several calls. Other JSON (an answer that happens to be
    JSON) stays in the content. Text that starts like a call object but does not parse is a
    malformed call, up to the end of its fence (or of the text when unfenced).
    """
    region, rest = split_parse_region(text)
    calls: list[ToolCall] = []
    pieces: list[str] = []
    pos = 0
    for start, body_start, body_end, end in fences(region):
        pieces.append(scan_json_calls(region[pos:start], calls))
        found = _fenced_calls(region[body_start:body_end], calls)
        pieces.append("" if found else region[start:end])
        pos = end
    pieces.append(scan_json_calls(region[pos:], calls))
    return ParsedMessage(content=join_content(pieces + [rest]), calls=calls)


def _fenced_calls(body: str, calls: list[ToolCall]) -> bool:
    """Append the calls in one fence body; False when the fence is not a call."""
    stripped = body.strip()
    obj, why = load_json(stripped)
    if why is not None:
        if CALL_START.search(stripped):
            calls.append(bad_call(body, len(calls), why))
            return True
        return False
    items = obj if isinstance(obj, list) else [obj]
    if not items or not all(looks_like_call(o) for o in items):
        return False
    for o in items:
        calls.append(call_from_obj(o, _dump(o) if len(items) > 1 else body, len(calls)))
    return True


def _dump(obj: Any) -> str:
    import json

    return json.dumps(obj, ensure_ascii=False)


# -- choosing a format, stop strings, error results --------------------------------------------


# ``ToolCall.error`` of the calls after the first in a turn when parallel tool calls are off
NOT_RUN_SERIAL = "parallel tool calls are off (parallel_tool_calls=False): only a turn's first call runs"


def one_call_per_turn(calls: list[ToolCall]) -> list[ToolCall]:
    """``parallel_tool_calls=False``: the first call as it is, every later one an error call
    (``NOT_RUN_SERIAL``) that is answered, never run, so the model learns to call one at a time."""
    out, ran = [], False
    for call in calls:
        if call.error is None and ran:
            call = ToolCall(call.name, call.arguments, id=call.id, raw=call.raw, error=NOT_RUN_SERIAL)
        ran = ran or call.error is None
        out.append(call)
    return out


def error_result(call: ToolCall) -> ToolResult:
    """The tool message the model sees for a malformed call (``call.error`` set)."""
    if call.error == NOT_RUN_SERIAL:
        return ToolResult(name=call.name, is_error=True, call_id=call.id, error_kind="invalid_call",
                          content=f"Error: this call was not run: only one tool call per turn is allowed here "
                                  f"(parallel tool calls are off). Call {call.name!r} again in a later turn.")
    why = call.error or "the call could not be parsed"
    return ToolResult(
        name=call.name,
        content=(
            f"Error: your tool call could not be parsed: {why}. Write each call as a JSON object "
            f'{{"name": "<tool name>", "arguments": {{"<argument>": <value>, ...}}}}.'
        ),
        is_error=True,
        call_id=call.id,
        error_kind="invalid_call",
    )
