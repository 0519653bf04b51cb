"""Typed tools, the tool registry and the code sandbox.

A tool is a typed Python function turned by `tool` into a `Tool`: a pydantic argument model, an OpenAI
function-calling schema and an `invoke` that always returns a `ToolResult`. A `ToolRegistry` holds an environment's
tools, parses ``<tool_call>`` blocks from assistant text (`parse_tool_calls`) and runs them; every failure comes
back as an error result the policy can read, never as an exception.

Built-ins: `calculator` (AST arithmetic), `python` / `make_python_tool` (the subprocess sandbox of
`run_python`), `make_document_tools` (BM25 search and open over a `Corpus`), `make_http_get_tool` (httpx behind a
host allow-list).
"""

from .arithmetic import CalculatorError, calculator, evaluate
from .documents import Corpus, Document, SearchHit, make_document_tools
from .function import Tool, tool
from .parsing import ToolCall, ToolCallError, format_tool_call, parse_tool_calls
from .python_tool import make_python_tool, python
from .registry import ToolRegistry
from .result import DEFAULT_MAX_OUTPUT_CHARS, ERROR_KINDS, ErrorKind, ToolFailure, ToolOutput, ToolResult
from .sandbox import NetworkIsolationUnavailable, SandboxConfig, SandboxResult, SandboxUnavailable, run_python
from .web import HttpGetConfig, make_http_get_tool

__all__ = [
    "DEFAULT_MAX_OUTPUT_CHARS",
    "ERROR_KINDS",
    "CalculatorError",
    "Corpus",
    "Document",
    "ErrorKind",
    "HttpGetConfig",
    "NetworkIsolationUnavailable",
    "SandboxConfig",
    "SandboxResult",
    "SandboxUnavailable",
    "SearchHit",
    "Tool",
    "ToolCall",
    "ToolCallError",
    "ToolFailure",
    "ToolOutput",
    "ToolRegistry",
    "ToolResult",
    "calculator",
    "evaluate",
    "format_tool_call",
    "make_document_tools",
    "make_http_get_tool",
    "make_python_tool",
    "parse_tool_calls",
    "python",
    "run_python",
    "tool",
]
