"""The tool-call formats of the model families trained today, beyond hermes and plain JSON.

Each is registered in ``materl.rollout.parsers.TOOL_PARSERS`` and keeps that module's
guarantees (never raises, linear time, malformed calls as error calls, invalid Unicode
replaced). The exact text each expects is the one its chat template renders for an assistant
tool call; ``tests/rollout/templates/`` holds those templates and the tests check each format
token for token against them.

- ``qwen3_coder``: Qwen3-Coder / Qwen3.5 XML inside ``<tool_call>``:
  ``<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>``; values are text,
  converted to the type the tool's schema declares (integer, number, boolean, object, ...).
- ``llama3_json``: Llama 3.1-3.3 JSON tool calling: the whole message is
  ``{"name": ..., "parameters": {...}}`` (several separated by ``;``), optionally after
  ``<|python_tag|>``.
- ``mistral``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": "abcdefghi"}]`` (v3
  tokenizers) and ``[TOOL_CALLS]NAME[ARGS]{...}`` (v11+, Mistral Small 3.x, Devstral).
- ``harmony``: gpt-oss: ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
  {...}<|call|>``; the content is the ``final`` channel.
- ``response_template`` (not registered by name; ``choose_format(tokenizer, "auto")`` builds it):
  transformers' declarative response parser (``tokenizer.response_template``), used as is; its
  output is converted to ``ToolCall``s, and when it raises, the format the chat template's
  markers name parses instead. Its input is bounded to 1 MiB; its running time is transformers'.
"""

from __future__ import annotations

import json
import re
from typing import Any

from materl.rollout._json_calls import (
    bad_call,
    balanced_end,
    call_from_obj,
    clean_text,
    coerce_arguments,
    join_content,
    load_json,
    looks_like_call,
    matching_braces,
)
from materl.rollout.parsers import (
    TOOL_PARSERS,
    ParsedMessage,
    ToolCallFormat,
    as_format,
    split_parse_region,
    tagged_blocks,
    tool_format,
)
from materl.rollout.types import ToolCall

# -- Qwen3-Coder XML ---------------------------------------------------------------------------

_FUNC_OPEN, _FUNC_CLOSE = "<function=", "</function>"
_PARAM_OPEN, _PARAM_CLOSE = "<parameter=", "</parameter>"


@tool_format("qwen3_coder", stop=("</tool_call>",), markers=(_FUNC_OPEN, _PARAM_OPEN))
def qwen3_coder(text: str, tools: list[dict] | None = None) -> ParsedMessage:
    """``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``."""
    region, rest = split_parse_region(text)
    schemas = _schemas(tools)
    calls: list[ToolCall] = []
    pieces: list[str] = []
    for item in tagged_blocks(region, "<tool_call>", "</tool_call>"):
        if item[0] == "text":
            pieces.append(item[1])
            continue
        _, start, body_start, end = item
        if end is None:
            stop = region.find("<tool_call>", body_start)
            calls.append(bad_call(region[start : stop if stop >= 0 else len(region)], len(calls),
                                  "unclosed <tool_call> tag (no </tool_call>)"))
        else:
            calls.append(_xml_call(region[body_start:end], len(calls), schemas))
    return ParsedMessage(join_content(pieces + [rest]), calls)


def _xml_call(body: str, index: int, schemas: dict[str, Any]) -> ToolCall:
    head = body.find(_FUNC_OPEN)
    name_end = body.find(">", head + len(_FUNC_OPEN)) if head >= 0 else -1
    if head < 0 or name_end < 0:
        return bad_call(body, index, "the call has no <function=NAME> tag")
    name = body[head + len(_FUNC_OPEN) : name_end].strip()
    close = body.find(_FUNC_CLOSE, name_end)
    if not name or "\n" in name:
        return bad_call(body, index, f"the function name {name[:80]!r} is not a valid name")
    if close < 0:
        return bad_call(body, index, f"<function={name}> is not closed (no </function>)")
    args: dict[str, str] = {}
    pos = name_end + 1
    while (p := body.find(_PARAM_OPEN, pos, close)) >= 0:
        key_end = body.find(">", p + len(_PARAM_OPEN), close)
        value_end = body.find(_PARAM_CLOSE, key_end, close) if key_end >= 0 else -1
        if key_end < 0 or value_end < 0:
            return bad_call(body, index, f"a <parameter=...> of {name!r} is not closed (no </parameter>)")
        key = body[p + len(_PARAM_OPEN) : key_end].strip()
        value = body[key_end + 1 : value_end]
        value = value[1:] if value.startswith("\n") else value
        args[clean_text(key)] = clean_text(value[:-1] if value.endswith("\n") else value)
        pos = value_end + len(_PARAM_CLOSE)
    typed = coerce_arguments(args, schemas.get(name))
    return ToolCall(name=clean_text(name), arguments=typed, id=f"call_{index}", raw=clean_text(body))


def _schemas(tools: list[dict] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for spec in tools or []:
        fn = spec.get("function", spec) if isinstance(spec, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out[fn["name"]] = fn.get("parameters")
    return out


# -- Llama 3.x JSON ----------------------------------------------------------------------------

_LLAMA_TAG = "<|python_tag|>"
_LLAMA_ENDS = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")


@tool_format("llama3_json", special_tokens=True, markers=("<|start_header_id|>", '"parameters"'))
def llama3_json(text: str, tools: list[dict] | None = None) -> ParsedMessage:
    """The message is one or more call objects separated by ``;``, after an optional
    ``<|python_tag|>``; any other message (including JSON that is not a call) is content."""
    region, rest = split_parse_region(_strip_ends(text, _LLAMA_ENDS))
    body = region.strip()
    tagged = body.startswith(_LLAMA_TAG)
    body = body[len(_LLAMA_TAG):].lstrip() if tagged else body
    if not body.startswith("{"):
        return ParsedMessage(join_content([body if tagged else region, rest]))
    match = matching_braces(body)
    calls: list[ToolCall] = []
    pos = 0
    while pos < len(body):
        end = match.get(pos)
        if end is None:
            calls.append(bad_call(body[pos:], len(calls), "the call is not valid JSON (it is never closed)"))
            break
        obj, why = load_json(body[pos : end + 1])
        if why is None and not looks_like_call(obj) and not calls:
            return ParsedMessage(join_content([region, rest]))  # a JSON answer, not a call
        calls.append(bad_call(body[pos : end + 1], len(calls), why) if why is not None
                     else call_from_obj(obj, body[pos : end + 1], len(calls)))
        pos = end + 1
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
        if pos < len(body) and body[pos] != "{":
            return ParsedMessage(join_content([body[pos:], rest]), calls)
    return ParsedMessage(join_content([rest]), calls)


def _strip_ends(text: str, ends: tuple[str, ...]) -> str:
    for _ in range(4):  # e.g. "<|eom_id|><|end_of_text|>"
        stripped = text.rstrip()
        hit = next((e for e in ends if stripped.endswith(e)), None)
        if hit is None:
            return text
        text = stripped[: -len(hit)]
    return text


# -- Mistral -----------------------------------------------------------------------------------

_TOOL_CALLS, _ARGS, _CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


@tool_format("mistral", special_tokens=True, markers=(_TOOL_CALLS,))
def mistral(text: str, tools: list[dict] | None = None) -> ParsedMessage:
    """``[TOOL_CALLS] [{...}, ...]`` (v3) or ``[TOOL_CALLS]NAME[ARGS]{...}`` (v11+), repeated."""
    region, rest = split_parse_region(_strip_ends(text, ("</s>",)))
    marks = [m.start() for m in re.finditer(re.escape(_TOOL_CALLS), region)]
    if not marks:
        return ParsedMessage(join_content([region, rest]))
    calls: list[ToolCall] = []
    for k, mark in enumerate(marks):
        stop = marks[k + 1] if k + 1 < len(marks) else len(region)
        _mistral_segment(region, mark + len(_TOOL_CALLS), stop, calls)
    return ParsedMessage(join_content([region[: marks[0]], rest]), calls)


def _mistral_segment(text: str, start: int, stop: int, calls: list[ToolCall]) -> None:
    pos = start
    while pos < stop and text[pos] in " \t\r\n":
        pos += 1
    if pos < stop and text[pos] in "[{":
        end = balanced_end(text, pos, stop)
        if end is None:
            calls.append(bad_call(text[pos:stop], len(calls), "the call is not valid JSON (it is never closed)"))
            return
        obj, why = load_json(text[pos : end + 1])
        if why is not None:
            calls.append(bad_call(text[pos : end + 1], len(calls), why))
            return
        for item in obj if isinstance(obj, list) else [obj]:
            raw = json.dumps(item, ensure_ascii=False) if isinstance(obj, list) else text[pos : end + 1]
            calls.append(call_from_obj(item, raw, len(calls)))
        return
    args_at = text.find(_ARGS, pos, stop)
    if args_at < 0:
        calls.append(bad_call(text[start:stop], len(calls), f"a call after {_TOOL_CALLS} has no {_ARGS}"))
        return
    name, _, call_id = text[pos:args_at].partition(_CALL_ID)
    body_at = args_at + len(_ARGS)
    while body_at < stop and text[body_at] in " \t\r\n":
        body_at += 1
    end = balanced_end(text, body_at, stop) if body_at < stop and text[body_at] == "{" else None
    if end is None:
        calls.append(bad_call(text[start:stop], len(calls), f"the arguments of {name.strip()[:80]!r} are not a "
                                                             f"closed JSON object"))
        return
    obj = {"name": name.strip(), "arguments": text[body_at : end + 1],
           **({"id": call_id.strip()} if call_id.strip() else {})}
    calls.append(call_from_obj(obj, text[start : end + 1], len(calls)))


# -- gpt-oss harmony ---------------------------------------------------------------------------

_H_START, _H_MESSAGE, _H_CHANNEL = "<|start|>", "<|message|>", "<|channel|>"
_H_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_H_TOKENS = re.compile(r"<\|(?:start|end|message|channel|constrain|call|return)\|>")


@tool_format("harmony", stop=("<|call|>",), special_tokens=True, markers=(_H_CHANNEL, "<|call|>"), parallel=False)
def harmony(text: str, tools: list[dict] | None = None) -> ParsedMessage:
    """Messages ``[<|start|>ROLE]HEADER<|message|>BODY<|end|>|<|call|>|<|return|>``; a header
    with ``to=functions.NAME`` (or any ``to=RECIPIENT``) makes its body a call; the content
    is the ``final`` channel (or, without one, the bodies of messages on no channel)."""
    region, rest = split_parse_region(text)
    if _H_MESSAGE not in region:
        return ParsedMessage(join_content([_H_TOKENS.sub("", region), rest]))
    calls: list[ToolCall] = []
    final: list[str] = []
    plain: list[str] = []
    for chunk in region.split(_H_START):
        head, sep, body = chunk.partition(_H_MESSAGE)
        if not sep:
            continue
        end = min((i for i in (body.find(e) for e in _H_ENDS) if i >= 0), default=len(body))
        body = body[:end]
        recipient = re.search(r"\bto=([^\s<]+)", head)
        channel = re.search(r"<\|channel\|>\s*([A-Za-z_]+)", head)
        if recipient:
            name = recipient.group(1)
            name = name[len("functions."):] if name.startswith("functions.") else name
            obj, why = load_json(body.strip()) if body.strip() else ({}, None)
            raw = head + _H_MESSAGE + body
            calls.append(bad_call(raw, len(calls), why) if why is not None
                         else call_from_obj({"name": name, "arguments": obj}, raw, len(calls)))
        elif channel and channel.group(1) == "final":
            final.append(body)
        elif not channel:
            plain.append(body)
    return ParsedMessage(join_content(["\n".join(final or plain), rest]), calls)


# -- transformers' response_template -----------------------------------------------------------


def response_template_format(tokenizer: Any) -> ToolCallFormat:
    """A format over ``transformers.utils.chat_parsing.parse_response`` with the tokenizer's
    ``response_template``; the marker-chosen format parses when transformers' parser raises."""
    from transformers.utils.chat_parsing import parse_response

    template = tokenizer.response_template

    def parse(text: str, tools: list[dict] | None, prefix: str) -> ParsedMessage:
        region, rest = split_parse_region(text)
        try:
            message = parse_response(region, template, prefix=prefix or "", tools=tools or None)
        except Exception:  # noqa: BLE001 - malformed output: the template's own markers parse it
            return _fallback(tokenizer)(text, tools)
        return _from_message(message, rest)

    fallback = _fallback(tokenizer)
    return ToolCallFormat("response_template", parse, stop_strings=fallback.stop_strings,
                          special_tokens=True, uses_prefix=True, parallel=fallback.parallel)


def _fallback(tokenizer: Any) -> ToolCallFormat:
    class _NoResponseTemplate:
        chat_template = getattr(tokenizer, "chat_template", None)

    return choose_format(_NoResponseTemplate(), "auto")


def _from_message(message: Any, rest: str) -> ParsedMessage:
    if not isinstance(message, dict):
        return ParsedMessage(join_content([str(message), rest]))
    content = message.get("content") or ""
    content = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False, default=str)
    calls: list[ToolCall] = []
    for item in message.get("tool_calls") or []:
        calls.append(call_from_obj(item, json.dumps(item, ensure_ascii=False, default=str), len(calls)))
    return ParsedMessage(join_content([clean_text(content), rest]), calls)


# -- choosing a format -----------------------------------------------------------------------

AUTO_ORDER = ["harmony", "mistral", "qwen3_coder", "hermes", "llama3_json"]


def choose_format(tokenizer: Any, requested: str | ToolCallFormat = "auto") -> ToolCallFormat:
    """The format to parse a model's output with.

    ``requested`` other than ``"auto"``: that registered format (unknown names raise
    ``UnknownNameError`` listing the valid ones). ``"auto"``: transformers' response parser when
    the tokenizer declares a ``response_template``; else the first of ``AUTO_ORDER`` whose
    markers all appear in the chat template; else ``hermes``."""
    if isinstance(requested, ToolCallFormat):
        return requested
    if requested != "auto":
        return as_format(TOOL_PARSERS.get(requested), requested)
    if getattr(tokenizer, "response_template", None):
        return response_template_format(tokenizer)
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default") or ""
    for name in AUTO_ORDER:
        fmt = TOOL_PARSERS.get(name)
        if fmt.markers and all(m in template for m in fmt.markers):
            return fmt
    return TOOL_PARSERS.get("hermes")


def stop_strings(parser_name: str) -> tuple[str, ...]:
    """Strings an engine may stop at so a turn ends right after a complete call.

    ``hermes`` -> ``("</tool_call>",)``; ``json`` -> ``()`` (a JSON object has no fixed end
    marker). Unknown names raise ``UnknownNameError`` listing the registered parsers.
    """
    return as_format(TOOL_PARSERS.get(parser_name)).stop_strings
