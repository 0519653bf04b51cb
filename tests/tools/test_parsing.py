"""Reading ``<tool_call>`` blocks out of assistant text (tools/parsing.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from longstraw_agents.tools import ToolCall, ToolCallError, format_tool_call, parse_tool_calls
from longstraw_agents.tools.parsing import MAX_ARGUMENT_DEPTH, tool_call_from_object


def only(text: str) -> ToolCall | ToolCallError:
    calls = parse_tool_calls(text)
    assert len(calls) == 1, calls
    return calls[0]


def error_message(text: str) -> str:
    call = only(text)
    assert isinstance(call, ToolCallError), call
    return call.message


def test_qwen_format() -> None:
    text = 'I will compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    call = only(text)
    assert call == ToolCall("calculator", {"expression": "2+3"}, span=(16, len(text)))
    assert text[call.span[0] : call.span[1]].startswith("<tool_call>")
    assert call.to_record() == {"name": "calculator", "arguments": {"expression": "2+3"}}


def test_several_calls_per_turn_keep_their_order() -> None:
    text = "".join(format_tool_call("t", {"i": i}) + " and " for i in range(3))
    calls = parse_tool_calls(text)
    assert [call.arguments["i"] for call in calls] == [0, 1, 2]
    assert all(isinstance(call, ToolCall) for call in calls)


def test_no_calls() -> None:
    assert parse_tool_calls("The answer is 42.") == []
    assert parse_tool_calls("") == []


def test_numpy_arguments_are_written_as_the_json_they_hold() -> None:
    """A task drawn with ``rng.integers`` holds np.int64 values; format_tool_call writes them as JSON numbers."""
    a, b = np.random.default_rng(0).integers(1, 10, size=2)
    arguments = {"a": a, "b": b, "scale": np.float32(0.5), "ok": np.bool_(True), "xs": np.arange(3), "w": np.str_("x")}
    call = only(format_tool_call("add", arguments))
    assert isinstance(call, ToolCall)
    assert call.arguments == {"a": int(a), "b": int(b), "scale": 0.5, "ok": True, "xs": [0, 1, 2], "w": "x"}
    assert type(call.arguments["a"]) is int and type(call.arguments["ok"]) is bool
    with pytest.raises(TypeError, match="tool argument of type object is not JSON serializable"):
        format_tool_call("f", {"x": object()})


@pytest.mark.parametrize(
    "payload",
    [
        '{"name": "f", "arguments": "{\\"x\\": 1}"}',  # arguments as a JSON string
        '```json\n{"name": "f", "arguments": {"x": 1}}\n```',  # markdown fence inside the tags
        '  \n\t{"name": "f", "arguments": {"x": 1}}  \n',
    ],
    ids=["string-arguments", "code-fence", "whitespace"],
)
def test_accepted_variants(payload: str) -> None:
    call = only(f"<tool_call>{payload}</tool_call>")
    assert isinstance(call, ToolCall) and (call.name, call.arguments) == ("f", {"x": 1})


def test_missing_arguments_mean_none() -> None:
    text = '<tool_call>{"name": "now"}</tool_call>'
    assert only(text) == ToolCall("now", {}, span=(0, len(text)))


def test_round_trip_with_unicode() -> None:
    arguments = {"text": "naïve café ☕ \u0000 \n", "nested": {"list": [1, 2.5, None, True]}}
    call = only(format_tool_call("echo", arguments))
    assert isinstance(call, ToolCall) and call.arguments == arguments


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('<tool_call>{"name": "f", "arguments": {}}', "unclosed <tool_call> tag at character 0"),
        ('{"name": "f"}</tool_call>', "found </tool_call> at character 13 without an opening <tool_call>"),
        ("<tool_call>   </tool_call>", "empty <tool_call> block"),
        ('<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>',
         "malformed JSON in tool call: Expecting ',' delimiter at line 1 column 36 (character 35)"),
        ("<tool_call>{'name': 'f'}</tool_call>",
         "malformed JSON in tool call: Expecting property name enclosed in double quotes at line 1 column 2"),
        ('<tool_call>{"name": "f"}\n{"name": "g"}</tool_call>', "Extra data at line 2 column 1"),
        ('<tool_call>["f", {}]</tool_call>', "a tool call must be a JSON object, got array"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'tool call is missing "name"'),
        ('<tool_call>{"name": 3}</tool_call>', '"name" must be a string, got number'),
        ('<tool_call>{"name": " "}</tool_call>', '"name" is empty'),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '"arguments" must be a JSON object'),
        ('<tool_call>{"name": "f", "arguments": null}</tool_call>', "got null"),
        ('<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>', '"arguments" is a string but not valid JSON'),
        ('<tool_call>{"name": "f", "arguments": "[1]"}</tool_call>', "got array"),
        ('<tool_call>{"name": "f", "args": {}}</tool_call>', "unexpected key(s) 'args'"),
        ('<tool_call>{"name": "f", "name": "g"}</tool_call>', "duplicate key 'name'"),
        ('<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', "NaN is not a JSON value"),
    ],
)  # fmt: skip
def test_errors_say_what_is_wrong(text: str, expected: str) -> None:
    assert expected in error_message(text)


def test_error_keeps_the_name_when_it_got_that_far() -> None:
    call = only('<tool_call>{"name": "f", "arguments": 5}</tool_call>')
    assert isinstance(call, ToolCallError) and call.name == "f"
    assert json.loads(json.dumps(call.to_record()))["name"] == "f"


def test_unclosed_tag_does_not_swallow_the_next_call() -> None:
    text = '<tool_call>{"name": "a"}\n' + format_tool_call("b", {"x": 1})
    first, second = parse_tool_calls(text)
    assert isinstance(first, ToolCallError) and "unclosed" in first.message
    assert first.raw == '{"name": "a"}\n'
    assert isinstance(second, ToolCall) and second.name == "b"


def test_deep_nesting_is_refused() -> None:
    shallow = {"x": 1}
    for _ in range(MAX_ARGUMENT_DEPTH - 1):
        shallow = {"x": shallow}
    assert isinstance(only(format_tool_call("f", shallow)), ToolCall)
    assert "nested more than" in error_message(format_tool_call("f", {"x": shallow}))
    very_deep = '{"name": "f", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}"
    assert "nested too deeply" in error_message(f"<tool_call>{very_deep}</tool_call>")


def test_from_object_checks_decoded_calls() -> None:
    assert tool_call_from_object({"name": "f", "arguments": {"a": 1}}) == ToolCall("f", {"a": 1})
    assert isinstance(tool_call_from_object("f"), ToolCallError)
