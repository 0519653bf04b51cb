"""`@tool`: a typed Python function becomes a `Tool` with a pydantic argument model and an OpenAI schema.

The signature is the contract. Type hints and defaults become the fields of a pydantic model (extra arguments
forbidden); the docstring's first part becomes the tool description and its ``Args:`` section (Google style) the
per-argument descriptions, unless an argument says ``Annotated[T, Field(description=...)]`` itself. The model's
JSON schema is what the policy is shown, so arguments are validated against it strictly: ``"5"`` is not an
integer and ``true`` is not a number.

``Tool.invoke`` never raises: whatever goes wrong becomes an error `ToolResult`. Mistakes in the tool definition
itself (a missing type hint, ``*args``, a name the function-calling format does not allow) raise at decoration time.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, get_type_hints, overload

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from pydantic.fields import FieldInfo
from pydantic.json_schema import GenerateJsonSchema

from .result import DEFAULT_MAX_OUTPUT_CHARS, ToolFailure, ToolOutput, ToolResult, preview, truncate, valid_unicode

TOOL_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""Names the OpenAI function-calling format accepts."""

_ARG_SECTIONS = frozenset({"args", "arguments", "parameters", "params"})
_DOCSTRING_SECTIONS = _ARG_SECTIONS | {"returns", "return", "yields", "raises", "examples", "example", "note", "notes"}
_MAX_EXCEPTION_MESSAGE_CHARS = 500
_ARG_LINE = re.compile(r"^\*{0,2}(?P<name>\w+)\s*(?:\([^)]*\))?\s*:\s*(?P<text>.*)$")

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Tool:
    """A callable the policy may invoke by name with JSON arguments.

    Build one with `@tool` (or `Tool.from_function`); change a limit with ``dataclasses.replace(t, timeout_s=5)``.
    ``timeout_s`` bounds how long `invoke` waits. The function keeps running in a daemon thread after a timeout
    (Python cannot kill a thread), so tools that may hang for real should bound themselves, as the python sandbox
    does by killing its process group.
    """

    name: str
    description: str
    fn: Callable[..., Any] = field(repr=False)
    arguments_model: type[BaseModel] = field(repr=False)
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS
    timeout_s: float | None = None
    parameters: dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_name(self.name)
        if self.max_output_chars < 1:
            raise ValueError(f"max_output_chars must be >= 1, got {self.max_output_chars}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive or None, got {self.timeout_s}")
        object.__setattr__(self, "parameters", parameters_schema(self.arguments_model))

    @classmethod
    def from_function(
        cls,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
        timeout_s: float | None = None,
    ) -> Tool:
        if not callable(fn):
            raise TypeError(f"@tool needs a function, got {type(fn).__name__}")
        if inspect.iscoroutinefunction(fn):
            raise TypeError(f"tool {fn.__name__!r} is async; tools are plain functions (run the coroutine inside)")
        tool_name = name or getattr(fn, "__name__", None)
        if not tool_name:
            raise TypeError(f"{fn!r} has no __name__; pass @tool(name=...)")
        _check_name(tool_name)
        summary, arg_docs = parse_docstring(inspect.getdoc(fn) or "")
        return cls(
            name=tool_name,
            description=description if description is not None else summary,
            fn=fn,
            arguments_model=arguments_model(fn, tool_name, arg_docs),
            max_output_chars=max_output_chars,
            timeout_s=timeout_s,
        )

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI function-calling schema: ``{"type": "function", "function": {name, description, parameters}}``."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": copy.deepcopy(self.parameters),
            },
        }

    @property
    def usage(self) -> str:
        """A one-line signature for error messages, e.g. ``search_documents(query: string, k: integer = 5)``."""
        properties = self.parameters.get("properties", {})
        required = set(self.parameters.get("required", ()))
        parts = []
        for arg, spec in properties.items():
            text = f"{arg}: {_schema_type(spec)}"
            if arg not in required and "default" in spec:
                text += f" = {json.dumps(spec['default'])}"
            parts.append(text)
        return f"{self.name}({', '.join(parts)})"

    def invoke(self, arguments: Any) -> ToolResult:
        """Validate ``arguments`` (a JSON object) against the argument model, run the function, wrap the outcome."""
        start = time.perf_counter()
        recorded = _jsonable_object(arguments)
        try:
            validated = self._validate(arguments)
        except _BadArguments as exc:
            return ToolResult.failure(self.name, "bad_arguments", str(exc), arguments=recorded, elapsed_s=_since(start))
        try:
            output = self._run(validated)
            if not isinstance(output, ToolOutput):
                output = ToolOutput(render_output(output))
        except ToolFailure as exc:
            output = ToolOutput(f"Error: {exc.message}", error=exc.kind)
        except _Timeout:
            output = ToolOutput(f"Error: tool {self.name!r} timed out after {self.timeout_s:g} s", error="timeout")
        except (Exception, SystemExit) as exc:  # the tool's own bug or a failure it did not anticipate: report it
            output = ToolOutput(f"Error: tool {self.name!r} raised {_describe_exception(exc)}", error="exception")
        return self._result(output, recorded, _since(start))

    def _validate(self, arguments: Any) -> BaseModel:
        if not isinstance(arguments, Mapping):
            raise _BadArguments(
                f"Error: arguments for tool {self.name!r} must be a JSON object mapping argument names to values, "
                f"got {type(arguments).__name__} {preview(arguments)}. Usage: {self.usage}"
            )
        try:
            try:
                as_json = json.dumps(arguments, allow_nan=False, ensure_ascii=False)
            except (TypeError, ValueError):  # Python objects handed over directly: validate them as they are
                return self.arguments_model.model_validate(dict(arguments), strict=True)
            try:
                encoded = as_json.encode("utf-8")
            except UnicodeEncodeError as exc:  # JSON allows "\ud800"; text must not carry half a character
                raise _BadArguments(
                    f"Error: arguments for tool {self.name!r} contain a lone UTF-16 surrogate "
                    f"({as_json[exc.start : exc.end]!r}), which is not valid Unicode text"
                ) from None
            return self.arguments_model.model_validate_json(encoded, strict=True)
        except ValidationError as exc:
            problems = "; ".join(_describe_validation_error(error) for error in exc.errors())
            message = f"Error: invalid arguments for tool {self.name!r}: {problems}. Usage: {self.usage}"
            raise _BadArguments(message) from None
        except RecursionError:
            raise _BadArguments(f"Error: arguments for tool {self.name!r} are nested too deeply") from None
        except _BadArguments:
            raise
        except Exception as exc:  # a Mapping handed over directly that cannot even be read
            message = f"Error: arguments for tool {self.name!r} could not be read: {_describe_exception(exc)}"
            raise _BadArguments(message) from None

    def _run(self, validated: BaseModel) -> Any:
        values = {name: getattr(validated, name) for name in type(validated).model_fields}
        if self.timeout_s is None:
            return _call(self.fn, values)
        return _call_with_timeout(self.fn, values, self.timeout_s)

    def _result(self, output: ToolOutput, arguments: dict[str, Any] | None, elapsed_s: float) -> ToolResult:
        content, cut_here = truncate(valid_unicode(output.content), self.max_output_chars)
        truncated = output.truncated or cut_here
        original_length = max(len(output.content), output.original_length or 0)
        error = output.error
        if truncated and error is None:
            error = "output_too_large"
        return ToolResult(
            name=self.name,
            ok=error is None,
            content=content,
            error=error,
            truncated=truncated,
            original_length=original_length,
            elapsed_s=elapsed_s,
            arguments=arguments,
        )


@overload
def tool(
    fn: F,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
    timeout_s: float | None = None,
) -> Tool: ...


@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
    timeout_s: float | None = None,
) -> Callable[[F], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
    timeout_s: float | None = None,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Turn a typed function into a `Tool`; use as ``@tool``, ``@tool(name=..., timeout_s=...)`` or
    ``tool(fn, name=...)``.

    >>> @tool
    ... def add(a: int, b: int = 1) -> int:
    ...     '''Add two integers.
    ...
    ...     Args:
    ...         a: The first summand.
    ...         b: The second summand.
    ...     '''
    ...     return a + b
    >>> add.invoke({"a": 2, "b": 3}).content
    '5'
    >>> add.schema["function"]["parameters"]["properties"]["a"]
    {'description': 'The first summand.', 'type': 'integer'}
    """

    def decorate(function: Callable[..., Any]) -> Tool:
        return Tool.from_function(
            function, name=name, description=description, max_output_chars=max_output_chars, timeout_s=timeout_s
        )

    return decorate if fn is None else decorate(fn)


def arguments_model(fn: Callable[..., Any], tool_name: str, arg_docs: Mapping[str, str]) -> type[BaseModel]:
    """The pydantic model of ``fn``'s arguments (extra arguments forbidden)."""
    try:
        hints = get_type_hints(fn, include_extras=True)
    except Exception as exc:
        raise TypeError(f"cannot resolve the type hints of tool {tool_name!r}: {exc}") from exc
    fields: dict[str, Any] = {}
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool {tool_name!r}: *args and **kwargs cannot be described by a JSON schema")
        if param.name not in hints:
            raise TypeError(f"tool {tool_name!r}: parameter {param.name!r} needs a type hint")
        annotation = hints[param.name]
        fields[param.name] = (annotation, _field_info(param, annotation, arg_docs.get(param.name)))
    model_name = "".join(part.capitalize() for part in re.split(r"[_-]", tool_name)) + "Arguments"
    return create_model(model_name, __config__=ConfigDict(extra="forbid"), **fields)


def _field_info(param: inspect.Parameter, annotation: Any, doc: str | None) -> FieldInfo:
    described = _annotation_has_description(annotation)
    extra: dict[str, Any] = {"description": doc} if doc and not described else {}
    default = param.default
    if isinstance(default, FieldInfo):  # `def f(k: int = Field(5, ge=1))`
        return FieldInfo.merge_field_infos(default, **extra) if extra and default.description is None else default
    return Field(**extra) if default is inspect.Parameter.empty else Field(default, **extra)


def _annotation_has_description(annotation: Any) -> bool:
    metadata = getattr(annotation, "__metadata__", ())
    return any(isinstance(item, FieldInfo) and item.description for item in metadata)


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into its description and its ``Args:`` entries (name → text)."""
    description: list[str] = []
    arg_docs: dict[str, str] = {}
    section: str | None = None
    entry_indent: int | None = None  # the indentation of ``name: text`` lines; deeper lines continue an entry
    current: str | None = None
    for line in inspect.cleandoc(doc).splitlines():
        stripped = line.strip()
        if not line.startswith(" ") and stripped.endswith(":") and stripped[:-1].lower() in _DOCSTRING_SECTIONS:
            section, entry_indent, current = stripped[:-1].lower(), None, None
            continue
        if section is None:
            description.append(line)
        elif section in _ARG_SECTIONS and stripped:
            indent = len(line) - len(line.lstrip())
            entry_indent = indent if entry_indent is None else entry_indent
            match = _ARG_LINE.match(stripped)
            if indent == entry_indent and match:
                current = match["name"]
                arg_docs[current] = match["text"].strip()
            elif indent > entry_indent and current is not None:
                arg_docs[current] = f"{arg_docs[current]} {stripped}".strip()
    return "\n".join(description).strip(), arg_docs


def render_output(value: Any) -> str:
    """What the model sees for a tool's return value: strings as they are, everything else as JSON."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, BaseModel):
        return value.model_dump_json()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    return json.dumps(value, ensure_ascii=False, default=str)


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not TOOL_NAME_PATTERN.match(name):
        raise ValueError(f"tool name {name!r} must match {TOOL_NAME_PATTERN.pattern} (function-calling format)")


class _BadArguments(Exception):
    pass


class _Timeout(Exception):
    pass


def _call(fn: Callable[..., Any], values: dict[str, Any]) -> Any:
    positional = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind is param.POSITIONAL_ONLY:
            positional.append(values.pop(param.name))
    return fn(*positional, **values)


def _call_with_timeout(fn: Callable[..., Any], values: dict[str, Any], timeout_s: float) -> Any:
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = _call(fn, values)
        except BaseException as exc:  # handed to the calling thread, which decides
            outcome["error"] = exc

    worker = threading.Thread(target=target, name=f"tool-{getattr(fn, '__name__', 'fn')}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise _Timeout
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def _describe_validation_error(error: Mapping[str, Any]) -> str:
    where = ".".join(str(part) for part in error.get("loc", ())) or "arguments"
    if error.get("type") == "extra_forbidden":
        return f"unexpected argument {where!r}"
    if error.get("type") == "missing":
        return f"missing required argument {where!r}"
    return f"{where}: {error.get('msg', 'invalid value')} (got {preview(error.get('input'))})"


def _describe_exception(exc: BaseException) -> str:
    """``TypeName: message``, the last line of a traceback (the frames are the tool author's business)."""
    message = str(exc)
    if len(message) > _MAX_EXCEPTION_MESSAGE_CHARS:
        message = message[:_MAX_EXCEPTION_MESSAGE_CHARS] + "…"
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _schema_type(spec: Mapping[str, Any]) -> str:
    if "type" in spec:
        kind = spec["type"]
        if kind == "array" and isinstance(spec.get("items"), Mapping):
            return f"array of {_schema_type(spec['items'])}"
        return kind if isinstance(kind, str) else " | ".join(kind)
    if "enum" in spec:
        return " | ".join(json.dumps(choice) for choice in spec["enum"])
    if "anyOf" in spec:
        return " | ".join(_schema_type(option) for option in spec["anyOf"])
    if "$ref" in spec:
        return "object"
    return "any"


def _jsonable_object(arguments: Any) -> dict[str, Any] | None:
    """``arguments`` if it is a JSON object that survives serialization (the record must be JSON), else None."""
    if not isinstance(arguments, dict) or not all(isinstance(key, str) for key in arguments):
        return None
    try:
        json.dumps(arguments, allow_nan=False)
    except Exception:  # not JSON (objects, NaN, cycles, too deep): the record leaves the arguments out
        return None
    return arguments


def _since(start: float) -> float:
    return time.perf_counter() - start


class _NoFieldTitles(GenerateJsonSchema):
    """Pydantic titles every field ("Expression"); the function-calling schema has no use for them."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def parameters_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The JSON schema of an argument model, as the ``parameters`` of a function-calling schema."""
    schema = model.model_json_schema(schema_generator=_NoFieldTitles)
    schema.pop("title", None)
    schema.setdefault("properties", {})
    return schema
