"""Linear-time, never-raising helpers shared by the tool-call parsers: find balanced JSON
objects in model text, load them within depth and size limits, turn them into ``ToolCall``s,
and clean invalid Unicode.

Every function here runs in time linear in its input (the scanners walk the text once with
``str.find``-style moves that never go back) and turns every problem into a value: a
malformed call is ``ToolCall(name="", arguments={}, raw=<its text>, error=<what is wrong>)``.

Limits (a model can write anything; these keep one turn's parse cheap and bounded):
``MAX_DEPTH`` levels of JSON nesting (Python's ``json`` recurses and raises
``RecursionError`` near 1,000), ``MAX_CALL_CHARS`` characters per call, ``MAX_PARSE_CHARS``
characters of a message searched for calls (the rest is content).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from materl.rollout.types import ToolCall

MAX_DEPTH = 64
MAX_CALL_CHARS = 256 * 1024
MAX_PARSE_CHARS = 1024 * 1024
MAX_NAME_CHARS = 256

_SURROGATE = re.compile("[\ud800-\udfff]")
CALL_START = re.compile(r'\{\s*"(?:name|arguments|parameters)"\s*:')
_ID = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def clean_text(text: str) -> str:
    """``text`` with lone surrogates (``json.loads('"\\ud800"')`` makes them; they cannot be
    encoded as UTF-8, so a tokenizer or a transport would fail on them) replaced by U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)


def clean_value(value: Any, depth: int = 0) -> Any:
    """A JSON value with every string (keys included) passed through ``clean_text``."""
    if isinstance(value, str):
        return clean_text(value)
    if depth > MAX_DEPTH:
        return value
    if isinstance(value, dict):
        return {clean_text(k) if isinstance(k, str) else k: clean_value(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [clean_value(v, depth + 1) for v in value]
    return value


def bad_call(raw: str, index: int, error: str) -> ToolCall:
    """A malformed call: the episode answers it with ``parsers.error_result``."""
    return ToolCall(name="", arguments={}, id=f"call_{index}", raw=clean_text(raw[:MAX_CALL_CHARS]), error=error)


def json_depth(text: str, limit: int = MAX_DEPTH) -> int:
    """The nesting depth of ``[``/``{`` outside JSON strings, counting stops past ``limit``."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        elif ch in "]}":
            depth -= 1
    return deepest


def load_json(text: str) -> tuple[Any, str | None]:
    """``(value, None)`` or ``(None, why)``; never raises. Over-deep or over-long text is
    refused before ``json`` sees it."""
    if len(text) > MAX_CALL_CHARS:
        return None, f"the call is {len(text)} characters long; the limit is {MAX_CALL_CHARS}"
    if json_depth(text) > MAX_DEPTH:
        return None, f"the call is nested more than {MAX_DEPTH} levels deep"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, f"the call is not valid JSON ({exc.msg} at char {exc.pos})"
    except (RecursionError, ValueError) as exc:  # e.g. a number too long to convert
        return None, f"the call is not valid JSON ({type(exc).__name__}: {str(exc)[:200]})"


def call_from_obj(obj: Any, raw: str, index: int, *, args_key: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall:
    """One call from a loaded call object ``{"name": str, "arguments": {...}}``.

    Leniencies seen in real chat templates: ``"parameters"`` for ``"arguments"`` (Llama 3.1),
    arguments as a JSON string holding an object (OpenAI wire format), no arguments at all for
    a tool without parameters, an OpenAI ``{"function": {...}}`` wrapper, and an ``"id"``
    (Mistral) kept as the call id."""
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict) and "name" not in obj:
        obj = {**obj["function"], **({"id": obj["id"]} if "id" in obj else {})}
    if not isinstance(obj, dict):
        return bad_call(raw, index, f"a call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return bad_call(raw, index, f'the call has no "name" string (got {_short(name)})')
    name = clean_text(name.strip())
    if len(name) > MAX_NAME_CHARS or any(ord(c) < 32 for c in name):
        return bad_call(raw, index, f"the tool name {_short(name)} is not a valid name")
    args = next((obj[k] for k in args_key if k in obj), {})
    if isinstance(args, str):  # OpenAI wire format: arguments as a JSON string
        loaded, why = load_json(args) if args.strip() else ({}, None)
        if why is not None or not isinstance(loaded, dict):
            return bad_call(raw, index, f'"arguments" of {name!r} is a string that is not a JSON object')
        args = loaded
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return bad_call(raw, index, f'"arguments" of {name!r} must be an object, got {type(args).__name__}')
    call_id = obj.get("id")
    call_id = call_id if isinstance(call_id, str) and _ID.fullmatch(call_id) else f"call_{index}"
    return ToolCall(name=name, arguments=clean_value(args), id=call_id, raw=clean_text(raw))


def call_from_json(body: str, index: int, *, raw: str | None = None) -> ToolCall:
    """One call from the JSON text of one call object (fenced or not)."""
    raw = body if raw is None else raw
    obj, why = load_json(strip_fence(body.strip()))
    return bad_call(raw, index, why) if why is not None else call_from_obj(obj, raw, index)


def looks_like_call(obj: Any) -> bool:
    return isinstance(obj, dict) and bool({"name", "arguments", "parameters"} & obj.keys())


def strip_fence(body: str) -> str:
    """The inside of one ```` ```lang ... ``` ```` fence that spans all of ``body``, else ``body``."""
    if body.startswith("```") and body.endswith("```") and len(body) >= 6:
        inner = body[3:-3]
        first, nl, rest = inner.partition("\n")
        return (rest if nl and re.fullmatch(r"[ \t]*[A-Za-z0-9_-]*[ \t]*", first) else inner).strip()
    return body


def fences(text: str) -> list[tuple[int, int, int, int]]:
    """Code fences as ``(start, body_start, body_end, end)``: consecutive ```` ``` ```` marks
    paired in order (an unpaired last mark is text). One pass, linear."""
    marks, pos = [], 0
    while (pos := text.find("```", pos)) >= 0:
        marks.append(pos)
        pos += 3
    out = []
    for open_at, close_at in zip(marks[0::2], marks[1::2]):
        head_end = open_at + 3
        nl = text.find("\n", head_end, close_at)
        if nl >= 0 and re.fullmatch(r"[ \t]*[A-Za-z0-9_-]*[ \t]*", text[head_end:nl]):
            head_end = nl + 1
        out.append((open_at, head_end, close_at, close_at + 3))
    return out


def matching_braces(text: str) -> dict[int, int]:
    """For each ``{`` that is closed in ``text``: its position -> the position of its ``}``.

    One pass with a stack. Double-quoted strings are skipped only inside an open brace (prose
    quotes outside JSON do not count); ``[``/``]`` nest like braces; a closer that does not
    match the innermost opener is ignored; openers never closed are dropped."""
    match: dict[int, int] = {}
    stack: list[tuple[str, int]] = []
    in_string = escaped = False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"' and stack:
            in_string = True
        elif ch in "{[":
            stack.append((ch, i))
        elif ch in "}]" and stack and stack[-1][0] == ("{" if ch == "}" else "["):
            opener, at = stack.pop()
            if opener == "{":
                match[at] = i
    return match


def balanced_end(text: str, start: int, stop: int | None = None) -> int | None:
    """Position of the bracket closing the ``{`` or ``[`` at ``start`` (strings skipped), looking
    no further than ``stop``; None when it is not closed there. Linear in ``stop - start``."""
    stop = len(text) if stop is None else stop
    depth, in_string, escaped = 0, False, False
    for i in range(start, stop):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i
    return None


def scan_json_calls(text: str, calls: list[ToolCall]) -> str:
    """Pull call objects (JSON objects with a name/arguments/parameters key) out of prose.

    Returns the remaining content. Other JSON stays in the content. An object that starts like
    a call but is not valid JSON (or is never closed: the text runs to its end) is a malformed
    call. Each ``{`` is loaded at most once and a balanced object that loads is skipped whole,
    so the work is linear in ``len(text)`` (times the depth limit at most)."""
    match = matching_braces(text)
    starts = {m.start() for m in CALL_START.finditer(text)}
    out: list[str] = []
    pos = scan = 0
    for start in sorted(starts.union(match)):  # only braces that close or open a call
        if start < scan:
            continue
        is_call_start = start in starts
        end = match.get(start)
        if end is None:  # a call start never closed: the call runs to the end of the text
            out.append(text[pos:start])
            calls.append(bad_call(text[start:], len(calls), "the call is not valid JSON (it is never closed)"))
            return "".join(out)
        obj, why = load_json(text[start : end + 1]) if is_call_start or end - start < MAX_CALL_CHARS else (None, "")
        if why is None and looks_like_call(obj):
            out.append(text[pos:start])
            calls.append(call_from_obj(obj, text[start : end + 1], len(calls)))
            pos = scan = end + 1
        elif why is None:
            scan = end + 1  # other JSON: stays in the content, its inside is not searched again
        elif is_call_start:
            out.append(text[pos:start])
            calls.append(bad_call(text[start : end + 1], len(calls), why))
            pos = scan = end + 1
    out.append(text[pos:])
    return "".join(out)


def coerce_arguments(args: Mapping[str, str], schema: Mapping[str, Any] | None) -> dict[str, Any]:
    """XML-style arguments arrive as text; give each the type its tool's JSON schema declares
    (integer, number, boolean, null, object, array), keeping the text when it does not convert
    (the server's validation then answers). Without a schema every value stays text."""
    props = (schema or {}).get("properties") if isinstance(schema, Mapping) else None
    props = props if isinstance(props, Mapping) else {}
    return {k: _coerce(v, _types(props.get(k))) for k, v in args.items()}


def _types(spec: Any) -> tuple[str, ...]:
    if not isinstance(spec, Mapping):
        return ()
    declared = spec.get("type")
    out = [declared] if isinstance(declared, str) else [t for t in declared or () if isinstance(t, str)]
    for choice in (spec.get("anyOf") or []) + (spec.get("oneOf") or []):
        out.extend(_types(choice))
    return tuple(out)


_PY_LITERALS = {"True": "true", "False": "false", "None": "null"}  # str() of Python values in templates


def _coerce(raw: str, types: tuple[str, ...]) -> Any:
    text = raw.strip()
    text = _PY_LITERALS.get(text, text)
    for kind in types:
        if kind == "string":
            return raw
        if kind in ("integer", "number", "boolean", "null", "object", "array"):
            value, why = load_json(text)
            ok = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
                  "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
                  "boolean": lambda v: isinstance(v, bool), "null": lambda v: v is None,
                  "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list)}[kind]
            if why is None and ok(value):
                return clean_value(value)
    return raw


def join_content(pieces: list[str]) -> str:
    """Content pieces joined, runs of 3+ newlines squeezed to 2, stripped."""
    return re.sub(r"\n{3,}", "\n\n", "".join(pieces)).strip()


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
