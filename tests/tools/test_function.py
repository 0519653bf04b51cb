"""`@tool`, `Tool.invoke` and `ToolResult` (tools/function.py, result.py); the package imports without torch."""

from __future__ import annotations

import dataclasses
import doctest
import json
import subprocess
import sys
import threading
import time
from typing import Annotated

import pytest
from pydantic import BaseModel, Field, ValidationError
from sample_tools import lookup

from longstraw_agents.tools import (
    ToolFailure,
    ToolOutput,
    ToolResult,
    function,
    tool,
)


def test_schema_follows_the_openai_function_calling_format() -> None:
    schema = lookup.schema
    assert schema["type"] == "function"
    function_schema = schema["function"]
    assert function_schema["name"] == "lookup"
    assert function_schema["description"] == "Look up the weather of a city.\n\nA second paragraph of the description."
    parameters = function_schema["parameters"]
    assert parameters["type"] == "object"
    assert parameters["required"] == ["city"]
    assert parameters["additionalProperties"] is False
    assert parameters["properties"] == {
        "city": {"type": "string", "description": "The city's name, as written on a map."},
        "limit": {"type": "integer", "default": 3, "description": "How many days to forecast."},
        "units": {
            "type": "string",
            "enum": ["metric", "imperial"],
            "default": "metric",
            "description": "The unit system.",
        },
    }
    json.dumps(schema)  # the schema goes into a prompt: it must be plain JSON


def test_schema_is_a_copy() -> None:
    lookup.schema["function"]["parameters"]["properties"].clear()
    assert "city" in lookup.schema["function"]["parameters"]["properties"]


def test_decorator_with_arguments_and_annotated_fields() -> None:
    @tool(name="find-items", description="Find items.", max_output_chars=50, timeout_s=3)
    def find(
        query: Annotated[str, Field(description="What to find.", min_length=1)],
        k: int = Field(5, ge=1, le=10),
    ) -> list[str]:
        """Docstring summary that the explicit description replaces.

        Args:
            query: Ignored: the Annotated description wins.
            k: Number of items.
        """
        return [query] * k

    assert (find.name, find.description, find.max_output_chars, find.timeout_s) == ("find-items", "Find items.", 50, 3)
    properties = find.schema["function"]["parameters"]["properties"]
    assert properties["query"] == {"type": "string", "description": "What to find.", "minLength": 1}
    assert properties["k"] == {
        "type": "integer",
        "default": 5,
        "minimum": 1,
        "maximum": 10,
        "description": "Number of items.",
    }
    assert find.invoke({"query": "a", "k": 2}).content == '["a", "a"]'
    assert find.invoke({"query": "a", "k": 11}).error == "bad_arguments"
    assert find.invoke({"query": ""}).error == "bad_arguments"


def test_invoke_validates_and_calls() -> None:
    result = lookup.invoke({"city": "Oslo", "units": "imperial"})
    assert (result.ok, result.error, result.content) == (True, None, "Oslo:3:imperial")
    assert result.arguments == {"city": "Oslo", "units": "imperial"}
    assert result.original_length == len(result.content) and not result.truncated
    assert result.elapsed_s >= 0


def test_record_is_json_and_reads_back() -> None:
    result = lookup.invoke({"city": "Oslo"})
    record = result.to_record()
    assert json.loads(json.dumps(record)) == record
    assert ToolResult.model_validate(record) == result
    assert set(record) == {"name", "ok", "content", "error", "truncated", "original_length", "elapsed_s", "arguments"}


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({}, "missing required argument 'city'"),
        ({"city": "Oslo", "days": 3}, "unexpected argument 'days'"),
        ({"city": 7}, "city: Input should be a valid string (got 7)"),
        ({"city": "Oslo", "limit": "3"}, "limit: Input should be a valid integer (got '3')"),
        ({"city": "Oslo", "limit": True}, "limit: Input should be a valid integer (got True)"),
        ({"city": "Oslo", "limit": 2.5}, "limit: Input should be a valid integer"),
        ({"city": "Oslo", "units": "kelvin"}, "units: Input should be 'metric' or 'imperial'"),
    ],
)
def test_bad_arguments_name_the_field(arguments: dict, expected: str) -> None:
    result = lookup.invoke(arguments)
    assert result.error == "bad_arguments" and not result.ok
    assert expected in result.content
    assert "Usage: lookup(city: string, limit: integer = 3, units: " in result.content


def test_arguments_must_be_an_object() -> None:
    result = lookup.invoke(["Oslo"])
    assert result.error == "bad_arguments"
    assert "must be a JSON object" in result.content and "got list" in result.content
    assert result.arguments is None


def test_return_values_are_rendered() -> None:
    class Forecast(BaseModel):
        city: str
        temperature: float

    @dataclasses.dataclass
    class Point:
        x: int
        y: int

    @tool
    def rendered(kind: str) -> object:
        """Return different kinds of values."""
        values = {"model": Forecast(city="Oslo", temperature=-3.5), "dataclass": Point(1, 2), "none": None}
        return values.get(kind, {"å": [1, 2]})

    assert rendered.invoke({"kind": "model"}).content == '{"city":"Oslo","temperature":-3.5}'
    assert rendered.invoke({"kind": "dataclass"}).content == '{"x": 1, "y": 2}'
    assert rendered.invoke({"kind": "none"}).content == ""
    assert rendered.invoke({"kind": "dict"}).content == '{"å": [1, 2]}'


def test_exception_becomes_a_short_error() -> None:
    @tool
    def explode(n: int) -> int:
        """Divide by n."""
        return 1 // n

    result = explode.invoke({"n": 0})
    assert result.error == "exception" and not result.ok
    assert result.content == "Error: tool 'explode' raised ZeroDivisionError: integer division or modulo by zero"
    assert "Traceback" not in result.content


def test_tool_failure_chooses_message_and_kind() -> None:
    @tool
    def guarded(path: str) -> str:
        """Refuse everything."""
        raise ToolFailure(f"{path} is off limits", kind="denied")

    result = guarded.invoke({"path": "/etc"})
    assert (result.error, result.content) == ("denied", "Error: /etc is off limits")
    with pytest.raises(ValueError, match="unknown error kind"):
        ToolFailure("x", kind="oops")  # type: ignore[arg-type]


def test_timeout() -> None:
    """The tool sleeps until the test wakes it (or a minute): an answer within 10x its 0.2 s timeout can only come
    from the timeout (a generous bound, so a busy machine does not fail it)."""
    wake = threading.Event()

    @tool(timeout_s=0.2)
    def sleepy(seconds: float) -> str:
        """Sleep."""
        wake.wait(seconds)
        return "awake"

    start = time.perf_counter()
    try:
        result = sleepy.invoke({"seconds": 60})
        elapsed = time.perf_counter() - start
    finally:
        wake.set()
    assert elapsed < 10 * 0.2
    assert result.error == "timeout"
    assert result.content == "Error: tool 'sleepy' timed out after 0.2 s"
    assert sleepy.invoke({"seconds": 0}).content == "awake"


def test_oversize_output_is_truncated_and_recorded() -> None:
    @tool(max_output_chars=100)
    def chatty(n: int) -> str:
        """Talk."""
        return "x" * n

    result = chatty.invoke({"n": 1000})
    assert (result.ok, result.error, result.truncated, result.original_length) == (
        False,
        "output_too_large",
        True,
        1000,
    )
    assert result.content == "x" * 100 + "\n…[truncated 900 characters]"
    exact = chatty.invoke({"n": 100})
    assert exact.ok and not exact.truncated and exact.content == "x" * 100


def test_tool_output_carries_kind_and_length() -> None:
    @tool
    def partial() -> ToolOutput:
        """Fail with partial output."""
        return ToolOutput("half of it…", error="timeout", truncated=True, original_length=5000)

    result = partial.invoke({})
    assert (result.error, result.truncated, result.original_length) == ("timeout", True, 5000)

    @tool
    def broken() -> ToolOutput:
        """Return a malformed output."""
        return ToolOutput(42)  # type: ignore[arg-type]

    assert broken.invoke({}).error == "exception"


def test_positional_only_parameters() -> None:
    @tool
    def power(base: int, /, exponent: int = 2) -> int:
        """Raise base to exponent."""
        return base**exponent

    assert power.invoke({"base": 3}).content == "9"


def test_definition_errors_raise_at_decoration() -> None:
    with pytest.raises(TypeError, match="needs a type hint"):

        @tool
        def untyped(x) -> None:  # noqa: ANN001
            """No hint."""

    with pytest.raises(TypeError, match=r"\*args"):

        @tool
        def variadic(*items: int) -> None:
            """Variadic."""

    with pytest.raises(TypeError, match=r"\*\*kwargs"):

        @tool
        def keywords(**options: int) -> None:
            """Keywords."""

    with pytest.raises(ValueError, match="must match"):
        tool(name="has space")(lambda x: x)

    with pytest.raises(TypeError, match="async"):

        @tool
        async def coroutine(x: int) -> int:
            """Async."""
            return x

    with pytest.raises(ValueError, match="max_output_chars"):
        tool(max_output_chars=0)(lookup.fn)


def test_replace_keeps_a_valid_tool() -> None:
    strict = dataclasses.replace(lookup, max_output_chars=4)
    assert strict.invoke({"city": "Oslo"}).truncated
    assert strict.schema == lookup.schema


def test_result_ok_must_match_error() -> None:
    with pytest.raises(ValidationError, match="ok must be True exactly when error is None"):
        ToolResult(name="x", ok=True, content="", error="parse")
    with pytest.raises(ValidationError):
        ToolResult(name="x", ok=False, content="", error="nonsense")


def test_docstring_examples() -> None:
    failures, attempted = doctest.testmod(function, raise_on_error=False)  # type: ignore[arg-type]
    assert attempted > 0 and failures == 0


def test_tools_import_without_torch() -> None:
    code = "import sys, longstraw_agents.tools; sys.exit(sorted({'torch', 'transformers'} & set(sys.modules)) or 0)"
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr
