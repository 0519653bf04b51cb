"""`ToolRegistry` (tools/registry.py): listing, calling, unknown tools, registration errors, `execute_text`."""

from __future__ import annotations

import doctest

import pytest
from sample_tools import lookup

from longstraw_agents.tools import (
    ToolCall,
    ToolRegistry,
    ToolResult,
    calculator,
    registry,
)


def test_registry_lists_and_calls() -> None:
    tools = ToolRegistry([calculator, lookup])
    assert tools.names == ["calculator", "lookup"] and len(tools) == 2
    assert "lookup" in tools and "missing" not in tools and 3 not in tools
    assert [schema["function"]["name"] for schema in tools.schemas()] == ["calculator", "lookup"]
    assert tools.call(ToolCall("lookup", {"city": "Rome"})).content == "Rome:3:metric"
    assert tools.call({"name": "calculator", "arguments": {"expression": "6*7"}}).content == "42"
    assert tools.call({"name": "calculator"}).error == "bad_arguments"
    assert tools.call({"arguments": {}}).error == "parse"


def test_registry_unknown_tool_lists_the_known_ones() -> None:
    tools = ToolRegistry([calculator, lookup])
    result = tools.call(ToolCall("weather", {}))
    assert (result.ok, result.error, result.name) == (False, "unknown_tool", "weather")
    assert result.content == "Error: unknown tool 'weather'. Available tools: calculator, lookup."
    assert "No tools are available" in ToolRegistry().call(ToolCall("calculator", {})).content


def test_registry_registration_errors() -> None:
    tools = ToolRegistry([calculator])
    with pytest.raises(ValueError, match="already registered"):
        tools.register(calculator)
    with pytest.raises(TypeError, match="execute_text"):
        tools.call("<tool_call>...</tool_call>")  # type: ignore[arg-type]

    @tools.register
    def shout(text: str) -> str:
        """Upper-case a text."""
        return text.upper()

    assert tools.call(ToolCall("shout", {"text": "hi"})).content == "HI"


def test_registry_survives_a_tool_that_breaks_the_contract() -> None:
    class RaisingTool(type(calculator)):  # type: ignore[misc]
        def invoke(self, arguments: object) -> ToolResult:
            raise RuntimeError("broken invoke")

    tools = ToolRegistry([RaisingTool.from_function(lookup.fn, name="broken")])
    result = tools.call(ToolCall("broken", {}))
    assert result.error == "exception" and "broken invoke" in result.content


def test_execute_text_runs_every_call_in_order() -> None:
    tools = ToolRegistry([calculator, lookup])
    text = (
        "Let me compute.\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "lookup", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>'
        "<tool_call>{not json}</tool_call>"
    )
    results = tools.execute_text(text)
    assert [(r.name, r.ok, r.error) for r in results] == [
        ("calculator", True, None),
        ("lookup", True, None),
        ("", False, "parse"),
    ]
    assert results[0].content == "5" and results[1].content == "Oslo:3:metric"
    assert results[2].content.startswith("Error: could not read the tool call: malformed JSON")
    assert tools.execute_text("The answer is 5.") == []


def test_docstring_examples() -> None:
    failures, attempted = doctest.testmod(registry, raise_on_error=False)  # type: ignore[arg-type]
    assert attempted > 0 and failures == 0
