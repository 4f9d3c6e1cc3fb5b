"""Tool-call parsers: model text in, ``ParsedMessage(content, calls)`` out.

    TOOL_PARSERS.get("hermes")('I will add. <tool_call>{"name": "calculate", '
                               '"arguments": {"expression": "2+3"}}</tool_call>')
    # ParsedMessage(content='I will add.', calls=[ToolCall(name='calculate', ...)])

A parser never raises on model output. A call the model got wrong (bad JSON, no name,
arguments that are not an object, an unclosed tag) comes back as
``ToolCall(name="", arguments={}, raw=<its text>, error=<what is wrong>)``, so the episode can
answer it with ``error_result(call)`` and the model learns from the message.

Accepted call objects (both parsers): ``{"name": str, "arguments": {...}}``. Leniencies, each
seen in real chat templates: ``"parameters"`` for ``"arguments"`` (Llama 3.1), arguments as a
JSON *string* holding an object (OpenAI wire format), and no ``"arguments"`` at all for a
tool without parameters (read as ``{}``).

verl: ``verl.experimental.agent_loop.tool_parser.HermesToolParser`` (regex over
``<tool_call>(.*?)</tool_call>``; it drops malformed calls with a log line, materl keeps them
as error calls). TRL: ``trl.chat_template_utils.parse_response`` (schema-driven regex).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from materl.registry import Registry
from materl.rollout.types import ToolCall, ToolResult

__all__ = ["TOOL_PARSERS", "ParsedMessage", "error_result", "stop_strings"]


@dataclass
class ParsedMessage:
    """A model message split into the text the user sees and the tool calls it makes."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)


Parser = Callable[[str], ParsedMessage]
TOOL_PARSERS: Registry[Parser] = Registry("tool_parser")

_STOP_STRINGS: dict[str, tuple[str, ...]] = {"hermes": ("</tool_call>",), "json": ()}

_CALL_OPEN, _CALL_CLOSE = "<tool_call>", "</tool_call>"
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_-]*)[ \t]*\n?(.*?)```", re.DOTALL)
_CALL_START = re.compile(r'\{\s*"(?:name|arguments|parameters)"\s*:')
_DECODER = json.JSONDecoder()


def _call_from_json(body: str, index: int) -> ToolCall:
    """One call from the JSON text of one call object; malformed text gives an error call."""
    raw = body
    body = _strip_fence(body.strip())
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return _bad(raw, index, f"the call is not valid JSON ({exc.msg} at char {exc.pos})")
    return _call_from_obj(obj, raw, index)


def _call_from_obj(obj: Any, raw: str, index: int) -> ToolCall:
    if not isinstance(obj, dict):
        return _bad(raw, index, f"a call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return _bad(raw, index, f'the call has no "name" string (got {name!r})')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # OpenAI wire format: arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return _bad(raw, index, f'"arguments" of {name!r} is a string that is not a JSON object')
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return _bad(raw, index, f'"arguments" of {name!r} must be an object, got {type(args).__name__}')
    return ToolCall(name=name.strip(), arguments=args, id=f"call_{index}", raw=raw)


def _bad(raw: str, index: int, error: str) -> ToolCall:
    return ToolCall(name="", arguments={}, id=f"call_{index}", raw=raw, error=error)


def _strip_fence(body: str) -> str:
    m = _FENCE.fullmatch(body)
    return m.group(2).strip() if m else body


@TOOL_PARSERS.register("hermes")
def hermes(text: str) -> ParsedMessage:
    """Hermes / Qwen2.5 / Qwen3 format: each call is ``<tool_call>{json}</tool_call>``.

    Content is the text outside the tags, stripped. A ``<tool_call>`` without its closing tag
    (generation cut by max tokens) is a malformed call; a stray ``</tool_call>`` is content.
    Engines must keep the stop string ``</tool_call>`` in the returned text.
    """
    calls: list[ToolCall] = []
    pieces: list[str] = []
    pos = 0
    while True:
        start = text.find(_CALL_OPEN, pos)
        if start < 0:
            pieces.append(text[pos:])
            break
        pieces.append(text[pos:start])
        body_start = start + len(_CALL_OPEN)
        end = text.find(_CALL_CLOSE, body_start)
        nested = text.find(_CALL_OPEN, body_start)
        if end < 0 or 0 <= nested < end:  # unclosed: the call runs to the next <tool_call>
            stop = nested if nested >= 0 else len(text)
            calls.append(_bad(text[start:stop], len(calls), "unclosed <tool_call> tag (no </tool_call>)"))
            pos = stop
            if stop == len(text):
                break
            continue
        calls.append(_call_from_json(text[body_start:end], len(calls)))
        pos = end + len(_CALL_CLOSE)
    return ParsedMessage(content=_join(pieces), calls=calls)


@TOOL_PARSERS.register("json")
def json_calls(text: str) -> ParsedMessage:
    """Calls written as bare JSON objects anywhere in the text, fenced (```json) or not.

    An object is a call when it has a ``"name"``, ``"arguments"`` or ``"parameters"`` key; a
    fenced list of such objects is several calls. Other JSON (an answer that happens to be
    JSON) stays in the content. Text that starts like a call object but does not parse is a
    malformed call, up to the end of its fence (or of the text when unfenced).
    """
    calls: list[ToolCall] = []
    pieces: list[str] = []
    pos = 0
    for m in _FENCE.finditer(text):
        pieces.append(_scan_unfenced(text[pos : m.start()], calls))
        found = _fenced_calls(m.group(2), calls)
        pieces.append("" if found else m.group(0))
        pos = m.end()
    pieces.append(_scan_unfenced(text[pos:], calls))
    return ParsedMessage(content=_join(pieces), calls=calls)


def _fenced_calls(body: str, calls: list[ToolCall]) -> bool:
    """Append the calls in one fence body; False when the fence is not a call."""
    stripped = body.strip()
    try:
        obj = json.loads(stripped)
    except json.JSONDecodeError as exc:
        if _CALL_START.search(stripped):
            calls.append(_bad(body, len(calls), f"the call is not valid JSON ({exc.msg} at char {exc.pos})"))
            return True
        return False
    items = obj if isinstance(obj, list) else [obj]
    if not items or not all(_looks_like_call(o) for o in items):
        return False
    for o in items:
        calls.append(_call_from_obj(o, json.dumps(o) if len(items) > 1 else body, len(calls)))
    return True


def _scan_unfenced(text: str, calls: list[ToolCall]) -> str:
    """Pull call objects out of unfenced text; returns the remaining content."""
    out: list[str] = []
    pos = 0
    while True:
        start = text.find("{", pos)
        if start < 0:
            out.append(text[pos:])
            return "".join(out)
        try:
            obj, end = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError as exc:
            if _CALL_START.match(text, start):
                out.append(text[pos:start])
                calls.append(_bad(text[start:], len(calls), f"the call is not valid JSON ({exc.msg})"))
                return "".join(out)
            out.append(text[pos : start + 1])
            pos = start + 1
            continue
        if _looks_like_call(obj):
            out.append(text[pos:start])
            calls.append(_call_from_obj(obj, text[start:end], len(calls)))
        else:
            out.append(text[pos:end])
        pos = end


def _looks_like_call(obj: Any) -> bool:
    return isinstance(obj, dict) and bool({"name", "arguments", "parameters"} & obj.keys())


def _join(pieces: list[str]) -> str:
    return re.sub(r"\n{3,}", "\n\n", "".join(pieces)).strip()


def stop_strings(parser_name: str) -> tuple[str, ...]:
    """Strings an engine may stop at so a turn ends right after a complete call.

    ``hermes`` -> ``("</tool_call>",)``; ``json`` -> ``()`` (a JSON object has no fixed end
    marker). Unknown names raise ``UnknownNameError`` listing the registered parsers.
    """
    TOOL_PARSERS.get(parser_name)
    return _STOP_STRINGS.get(parser_name, ())


def error_result(call: ToolCall) -> ToolResult:
    """The tool message the model sees for a malformed call (``call.error`` set)."""
    why = call.error or "the call could not be parsed"
    return ToolResult(
        name=call.name,
        content=(
            f"Error: your tool call could not be parsed: {why}. Write each call as a JSON object "
            f'{{"name": "<tool name>", "arguments": {{"<argument>": <value>, ...}}}}.'
        ),
        is_error=True,
        call_id=call.id,
    )
