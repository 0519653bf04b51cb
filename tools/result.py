"""What a tool call leaves behind: a `ToolResult` the model sees (``content``) and the store records (``to_record``).

A tool never raises into the environment. Every failure — an unparsable call, an unknown tool, bad arguments, an
exception, a timeout, an oversize output, a denied request — becomes a result with ``ok=False``, an ``error`` kind
and a ``content`` that explains the failure in words the model can act on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

ErrorKind = Literal["parse", "unknown_tool", "bad_arguments", "exception", "timeout", "output_too_large", "denied"]
ERROR_KINDS: tuple[ErrorKind, ...] = get_args(ErrorKind)

DEFAULT_MAX_OUTPUT_CHARS = 20_000
"""Default cap on what one tool call may put into the context (characters)."""

PREVIEW_CHARS = 80
"""How much of an offending value an error message quotes."""


class ToolResult(BaseModel):
    """The outcome of one tool call."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="The tool that was called (as the model spelled it; '' when it could not be read).")
    ok: bool = Field(description="True exactly when `error` is None.")
    content: str = Field(description="What the model sees: the tool's output, or a readable error message.")
    error: ErrorKind | None = Field(default=None, description="Why the call failed; None when it succeeded.")
    truncated: bool = Field(default=False, description="Whether `content` was cut to the output cap.")
    original_length: int = Field(default=0, ge=0, description="Length of the output before truncation.")
    elapsed_s: float = Field(default=0.0, ge=0.0, description="Wall-clock seconds the call took.")
    arguments: dict[str, Any] | None = Field(
        default=None, description="The arguments as the model gave them, when they were a JSON object."
    )

    @model_validator(mode="after")
    def _ok_iff_no_error(self) -> ToolResult:
        if self.ok != (self.error is None):
            raise ValueError(
                f"ok={self.ok} contradicts error={self.error!r}: ok must be True exactly when error is None"
            )
        return self

    @classmethod
    def failure(cls, name: str, kind: ErrorKind, message: str, **fields: Any) -> ToolResult:
        """An error result whose content is ``message``."""
        fields.setdefault("original_length", len(message))
        return cls(name=name, ok=False, content=message, error=kind, **fields)

    def to_record(self) -> dict[str, Any]:
        """A JSON-able dict for ``info`` and the store; ``ToolResult.model_validate`` reads it back."""
        return self.model_dump(mode="json")


class ToolFailure(Exception):
    """Raise inside a tool to fail with a readable message (and, optionally, a specific error kind).

    Unlike any other exception, the message reaches the model as is, without the exception's type name.
    """

    def __init__(self, message: str, kind: ErrorKind = "exception") -> None:
        if kind not in ERROR_KINDS:
            raise ValueError(f"unknown error kind {kind!r}; expected one of {ERROR_KINDS}")
        super().__init__(message)
        self.message = message
        self.kind: ErrorKind = kind


@dataclass(frozen=True)
class ToolOutput:
    """What a tool function may return instead of a plain value when it knows more than the text.

    Used by tools that produce partial output on failure (a sandboxed program that printed something and then
    timed out) or that cut their output themselves before it reached the tool's own cap.
    """

    content: str
    error: ErrorKind | None = None
    truncated: bool = False
    original_length: int | None = None
    """Length of the full output when the tool cut it itself (in the unit the tool measured)."""

    def __post_init__(self) -> None:
        if not isinstance(self.content, str):
            raise TypeError(f"ToolOutput.content must be a string, got {type(self.content).__name__}")
        if self.error is not None and self.error not in ERROR_KINDS:
            raise ValueError(f"unknown error kind {self.error!r}; expected one of {ERROR_KINDS}")


def truncation_marker(dropped: int, unit: str = "characters") -> str:
    return f"\n…[truncated {dropped} {unit}]"


def truncate(text: str, max_chars: int) -> tuple[str, bool]:
    """Cut ``text`` to at most ``max_chars`` characters plus an explicit marker saying how much was dropped."""
    if len(text) <= max_chars:
        return text, False
    return text[:max_chars] + truncation_marker(len(text) - max_chars), True


def preview(value: Any, max_chars: int = PREVIEW_CHARS) -> str:
    """A short, escaped rendering of ``value`` for error messages (huge or binary values stay readable)."""
    try:
        text = repr(value)
    except Exception:  # a hostile __repr__ must not break error reporting
        text = f"<{type(value).__name__}>"
    if len(text) > max_chars:
        text = f"{text[:max_chars]}… ({len(text)} characters)"
    return text


def valid_unicode(text: str) -> str:
    """``text`` with lone surrogates replaced by U+FFFD, so that it can always be encoded (and tokenized)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", errors="surrogatepass").decode("utf-8", errors="replace")
    return text
