"""Bounded tool output: what a tool returns enters an episode's context cut to two budgets.

1. Bytes, in the Toolbox, before anything tokenizes it: ``mcp_tools(max_output_bytes=65536)``.
   A 1 MB result costs one slice, not a million-token tokenizer call.
2. Tokens, when the episode appends the result (``generate_step(..., max_tool_output_tokens=)``,
   the compile option ``max_tool_output_tokens``): the content is tokenized alone, cut to the
   budget and decoded back, so the tool turn carries at most that many content tokens.

A cut result ends with a visible marker the model can read,
``[... tool output truncated: N of M bytes shown]`` (or ``tokens``), and its ``ToolResult``
records the sizes in ``truncated`` (the tool step's metadata lists them too).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from materl.rollout._json_calls import clean_text
from materl.rollout.types import ToolResult

DEFAULT_MAX_OUTPUT_BYTES = 64 * 1024


def marker(kept: int, total: int, unit: str) -> str:
    return f"\n[... tool output truncated: {kept} of {total} {unit} shown]"


def cap_bytes(result: ToolResult, max_bytes: int) -> ToolResult:
    """``result`` with its content cut to ``max_bytes`` UTF-8 bytes (on a character boundary)
    and invalid Unicode replaced."""
    text = clean_text(result.content)
    if len(text) * 4 <= max_bytes:  # cannot be over: no need to encode
        return replace(result, content=text) if text is not result.content else result
    data = text.encode("utf-8")
    if len(data) <= max_bytes:
        return replace(result, content=text)
    kept = data[:max_bytes].decode("utf-8", "ignore")  # drops a cut multi-byte character
    total = (result.truncated or {}).get("bytes") or len(data)  # cut before: the original size
    info = {"bytes": total, "kept_bytes": len(kept.encode("utf-8")), "tokens": None, "kept_tokens": None}
    return replace(result, content=kept + marker(info["kept_bytes"], total, "bytes"), truncated=info)


def cap_tokens(tokenizer: Any, result: ToolResult, max_tokens: int | None) -> ToolResult:
    """``result`` with its content cut to ``max_tokens`` tokens of ``tokenizer`` (None: no cap)."""
    if max_tokens is None or len(result.content) <= max_tokens:  # a token is at least one character
        return result
    ids = tokenizer(result.content, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return result
    kept = tokenizer.decode(ids[:max_tokens])
    info = dict(result.truncated or {"bytes": len(result.content.encode("utf-8", "replace")), "kept_bytes": None})
    info.update(tokens=len(ids), kept_tokens=max_tokens)
    return replace(result, content=kept + marker(max_tokens, len(ids), "tokens"), truncated=info)
