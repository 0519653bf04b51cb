"""`ToolRegistry`: the tools an environment offers, their schemas, and calls that always come back as results."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from .function import Tool, tool
from .parsing import FORMAT_HINT, ToolCall, ToolCallError, parse_tool_calls, tool_call_from_object
from .result import ToolResult, preview

_MAX_RECORDED_NAME_CHARS = 100  # real names have at most 64; a longer one is junk and need not be kept whole


class ToolRegistry:
    """Tools by name.

    `call` and `execute_text` never raise for anything the policy wrote: parse errors, unknown tools, bad
    arguments and failing tools all come back as error `ToolResult`\\ s. Mistakes of the programmer (registering two
    tools under one name, passing something that is not a call) raise.

    >>> from longstraw_agents.tools import calculator
    >>> registry = ToolRegistry([calculator])
    >>> [r.content for r in registry.execute_text('<tool_call>{"name": "calculator", '
    ...                                           '"arguments": {"expression": "2+3"}}</tool_call>')]
    ['5']
    """

    def __init__(self, tools: Iterable[Tool | Callable[..., Any]] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for item in tools:
            self.register(item)

    def register(self, item: Tool | Callable[..., Any]) -> Tool:
        """Add a tool (a plain function is wrapped with `tool` first); returns it, so it also works as a decorator."""
        new_tool = item if isinstance(item, Tool) else tool(item)
        if new_tool.name in self._tools:
            raise ValueError(f"a tool named {new_tool.name!r} is already registered")
        self._tools[new_tool.name] = new_tool
        return new_tool

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._tools

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def __repr__(self) -> str:
        return f"ToolRegistry({self.names})"

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """The OpenAI function-calling schemas of all tools, in registration order (for the system prompt)."""
        return [registered.schema for registered in self._tools.values()]

    def call(self, call: ToolCall | ToolCallError | Mapping[str, Any]) -> ToolResult:
        """Run one call. A mapping is read as a decoded ``{"name": ..., "arguments": ...}`` object."""
        if isinstance(call, Mapping):
            call = tool_call_from_object(call)
        if isinstance(call, ToolCallError):
            name = (call.name or "")[:_MAX_RECORDED_NAME_CHARS]
            return ToolResult.failure(name, "parse", f"Error: could not read the tool call: {call.message}")
        if not isinstance(call, ToolCall):
            expected = "a ToolCall, ToolCallError or mapping (for assistant text use execute_text)"
            raise TypeError(f"expected {expected}, got {type(call).__name__}")
        if call.name not in self:
            return self._unknown_tool(call)
        start = time.perf_counter()
        try:
            return self._tools[call.name].invoke(call.arguments)
        except (Exception, SystemExit) as exc:  # a Tool that broke the never-raise contract must not kill the env
            message = f"Error: tool {call.name!r} failed: {type(exc).__name__}: {exc}"
            return ToolResult.failure(call.name, "exception", message, elapsed_s=time.perf_counter() - start)

    def execute_text(self, assistant_text: str) -> list[ToolResult]:
        """Parse every ``<tool_call>`` block of an assistant turn and run them in order ([] when there are none)."""
        return [self.call(parsed) for parsed in parse_tool_calls(assistant_text)]

    def _unknown_tool(self, call: ToolCall) -> ToolResult:
        available = f"Available tools: {', '.join(self.names)}." if self._tools else "No tools are available."
        name = call.name[:_MAX_RECORDED_NAME_CHARS] if isinstance(call.name, str) else ""
        message = f"Error: unknown tool {preview(call.name)}. {available}"
        if not self._tools:
            message += " Answer without calling a tool."
        elif not isinstance(call.name, str):
            message += f" {FORMAT_HINT}"
        return ToolResult.failure(name, "unknown_tool", message)
