"""Tool calls in assistant text: JSON objects inside ``<tool_call>`` tags (the Qwen / Hermes convention).

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2+3"}}
    </tool_call>

A turn may hold several calls. ``arguments`` may be an object or a string holding a JSON object (some models
double-encode); a missing ``arguments`` means no arguments. Anything else is a `ToolCallError` whose message says
what is wrong and where, so the policy can be told and the episode goes on.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .result import preview

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
MAX_ARGUMENT_DEPTH = 32
"""Deeper arguments are refused: no tool needs them and they only serve to exhaust the recursion limit."""

CALL_KEYS = frozenset({"name", "arguments"})
FORMAT_HINT = 'Write each call as <tool_call>{"name": "<tool name>", "arguments": {<argument>: <value>}}</tool_call>.'

_CODE_FENCE = re.compile(r"^```(?:json)?\s*\n?(?P<body>.*?)\n?```$", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: a tool name and a JSON object of arguments (not yet validated against the tool)."""

    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    span: tuple[int, int] | None = None
    """``[start, end)`` of the whole ``<tool_call>…</tool_call>`` block in the assistant text."""

    def to_record(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": dict(self.arguments)}


@dataclass(frozen=True)
class ToolCallError:
    """A ``<tool_call>`` block that could not be read as a call."""

    message: str
    raw: str = ""
    """The text between the tags (after an unclosed tag: up to the next tag or the end of the text)."""
    span: tuple[int, int] | None = None
    name: str | None = None
    """The tool name, when the block got that far."""

    def to_record(self) -> dict[str, Any]:
        return {"error": self.message, "raw": self.raw, "name": self.name}


def parse_tool_calls(text: str) -> list[ToolCall | ToolCallError]:
    """Every ``<tool_call>`` block of ``text``, in order, as a `ToolCall` or a `ToolCallError`."""
    calls: list[ToolCall | ToolCallError] = []
    position = 0
    while True:
        open_at = text.find(OPEN_TAG, position)
        close_at = text.find(CLOSE_TAG, position)
        if close_at != -1 and (open_at == -1 or close_at < open_at):
            end = close_at + len(CLOSE_TAG)
            message = f"found {CLOSE_TAG} at character {close_at} without an opening {OPEN_TAG}. {FORMAT_HINT}"
            calls.append(ToolCallError(message, raw=text[position:close_at], span=(close_at, end)))
            position = end
            continue
        if open_at == -1:
            return calls
        body_start = open_at + len(OPEN_TAG)
        close_at = text.find(CLOSE_TAG, body_start)
        next_open = text.find(OPEN_TAG, body_start)
        if close_at == -1 or (next_open != -1 and next_open < close_at):
            end = len(text) if next_open == -1 else next_open
            message = f"unclosed {OPEN_TAG} tag at character {open_at}: every call must end with {CLOSE_TAG}."
            calls.append(ToolCallError(message, raw=text[body_start:end], span=(open_at, end)))
            position = end
            continue
        end = close_at + len(CLOSE_TAG)
        calls.append(parse_tool_call_payload(text[body_start:close_at], span=(open_at, end)))
        position = end


def parse_tool_call_payload(raw: str, span: tuple[int, int] | None = None) -> ToolCall | ToolCallError:
    """One call from the text between the tags."""
    payload = raw.strip()
    fenced = _CODE_FENCE.match(payload)
    if fenced:  # ```json … ``` inside the tags: forgive the markdown, read the JSON
        payload = fenced["body"].strip()
    if not payload:
        return ToolCallError(f"empty {OPEN_TAG} block. {FORMAT_HINT}", raw=raw, span=span)
    try:
        value = _strict_json(payload)
    except json.JSONDecodeError as exc:
        message = (
            f"malformed JSON in tool call: {exc.msg} at line {exc.lineno} column {exc.colno} (character {exc.pos})"
        )
        return ToolCallError(f"{message}. {FORMAT_HINT}", raw=raw, span=span)
    except _InvalidJSON as exc:
        return ToolCallError(f"invalid JSON in tool call: {exc}", raw=raw, span=span)
    except RecursionError:
        return ToolCallError("tool call JSON is nested too deeply", raw=raw, span=span)
    except ValueError as exc:  # e.g. an integer literal past Python's int-string conversion limit
        return ToolCallError(f"invalid JSON in tool call: {exc}", raw=raw, span=span)
    return tool_call_from_object(value, raw=raw, span=span)


def tool_call_from_object(value: Any, raw: str = "", span: tuple[int, int] | None = None) -> ToolCall | ToolCallError:
    """Check a decoded call ``{"name": ..., "arguments": ...}``."""

    def error(message: str, name: str | None = None) -> ToolCallError:
        return ToolCallError(message, raw=raw, span=span, name=name)

    if not isinstance(value, Mapping):
        return error(f"a tool call must be a JSON object, got {json_type(value)}. {FORMAT_HINT}")
    unexpected = [preview(key) for key in value if key not in CALL_KEYS]
    if unexpected:
        keys = ", ".join(unexpected)
        return error(f'unexpected key(s) {keys} in tool call: a call has only "name" and "arguments". {FORMAT_HINT}')
    if "name" not in value:
        return error(f'tool call is missing "name". {FORMAT_HINT}')
    name = value["name"]
    if not isinstance(name, str):
        return error(f'"name" must be a string, got {json_type(name)}')
    if not name.strip():
        return error('"name" is empty')
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = _strict_json(arguments)
        except json.JSONDecodeError as exc:
            return error(f'"arguments" is a string but not valid JSON: {exc.msg} at character {exc.pos}', name)
        except _InvalidJSON as exc:
            return error(f'"arguments" is a string but not valid JSON: {exc}', name)
        except RecursionError:
            return error('"arguments" is nested too deeply', name)
        except ValueError as exc:  # e.g. an integer literal past Python's int-string conversion limit
            return error(f'"arguments" is a string but not valid JSON: {exc}', name)
    if not isinstance(arguments, Mapping):
        kind = json_type(arguments)
        return error(f'"arguments" must be a JSON object mapping argument names to values, got {kind}', name)
    if _depth_exceeds(arguments, MAX_ARGUMENT_DEPTH):
        return error(f'"arguments" is nested more than {MAX_ARGUMENT_DEPTH} levels deep', name)
    return ToolCall(name=name, arguments=dict(arguments), span=span)


def format_tool_call(name: str, arguments: Mapping[str, Any] | None = None) -> str:
    """The text a policy writes to call ``name``: the inverse of `parse_tool_calls` for one call.

    NumPy scalars and arrays in ``arguments`` are written as the JSON numbers and lists they hold (a task drawn with
    ``rng.integers`` hands out ``np.int64``)."""
    payload = json.dumps({"name": name, "arguments": dict(arguments or {})}, ensure_ascii=False, default=_plain)
    return f"{OPEN_TAG}\n{payload}\n{CLOSE_TAG}"


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    raise TypeError(f"tool argument of type {type(value).__name__} is not JSON serializable")


def json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


class _InvalidJSON(ValueError):
    pass


def _strict_json(text: str) -> Any:
    """JSON as the spec has it: no duplicate keys, no NaN/Infinity, no float literal that overflows to inf."""
    return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_reject_constant, parse_float=_finite_float)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _InvalidJSON(f"duplicate key {preview(key)}")
        result[key] = value
    return result


def _reject_constant(constant: str) -> Any:
    raise _InvalidJSON(f"{constant} is not a JSON value")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):  # 1e999 parses to inf, which no JSON value denotes
        raise _InvalidJSON(f"{preview(literal)} is out of the range of a float")
    return value


def _depth_exceeds(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children: Iterable[Any]
        if isinstance(item, Mapping):
            children = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False
