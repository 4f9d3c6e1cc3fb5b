import pytest

from materl.errors import UnknownNameError
from materl.rollout.parsers import TOOL_PARSERS, ParsedMessage, error_result
from materl.rollout.tool_formats import stop_strings
from materl.rollout.types import ToolCall

hermes = TOOL_PARSERS.get("hermes")
json_parser = TOOL_PARSERS.get("json")


def test_registry_names_and_stop_strings():
    assert TOOL_PARSERS.names() == ["harmony", "hermes", "json", "llama3_json", "mistral", "qwen3_coder"]
    assert stop_strings("hermes") == ("</tool_call>",)
    assert stop_strings("json") == ()
    assert stop_strings("harmony") == ("<|call|>",)
    with pytest.raises(UnknownNameError, match="valid: harmony, hermes, json, llama3_json, mistral, qwen3_coder"):
        stop_strings("qwen")


# -- hermes --
def test_hermes_one_call_and_content():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculate", "arguments": {"expression": "2+3"}}\n</tool_call>'
    msg = hermes(text)
    assert msg.content == "Let me compute."
    assert msg.calls == [ToolCall(name="calculate", arguments={"expression": "2+3"}, id="call_0",
                                  raw='\n{"name": "calculate", "arguments": {"expression": "2+3"}}\n')]


def test_hermes_several_calls_keep_order_and_text_between():
    text = ('A <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> B '
            '<tool_call>{"name": "g", "arguments": {}}</tool_call> C')
    msg = hermes(text)
    assert [(c.name, c.arguments, c.id) for c in msg.calls] == [("f", {"x": 1}, "call_0"), ("g", {}, "call_1")]
    assert msg.content == "A  B  C"  # the two tags are cut out, the spaces around them stay


def test_hermes_no_call():
    assert hermes("  just an answer: 42 ") == ParsedMessage(content="just an answer: 42", calls=[])


def test_hermes_lenient_forms():
    # arguments as a JSON string (OpenAI wire format), "parameters" (Llama 3.1), no arguments at all
    msg = hermes('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>'
                 '<tool_call>{"name": "g", "parameters": {"y": 3}}</tool_call>'
                 '<tool_call>{"name": "h"}</tool_call>')
    assert [(c.name, c.arguments, c.error) for c in msg.calls] == [
        ("f", {"x": 2}, None), ("g", {"y": 3}, None), ("h", {}, None)]


@pytest.mark.parametrize("body, error", [
    ('{"name": "f", "arguments": {"x": 1}', "not valid JSON"),      # missing closing brace
    ('{"arguments": {"x": 1}}', 'no "name"'),
    ('{"name": "", "arguments": {}}', 'no "name"'),
    ('{"name": 7, "arguments": {}}', 'no "name"'),
    ('{"name": "f", "arguments": [1, 2]}', "must be an object, got list"),
    ('{"name": "f", "arguments": "not json"}', "string that is not a JSON object"),
    ('["f", {"x": 1}]', "must be a JSON object, got list"),
])
def test_hermes_malformed_call_becomes_error_call(body, error):
    msg = hermes(f"thinking <tool_call>{body}</tool_call>")
    assert msg.content == "thinking"
    [call] = msg.calls
    assert call.name == "" and call.arguments == {} and call.raw == body
    assert error in call.error


def test_hermes_unclosed_tag():
    msg = hermes('ok <tool_call>{"name": "f", "arguments": {"x": 1}}')
    [call] = msg.calls
    assert call.error.startswith("unclosed <tool_call>")
    assert call.raw == '<tool_call>{"name": "f", "arguments": {"x": 1}}'
    assert msg.content == "ok"


def test_hermes_unclosed_then_good_call():
    # the first tag never closes before the second opens: one error call, then the good one
    msg = hermes('<tool_call>{"name": "f"  <tool_call>{"name": "g", "arguments": {}}</tool_call>')
    assert [c.error is None for c in msg.calls] == [False, True]
    assert msg.calls[1].name == "g" and msg.calls[1].id == "call_1"


def test_hermes_call_inside_json_fence_in_tag():
    msg = hermes('<tool_call>\n```json\n{"name": "f", "arguments": {"x": 1}}\n```\n</tool_call>')
    assert (msg.calls[0].name, msg.calls[0].arguments, msg.calls[0].error) == ("f", {"x": 1}, None)


# -- json --
def test_json_fenced_call():
    text = 'I will call it:\n```json\n{"name": "calculate", "arguments": {"expression": "6*7"}}\n```'
    msg = json_parser(text)
    assert msg.content == "I will call it:"
    assert [(c.name, c.arguments, c.error) for c in msg.calls] == [("calculate", {"expression": "6*7"}, None)]


def test_json_bare_objects_anywhere():
    text = 'first {"name": "f", "arguments": {"a": {"b": 1}}} then {"name": "g", "arguments": {}} done'
    msg = json_parser(text)
    assert [(c.name, c.arguments) for c in msg.calls] == [("f", {"a": {"b": 1}}), ("g", {})]
    assert msg.content == "first  then  done"


def test_json_non_call_json_stays_in_content():
    text = 'The answer is {"x": 1} and ```json\n{"total": 3}\n``` and {not json'
    msg = json_parser(text)
    assert msg.calls == []
    assert msg.content == text


def test_json_fenced_list_is_several_calls():
    msg = json_parser('```json\n[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"y": 2}}]\n```')
    assert [(c.name, c.arguments, c.id) for c in msg.calls] == [("f", {}, "call_0"), ("g", {"y": 2}, "call_1")]


@pytest.mark.parametrize("text, error", [
    ('```json\n{"name": "f", "arguments": {"x": 1,}}\n```', "not valid JSON"),   # trailing comma
    ('```json\n{"arguments": {"x": 1}}\n```', 'no "name"'),
    ('```json\n{"name": "f", "arguments": 3}\n```', "must be an object, got int"),
    ('call: {"name": "f", "arguments": {"x": ', "not valid JSON"),                 # unfenced, cut off
])
def test_json_malformed(text, error):
    [call] = json_parser(text).calls
    assert call.name == "" and call.error is not None and error in call.error


def test_error_result_is_what_the_model_sees():
    call = hermes("<tool_call>{oops}</tool_call>").calls[0]
    result = error_result(call)
    assert result.is_error and result.call_id == "call_0"
    assert "could not be parsed" in result.content and "not valid JSON" in result.content
    assert '{"name": "<tool name>"' in result.content


# -- every format: never raises, bounded work, invalid Unicode (adversarial model output) --------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ALL = TOOL_PARSERS.names()
DEEP = '{"name": "f", "arguments": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}"
ADVERSARIAL = {
    "1 MB of {": "{" * (1 << 20),
    "1 MB of [": "[" * (1 << 20),
    "deep call": f"<tool_call>{DEEP}</tool_call> {DEEP}",
    "nested call starts": '{"name": ' * 50_000,
    "unclosed tags": "<tool_call>" * 100_000,
    "fences": "```" * 100_000,
    "quotes": '{"' * 200_000,
    "markers": "[TOOL_CALLS]" * 50_000 + "<|message|>" * 50_000 + "<function=" * 50_000,
    "huge number": '<tool_call>{"name": "f", "arguments": {"x": ' + "9" * 100_000 + "}}</tool_call>",
}


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("case", sorted(ADVERSARIAL))
def test_adversarial_output_never_raises(fmt, case):
    msg = TOOL_PARSERS.get(fmt)(ADVERSARIAL[case])
    assert isinstance(msg, ParsedMessage)
    assert all(isinstance(c, ToolCall) and (c.error is None) == bool(c.name) for c in msg.calls)


def test_deep_nesting_is_a_malformed_call_not_a_recursion_error():
    [inner, bare] = json_parser(f"<tool_call>{DEEP}</tool_call> {DEEP}").calls
    assert "nested more than 64 levels" in inner.error and "nested more than 64 levels" in bare.error
    [call] = hermes(f"<tool_call>{DEEP}</tool_call>").calls
    assert "nested more than 64 levels" in call.error
    ok = '{"name": "f", "arguments": ' + '{"a": ' * 60 + "1" + "}" * 60 + "}"
    assert json_parser(ok).calls[0].error is None  # 61 levels: fine


def test_lone_surrogates_in_arguments_are_replaced():
    [call] = hermes('<tool_call>{"name": "echo", "arguments": {"text": "a\\ud800b", "\\udfffk": 1}}</tool_call>').calls
    assert call.arguments == {"text": "a\ufffdb", "\ufffdk": 1}
    assert call.raw.encode("utf-8")  # everything the episode keeps is valid UTF-8


def test_a_call_in_a_json_string_is_not_a_call():
    msg = json_parser('{"note": "write {\\"name\\": \\"f\\"} to call"} and {"name": "g", "arguments": {}}')
    assert [c.name for c in msg.calls] == ["g"]


def test_unparsed_tail_past_the_size_limit_is_content():
    from materl.rollout._json_calls import MAX_PARSE_CHARS

    text = "x" * MAX_PARSE_CHARS + '<tool_call>{"name": "f"}</tool_call>'
    msg = hermes(text)
    assert msg.calls == [] and msg.content.endswith("</tool_call>")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list('{}[]":,\\ <>/=|_ntoolcaMESGfu\n') + [
    "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|message|>", "<|channel|>", " to=functions.f", "<|call|>",
    "<function=f>", "<parameter=x>", "</parameter>", "</function>", '"name"', '"arguments"', "```", "\ud800"]),
    max_size=40).map("".join))
def test_any_text_parses_without_raising(text):
    for fmt in ALL:
        msg = TOOL_PARSERS.get(fmt)(text)
        assert isinstance(msg.content, str)
        for c in msg.calls:
            assert (c.error is None) == bool(c.name)
            assert c.name.encode("utf-8") is not None and isinstance(c.arguments, dict)
