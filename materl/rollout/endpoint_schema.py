"""The request schemas of the agent endpoint (``materl.rollout.endpoint``), checked before anything
is sampled or recorded: OpenAI's chat completions request and the Responses API request, as
pydantic models validated strictly from the raw JSON bytes (a wrong type is refused, never
coerced: ``temperature: "hot"``, ``stop: [1, 2]``, ``max_tokens: 1e999``, ``tool_calls: "x"``;
pydantic's JSON parser also bounds nesting depth, so a 100k-deep body is a 400, not a
RecursionError). Fields OpenAI defines that materl does not use are typed too; fields OpenAI
does not define are accepted and have no effect (agent frameworks add vendor fields).

A Responses request is turned into the chat messages and tools it stands for
(``responses_to_chat``: ``instructions`` -> a system message, ``function_call`` items -> an
assistant message's ``tool_calls``, ``function_call_output`` -> tool messages), so both APIs
continue one exact-token record. (vLLM's ``protocol.py`` and SGLang's ``openai_api/protocol.py``
validate requests the same way.)
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from materl.errors import EpisodeError

MAX_STOP_STRINGS = 16  # OpenAI allows 4; agent frameworks written for vLLM send more


class BadRequest(EpisodeError):
    """A request the endpoint cannot answer (HTTP 400, or the ``status`` given)."""

    def __init__(self, message: str, *, status: int = 400):
        super().__init__(message)
        self.status = status


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class _Function(_Strict):
    name: str
    arguments: str | dict[str, Any] = "{}"


class _ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] | None = None
    function: _Function


class _TextPart(_Strict):
    type: str
    text: str | None = None


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class _FunctionSpec(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: _FunctionSpec


class _StreamOptions(_Strict):
    include_usage: bool | None = None


class ChatRequest(_Strict):
    """``POST /v1/chat/completions``: the fields OpenAI documents, strictly typed."""

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = Field(None)
    stream: bool | None = None
    stream_options: _StreamOptions | None = None
    n: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def cap(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def stop_strings(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stops) > MAX_STOP_STRINGS:
            raise BadRequest(f"'stop' has {len(stops)} strings; the endpoint takes at most {MAX_STOP_STRINGS}")
        return stops

    def message_dicts(self) -> list[dict]:
        return [m.model_dump(exclude_none=True) for m in self.messages]

    def tool_dicts(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


# -- the Responses API -----------------------------------------------------------------------------


class _InputMessage(_Strict):
    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[_TextPart]


class _FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class _FunctionOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[_TextPart]


class _ResponsesTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(_Strict):
    """``POST /v1/responses``: text and function-call items; no server-side state."""

    model: str | None = None
    input: str | list[_FunctionCallItem | _FunctionOutputItem | _InputMessage] = Field(min_length=1)
    instructions: str | None = None
    tools: list[_ResponsesTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    stream: bool | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    previous_response_id: str | None = None
    store: bool | None = None
    user: str | None = None

    def cap(self) -> int | None:
        return self.max_output_tokens


def responses_to_chat(req: ResponsesRequest) -> ChatRequest:
    """The chat completions request a Responses request stands for (module docstring)."""
    if req.previous_response_id:
        raise BadRequest(f"previous_response_id={req.previous_response_id!r}: the endpoint keeps no responses; send "
                         f"the whole conversation as 'input' (the Agents SDK does unless told otherwise)")
    if req.stream:
        raise BadRequest("stream=true on /v1/responses is not served; use stream=false, or /v1/chat/completions "
                         "with stream=true")
    messages: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [_InputMessage(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    for item in items:
        if isinstance(item, _FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant":  # the text the calls came with
                last["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, _FunctionOutputItem):
            output = item.output if isinstance(item.output, str) else "".join(p.text or "" for p in item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        else:
            content = item.content if isinstance(item.content, str) else [p.model_dump(exclude_none=True)
                                                                          for p in item.content]
            messages.append({"role": item.role, "content": content})
    tools = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
             for t in req.tools or []]
    return ChatRequest.model_validate({"messages": messages, "tools": tools or None,
                                       "max_tokens": req.cap(), "parallel_tool_calls": req.parallel_tool_calls,
                                       "tool_choice": req.tool_choice},
                                      strict=False)


def parse(model: type[BaseModel], body: bytes) -> Any:
    """``body`` validated as ``model``; ``BadRequest`` naming each wrong field and what it got."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        problems = []
        for err in exc.errors(include_url=False)[:5]:
            where = ".".join(str(p) for p in err["loc"]) or "body"
            got = f" (got {err['input']!r:.80})" if "input" in err and err["type"] != "missing" else ""
            problems.append(f"{where}: {err['msg']}{got}")
        more = f"; and {exc.error_count() - 5} more" if exc.error_count() > 5 else ""
        raise BadRequest(f"invalid {model.__name__}: " + "; ".join(problems) + more) from None
