"""A catalogue of nasty tool calls: every one becomes an error result, none raises, and the registry keeps working."""

from __future__ import annotations

import json

import pytest

from longstraw_agents.tools import (
    Corpus,
    Document,
    HttpGetConfig,
    SandboxConfig,
    ToolCall,
    ToolRegistry,
    ToolResult,
    calculator,
    make_document_tools,
    make_http_get_tool,
    make_python_tool,
    tool,
)


@tool
def repeat(text: str, times: int = 1) -> str:
    """Repeat a text.

    Args:
        text: What to repeat.
        times: How often.
    """
    return text * times


@tool
def crash(reason: str) -> str:
    """Always fail."""
    raise RuntimeError(reason)


@tool
def leave(code: int) -> str:
    """Try to end the process."""
    raise SystemExit(code)


@tool
def scale(x: int, y: float) -> float:
    """Scale a number."""
    return x * y


@pytest.fixture(scope="module")
def registry() -> ToolRegistry:
    corpus = Corpus([Document("doc-1", "Only document", "The needle is in here.")])
    return ToolRegistry(
        [
            calculator,
            repeat,
            crash,
            leave,
            scale,
            make_python_tool(SandboxConfig(timeout_s=1, cpu_time_s=2, memory_bytes=256 * 2**20)),
            *make_document_tools(corpus),
            make_http_get_tool(HttpGetConfig(allowed_hosts=("127.0.0.1:9",), timeout_s=0.5)),
        ]
    )


def call(name: object, arguments: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


DEEP = "[" * 50_000 + "]" * 50_000
CATALOGUE = {
    "malformed-json": ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}</tool_call>', "parse"),
    "single-quotes": ("<tool_call>{'name': 'calculator', 'arguments': {}}</tool_call>", "parse"),
    "trailing-comma": ('<tool_call>{"name": "calculator", "arguments": {},}</tool_call>', "parse"),
    "unclosed-tag": ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}', "parse"),
    "stray-closing-tag": ('{"name": "calculator"}</tool_call>', "parse"),
    "empty-block": ("<tool_call></tool_call>", "parse"),
    "not-an-object": ('<tool_call>"calculator"</tool_call>', "parse"),
    "missing-name": ('<tool_call>{"arguments": {"expression": "1"}}</tool_call>', "parse"),
    "name-not-a-string": (call(["calculator"], {}), "parse"),
    "extra-top-level-key": ('<tool_call>{"name": "calculator", "arguments": {}, "id": 1}</tool_call>', "parse"),
    "duplicate-keys": ('<tool_call>{"name": "calculator", "name": "repeat", "arguments": {}}</tool_call>', "parse"),
    "nan-argument": ('<tool_call>{"name": "repeat", "arguments": {"text": NaN}}</tool_call>', "parse"),
    "arguments-list": (call("calculator", ["2+3"]), "parse"),
    "arguments-number": (call("calculator", 5), "parse"),
    "arguments-null": (call("calculator", None), "parse"),
    "arguments-bad-json-string": (call("calculator", '{"expression": "2+3"'), "parse"),
    "arguments-json-string-of-list": (call("calculator", "[1, 2]"), "parse"),
    "huge-integer-literal": (
        '<tool_call>{"name": "repeat", "arguments": {"times": ' + "9" * 5000 + "}}</tool_call>",
        "parse",
    ),
    "huge-integer-in-arguments-string": (call("repeat", '{"times": ' + "9" * 5000 + "}"), "parse"),
    "float-overflow": ('<tool_call>{"name": "scale", "arguments": {"x": 1, "y": 1e999}}</tool_call>', "parse"),
    "deep-nesting": (f'<tool_call>{{"name": "repeat", "arguments": {{"text": {DEEP}}}}}</tool_call>', "parse"),
    "unknown-tool": (call("weather", {"city": "Oslo"}), "unknown_tool"),
    "unicode-unknown-tool": (call("калькулятор ☃", {}), "unknown_tool"),
    "null-byte-in-name": (call("calcu\u0000lator", {"expression": "1"}), "unknown_tool"),
    "huge-name": (call("x" * 200_000, {}), "unknown_tool"),
    "missing-argument": (call("calculator", {}), "bad_arguments"),
    "extra-argument": (call("calculator", {"expression": "1", "precision": 3}), "bad_arguments"),
    "wrong-type-number-for-string": (call("calculator", {"expression": 2}), "bad_arguments"),
    "wrong-type-string-for-int": (call("repeat", {"text": "a", "times": "3"}), "bad_arguments"),
    "wrong-type-bool-for-int": (call("repeat", {"text": "a", "times": True}), "bad_arguments"),
    "wrong-type-object-for-string": (call("repeat", {"text": {"nested": [1, 2]}}), "bad_arguments"),
    "lone-surrogate": ('<tool_call>{"name": "repeat", "arguments": {"text": "\\ud800"}}</tool_call>', "bad_arguments"),
    "out-of-range": (call("search_documents", {"query": "needle", "k": -1}), "bad_arguments"),
    "python-code-not-a-string": (call("python", {"code": ["print(1)"]}), "bad_arguments"),
    "unknown-document": (call("open_document", {"doc_id": "../../etc/passwd"}), "bad_arguments"),
    "huge-expression": (call("calculator", {"expression": "1+" * 500_000 + "1"}), "exception"),
    "null-byte-in-expression": (call("calculator", {"expression": "1\u0000+1"}), "exception"),
    "unicode-digits": (call("calculator", {"expression": "２+３"}), "exception"),
    "explosive-power": (call("calculator", {"expression": "9**9**9**9"}), "exception"),
    "tool-raises": (call("crash", {"reason": "kaboom"}), "exception"),
    "tool-calls-sys-exit": (call("leave", {"code": 3}), "exception"),
    "python-raises": (call("python", {"code": "raise SystemExit('bye')"}), "exception"),
    "python-hangs": (call("python", {"code": "import time\ntime.sleep(60)"}), "timeout"),
    "oversize-output": (call("repeat", {"text": "ab", "times": 1_000_000}), "output_too_large"),
    "denied-host": (call("http_get", {"url": "http://169.254.169.254/latest/meta-data/"}), "denied"),
}


@pytest.mark.parametrize(("text", "kind"), CATALOGUE.values(), ids=CATALOGUE.keys())
def test_nasty_input_becomes_an_error_result(registry: ToolRegistry, text: str, kind: str) -> None:
    results = registry.execute_text(text)
    assert len(results) == 1
    [result] = results
    assert isinstance(result, ToolResult)
    assert (result.ok, result.error) == (False, kind), result.content[:300]
    assert "Error" in result.content or result.truncated
    assert len(result.content) <= 25_000 and len(result.name) <= 100
    json.dumps(result.to_record())  # the record goes to the store as JSON
    result.content.encode("utf-8")  # and the content to the tokenizer
    assert registry.execute_text(call("calculator", {"expression": "2+3"}))[0].content == "5"


@pytest.mark.parametrize(
    ("bad_call", "kind"),
    [
        (ToolCall("calculator", "2+3"), "bad_arguments"),  # type: ignore[arg-type]
        (ToolCall("calculator", None), "bad_arguments"),  # type: ignore[arg-type]
        (ToolCall("calculator", {1: "2+3"}), "bad_arguments"),  # type: ignore[dict-item]
        (ToolCall("calculator", {"expression": object()}), "bad_arguments"),
        (ToolCall(None, {}), "unknown_tool"),  # type: ignore[arg-type]
        (ToolCall(["calculator"], {}), "unknown_tool"),  # type: ignore[arg-type]
        ({"name": "calculator", "arguments": "nope"}, "parse"),
        ({}, "parse"),
    ],
    ids=["string", "none", "int-key", "object-value", "none-name", "list-name", "mapping-bad", "mapping-empty"],
)
def test_malformed_call_objects(registry: ToolRegistry, bad_call: object, kind: str) -> None:
    if isinstance(bad_call, ToolCall) and bad_call.name == "calculator":  # the tool itself must not raise either
        assert calculator.invoke(bad_call.arguments).error == kind
    result = registry.call(bad_call)  # type: ignore[arg-type]
    assert (result.ok, result.error) == (False, kind)
    json.dumps(result.to_record())


def test_a_turn_mixing_good_and_bad_calls(registry: ToolRegistry) -> None:
    text = " ".join(
        [
            call("calculator", {"expression": "6*7"}),
            "<tool_call>oops</tool_call>",
            call("nope", {}),
            call("repeat", {"text": "hi"}),
        ]
    )
    results = registry.execute_text(text)
    assert [(r.ok, r.error) for r in results] == [(True, None), (False, "parse"), (False, "unknown_tool"), (True, None)]
    assert [results[0].content, results[3].content] == ["42", "hi"]


def test_directly_handed_arguments_are_checked_strictly() -> None:
    """Python values that are not JSON (here inf) are validated as strictly as JSON: "5" and True are no integers."""
    assert scale.invoke({"x": 2, "y": float("inf")}).ok
    for bad in ("5", True, 2.0):
        result = scale.invoke({"x": bad, "y": float("inf")})
        assert (result.ok, result.error) == (False, "bad_arguments"), bad
