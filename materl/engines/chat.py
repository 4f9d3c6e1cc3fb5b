"""The chat template both named models use: ChatML turns, tool specs rendered Hermes style into
the system message, assistant tool calls as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
and tool results as ``tool`` turns wrapping ``<tool_response>\\n...\\n</tool_response>`` (the
Qwen2.5 / Hermes-2-Pro conventions, which tool-call parsers expect)."""

from __future__ import annotations

import json

_TOOLS_PREAMBLE = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
_TOOLS_POSTAMBLE = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>'
)


def chatml_tools_template(default_system: str | None = None) -> str:
    """A ChatML chat template that renders ``tools=`` and ``tool`` messages, Hermes style.

    System turn: the first system message (or ``default_system``), then, when tools are given,
    the ``# Tools`` block listing one JSON spec per line inside ``<tools></tools>``. Assistant
    turns render their content then each tool call as ``<tool_call>\\n{json}\\n</tool_call>``
    (OpenAI ``{"function": {...}}`` wrappers and JSON-string arguments are both accepted).
    Tool turns render as ``<|im_start|>tool\\n<tool_response>\\n...\\n</tool_response><|im_end|>``.
    (Qwen2.5 puts tool responses in a ``user`` turn; materl keeps a ``tool`` role so a tool
    step's tokens are recognisable.)
    """
    default = json.dumps(default_system) if default_system else "none"
    return (
        "{%- set sys_msg = messages[0]['content'] if (messages and messages[0]['role'] == 'system') else "
        + default + " %}"
        "{%- if tools %}"
        "{{- '<|im_start|>system\\n' }}{%- if sys_msg %}{{- sys_msg + '\\n\\n' }}{%- endif %}"
        "{{- '" + _TOOLS_PREAMBLE + "' }}"
        "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
        "{{- '" + _TOOLS_POSTAMBLE + "<|im_end|>\\n' }}"
        "{%- elif sys_msg %}{{- '<|im_start|>system\\n' + sys_msg + '<|im_end|>\\n' }}{%- endif %}"
        "{%- for message in messages %}"
        "{%- if message['role'] == 'system' and loop.first %}"
        "{%- elif message['role'] == 'assistant' %}"
        "{{- '<|im_start|>assistant\\n' }}{%- if message['content'] %}{{- message['content'] }}{%- endif %}"
        "{%- for tc in (message['tool_calls'] if message['tool_calls'] is defined and message['tool_calls'] else []) %}"
        "{%- if tc['function'] is defined %}{%- set tc = tc['function'] %}{%- endif %}"
        "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
        "{{- '<tool_call>\\n{\"name\": \"' + tc['name'] + '\", \"arguments\": ' }}"
        "{%- if tc['arguments'] is string %}{{- tc['arguments'] }}{%- else %}{{- tc['arguments'] | tojson }}{%- endif %}"
        "{{- '}\\n</tool_call>' }}"
        "{%- endfor %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- elif message['role'] == 'tool' %}"
        "{{- '<|im_start|>tool\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
        "{%- else %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


CHATML_TOOLS_TEMPLATE = chatml_tools_template()
