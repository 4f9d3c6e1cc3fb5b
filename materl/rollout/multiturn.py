"""Multi-turn episodes with exact token ids.

The context of turn k+1 is turn k's exact ids, plus the tokens the model sampled, plus the
tokens of the chat-template glue that carries the tool results. Only that glue is tokenized; the
history is never re-tokenized, so what the learner trains on is exactly what the engine saw.

    state = EpisodeState.start(tokenizer, prompt, tools=specs)
    result = await generate_step(engine, tokenizer, state, None, params)   # turn 1
    results = [await toolbox.call(c.name, c.arguments) for c in result.tool_requests]
    result = await generate_step(engine, tokenizer, result.history, results, params)   # turn 2
    rollout = result.history.to_rollout()
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import anyio

from materl.engines.base import SamplingParams
from materl.errors import EngineError, EpisodeError
from materl.rollout.parsers import error_result, one_call_per_turn, parse_safely
from materl.rollout.tool_formats import choose_format
from materl.rollout.tool_output import DEFAULT_MAX_OUTPUT_BYTES, cap_bytes, cap_tokens
from materl.rollout.types import Rollout, Step, ToolCall, ToolResult

_SENTINEL = "\x00materl-sentinel\x00"
PARSE_INLINE_CHARS = 16_384  # longer generated turns are parsed in a worker thread


def prompt_messages(prompt: Any, system: str | None = None) -> list[dict]:
    """A prompt (str, chat messages, or a row with 'prompt'/'messages') as chat messages."""
    if isinstance(prompt, dict):
        prompt = prompt.get("messages") or prompt.get("prompt")
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
        messages = [dict(m) for m in prompt]
    else:
        raise EngineError(f"a prompt must be a string or a list of chat messages, got {type(prompt).__name__}")
    if system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    return messages


def render(tokenizer, messages: list[dict], *, tools=None, add_generation_prompt: bool) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")
    kw = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw)


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass
class EpisodeState:
    """Everything an episode has seen so far, as exact token ids plus the chat messages."""

    ids: list[int]
    prompt_len: int
    messages: list[dict]
    tools: list[dict] | None = None
    steps: list[Step] = field(default_factory=list)
    done: bool = False
    truncated: str | None = None  # why the episode ended early ("context": the next turn would not fit)

    @classmethod
    def start(cls, tokenizer, prompt: Any, *, system: str | None = None, tools=None) -> EpisodeState:
        messages = prompt_messages(prompt, system)
        ids = encode(tokenizer, render(tokenizer, messages, tools=tools, add_generation_prompt=True))
        return cls(ids, len(ids), messages, tools)

    @property
    def last_step(self) -> Step | None:
        return self.steps[-1] if self.steps else None

    @property
    def pending_calls(self) -> list[ToolCall]:
        last = self.last_step
        return list(last.tool_calls) if last is not None and last.kind == "generate" else []

    def to_rollout(self) -> Rollout:
        meta = {"truncated": self.truncated} if self.truncated else {}
        return Rollout(self.ids[: self.prompt_len], list(self.steps), messages=list(self.messages), metadata=meta)

    @property
    def rollout(self) -> Rollout:
        return self.to_rollout()


@dataclass
class TurnResult:
    """What ``ml.generate_step`` yields: the episode after the step, and the step (None when the
    episode had already ended, so a fixed unrolled recipe can run past an early final answer)."""

    history: EpisodeState
    step: Step | None

    @property
    def tool_requests(self) -> list[ToolCall]:
        return self.step.tool_requests if self.step is not None else []

    @property
    def text(self) -> str:
        return self.step.text if self.step is not None else ""

    @property
    def token_ids(self) -> list[int]:
        return self.step.token_ids if self.step is not None else []

    @property
    def logprobs(self) -> list[float]:
        return self.step.logprobs if self.step is not None else []

    @property
    def done(self) -> bool:
        return self.history.done

    @property
    def rollout(self) -> Rollout:
        return self.history.to_rollout()


def _assistant_suffix(tokenizer, messages: list[dict], tools) -> str:
    """The template text that closes an assistant turn (e.g. '<|im_end|>\\n')."""
    probe = messages + [{"role": "assistant", "content": _SENTINEL}]
    return render(tokenizer, probe, tools=tools, add_generation_prompt=False).split(_SENTINEL)[-1]


def _as_results(responses: Any, calls: list[ToolCall]) -> list[ToolResult]:
    if isinstance(responses, dict):
        responses = responses.get("tool_responses", list(responses.values()))
    if isinstance(responses, (str, ToolResult)):
        responses = [responses]
    out = []
    for i, r in enumerate(responses or []):
        if isinstance(r, ToolResult):
            out.append(r)
        else:
            name = calls[i].name if i < len(calls) else "tool"
            out.append(ToolResult(name=name, content=str(r)))
    return out


def append_tool_results(tokenizer, state: EpisodeState, results: list[ToolResult], *,
                        max_output_tokens: int | None = None) -> EpisodeState:
    """Close the assistant turn and add the tool turn(s): only the new glue text is tokenized.

    Each result's content is cut to the byte cap (``tool_output.DEFAULT_MAX_OUTPUT_BYTES``),
    then to ``max_output_tokens`` tokens (None: no token cap), with a visible marker."""
    results = [cap_tokens(tokenizer, cap_bytes(r, DEFAULT_MAX_OUTPUT_BYTES), max_output_tokens) for r in results]
    messages = [{"role": "tool", "name": r.name, "content": r.content, "tool_call_id": r.call_id} for r in results]
    return append_turn(tokenizer, state, messages, results=results)


def append_turn(tokenizer, state: EpisodeState, new_messages: list[dict], *,
                results: list[ToolResult] = ()) -> EpisodeState:
    """Close the assistant turn and add ``new_messages`` (tool results, or an environment's
    observation as a user turn) as one untrained step; only the new glue text is tokenized."""
    before = render(tokenizer, state.messages, tools=state.tools, add_generation_prompt=False)
    closing = _closing(tokenizer, state, before)
    messages = state.messages + list(new_messages)
    after = render(tokenizer, messages, tools=state.tools, add_generation_prompt=True)
    if not after.startswith(before):
        raise EngineError("the chat template re-renders earlier turns when a tool turn is added; "
                          "materl needs a prefix-stable template to keep token ids exact")
    ids = encode(tokenizer, closing + after[len(before):])
    step = Step("tool", ids, [], text=closing + after[len(before):], tool_results=list(results),
                latency_s=sum(r.latency_s for r in results),
                error="; ".join(r.content for r in results if r.is_error) or None,
                metadata=_tool_metadata(results) if results else {"roles": [m["role"] for m in new_messages]})
    return replace(state, ids=state.ids + ids, messages=messages, steps=state.steps + [step])


async def sample_turn(engine, tokenizer, ids: list[int], params: SamplingParams) -> Step:
    """One model turn continuing ``ids``: the engine's exact token ids and sampling log-probs,
    the decoded text, the latency, the weights version that sampled it and (device loop) the
    prompt tokens it prefilled and reused from a kept cache, as a generate ``Step``. Single-turn generation,
    ``generate_step`` and environments all sample through here."""
    t0 = time.perf_counter()
    gen = await engine.generate(ids, params)
    text = tokenizer.decode(gen.token_ids, skip_special_tokens=True)
    meta = {k: gen.metadata[k] for k in ("version", "prefilled", "reused") if k in gen.metadata}
    return Step("generate", list(gen.token_ids), list(gen.logprobs), text=text, finish_reason=gen.finish_reason,
                latency_s=time.perf_counter() - t0, metadata=meta)


def _closing(tokenizer, state: EpisodeState, before: str) -> str:
    """The template text that follows the model's last sampled token in its own turn.

    Where the template renders the turn ending with the text the model sampled (its last
    characters, special tokens included: ``...</tool_call>``, ``...<|call|>``), the closing is
    what follows it in ``before``; otherwise it is the end of a plain assistant turn (e.g.
    ``<|im_end|>\n``) minus the end-of-turn token the model already sampled."""
    last = state.last_step
    if not last or not last.token_ids:
        return _assistant_suffix(tokenizer, state.messages[:-1], state.tools)
    tail = tokenizer.decode(last.token_ids[-8:], skip_special_tokens=False)[-24:]
    turn_start = len(render(tokenizer, state.messages[:-1], tools=state.tools, add_generation_prompt=False))
    at = before.rfind(tail) if tail.strip() else -1
    if at >= turn_start:  # found inside the rendering of the model's own turn
        return before[at + len(tail):]
    suffix = _assistant_suffix(tokenizer, state.messages[:-1], state.tools)
    eos_text = tokenizer.decode(last.token_ids[-1:])
    return suffix[len(eos_text):] if eos_text and suffix.startswith(eos_text) else suffix


def _tool_metadata(results: list[ToolResult]) -> dict[str, Any]:
    """A tool step's metadata: tool names, each failed call's error kind, each cut output's sizes."""
    meta: dict[str, Any] = {"tools": [r.name for r in results]}
    errors = {r.call_id or str(i): r.error_kind or "tool" for i, r in enumerate(results) if r.is_error}
    if errors:
        meta["errors"] = errors
    cut = [{"call_id": r.call_id, **r.truncated} for r in results if r.truncated]
    if cut:
        meta["truncated"] = cut
    return meta


def _assistant_message(text: str, parsed) -> dict[str, Any]:
    """The chat message of a generate step; well-formed calls also as OpenAI ``tool_calls`` (some
    templates, e.g. Mistral's, check that tool turns follow them). Only template glue is ever
    tokenized from messages, so this never changes the step's sampled ids."""
    calls = [c for c in parsed.calls if c.error is None]
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": parsed.content,
            "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in calls]}


async def _parse(fmt, tokenizer, state: EpisodeState, token_ids: list[int], text: str):
    """Parse a generated turn with ``fmt``: the text decoded with special tokens when the format
    needs them; a long message is parsed in a worker thread, off the event loop."""
    raw = tokenizer.decode(token_ids, skip_special_tokens=False) if fmt.special_tokens else text
    prefix = tokenizer.decode(state.ids[-512:], skip_special_tokens=False) if fmt.uses_prefix else ""
    if len(raw) <= PARSE_INLINE_CHARS:
        return parse_safely(fmt, raw, state.tools, prefix=prefix)
    return await anyio.to_thread.run_sync(lambda: parse_safely(fmt, raw, state.tools, prefix=prefix))


async def generate_step(engine, tokenizer, state: EpisodeState, tool_responses: Any, params: SamplingParams,
                        *, parser: str = "auto", max_tool_output_tokens: int | None = None,
                        parallel_tool_calls: bool = True, max_context: int | None = None,
                        context_limit: str = "end") -> TurnResult:
    """One model turn: append the answers to the previous turn's calls (exact tokens, in call
    order), generate, and parse the calls with ``parser`` (``"auto"``: the format the chat
    template declares; see ``tool_formats.choose_format``); ``parallel_tool_calls`` as in
    ``model_turn``. Model output never raises here: malformed calls are error calls.

    ``max_context``: the model's context in tokens. A turn whose context so far plus
    ``params.max_new_tokens`` would exceed it is not sampled (``check_context``)."""
    if state.done:
        return TurnResult(state, None)
    if state.steps:
        calls = state.pending_calls
        if not calls:
            return TurnResult(replace(state, done=True), None)
        results = in_call_order(calls, _as_results(tool_responses, [c for c in calls if c.error is None]))
        state = append_tool_results(tokenizer, state, results, max_output_tokens=max_tool_output_tokens)
    if max_context is not None and len(state.ids) + params.max_new_tokens > max_context:
        return TurnResult(check_context(state, params.max_new_tokens, max_context, context_limit), None)
    return await model_turn(engine, tokenizer, state, params, parser=parser, parallel_tool_calls=parallel_tool_calls)


def in_call_order(calls: list[ToolCall], results: list[ToolResult]) -> list[ToolResult]:
    """The tool turn's results in the order the model wrote its calls: ``results`` answer the
    well-formed calls (in order), each malformed call gets its ``error_result`` in its place;
    results beyond the calls (a custom op's extras) follow."""
    good = iter(results)
    out = [error_result(c) if c.error is not None else next(good, None) for c in calls]
    return [r for r in out if r is not None] + list(good)


def check_context(state: EpisodeState, max_new_tokens: int, max_context: int, context_limit: str) -> EpisodeState:
    """The episode whose next turn would not fit the model's context: ended as it stands, marked
    ``truncated="context"`` (its rollout's ``metadata["truncated"]``; the step counts it in
    ``episodes/truncated_context``), or with ``context_limit="fail"`` an ``EpisodeError``.
    (verl multi-turn: ``max_model_len`` ends the trajectory; SkyRL: ``max_input_length`` truncates.)"""
    if context_limit == "fail":
        raise EpisodeError(f"the next turn needs {len(state.ids)} tokens of context + max_new_tokens={max_new_tokens}"
                           f" = {len(state.ids) + max_new_tokens}, over the model's context of {max_context} "
                           f"tokens (context_limit='fail'; 'end' ends the episode before that turn instead)")
    return replace(state, done=True, truncated="context")


async def model_turn(engine, tokenizer, state: EpisodeState, params: SamplingParams, *,
                     parser: str = "auto", parallel_tool_calls: bool = True) -> TurnResult:
    """Sample the model's turn after ``state`` (exact ids) and parse its tool calls with
    ``parser``; the episode is done when the turn makes no call or hits its token limit.
    ``generate_step`` and the OpenAI-compatible endpoint (``rollout/endpoint.py``) sample here.

    ``parallel_tool_calls`` (OpenAI's flag, on by default there too): the turn runs to the model's
    end of turn and keeps every call it writes (Qwen, Llama 3.x, Mistral write several; a format
    with one call per message, gpt-oss harmony, still stops after it). Off: the turn stops after its
    first complete call (the format's stop string), and any later call a format without one
    parsed is answered as not run (``parsers.one_call_per_turn``)."""
    fmt = choose_format(tokenizer, parser)
    stops = fmt.turn_stop_strings(parallel_tool_calls=parallel_tool_calls)
    params = replace(params, stop_strings=tuple(params.stop_strings) + tuple(stops))
    sampled = await sample_turn(engine, tokenizer, state.ids, params)
    parsed = await _parse(fmt, tokenizer, state, sampled.token_ids, sampled.text)
    if not parallel_tool_calls:
        parsed = replace(parsed, calls=one_call_per_turn(parsed.calls))
    step = replace(sampled, tool_calls=parsed.calls,
                   finish_reason="tool_call" if parsed.calls else sampled.finish_reason,
                   error="; ".join(c.error for c in parsed.calls if c.error) or None,
                   metadata={**sampled.metadata, **({"tool_format": fmt.name} if parsed.calls else {})})
    messages = state.messages + [_assistant_message(step.text, parsed)]
    done = not parsed.calls or sampled.finish_reason == "length"
    state = replace(state, ids=state.ids + step.token_ids, messages=messages, steps=state.steps + [step], done=done)
    return TurnResult(state, step)
