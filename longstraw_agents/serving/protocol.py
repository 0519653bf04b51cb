"""The OpenAI API's side of the server, without torch: the requests as pydantic models (what each route reads, what
it refuses and why), the checked chat messages and the replies a ``ChatTemplate`` reads, and OpenAI's error body.

Requests are checked as OpenAI checks them: ``model`` is required (missing or null: a 400), a field the API does not
have is refused with a 400 that names it, null sampling fields mean their defaults, and a field the sampler cannot
honour (stop strings, penalties, ``logit_bias``, ...) is refused rather than silently ignored
(``CompletionRequest.unsupported``). ``messages`` and ``tools`` are checked one by one (``chat_messages``,
``chat_tools``), so that an error names the message or tool at fault.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_CHOICES = 128
"""Choices per request at most (``n`` × prompts): every one is decoded in the same batch."""
DEFAULT_MAX_TOKENS = 16  # the OpenAI API's default for completions

_Model = TypeVar("_Model", bound=BaseModel)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool | None = None


class _SamplingFields(BaseModel):
    """The fields both ``/v1/completions`` and ``/v1/chat/completions`` read; null means the default (``model``
    excepted: it is required, as by OpenAI). A field the API does not have is refused, not ignored."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop_token_ids: list[int] | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    user: str | None = None  # an end-user id for the provider's abuse monitoring: nothing to do with it here
    # what the sampler cannot do: refused unless null or neutral (``unsupported``)
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> str | None:
        """The first field set to something this server cannot honour, with why; None when all are fine."""
        if self.stop:
            return "stop: stop strings are not supported; use stop_token_ids"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                return f"{name}: penalties are not supported (send 0 or null)"
        if self.logit_bias:
            return "logit_bias: logit biases are not supported"
        return None


class CompletionRequest(_SamplingFields):
    """The fields of ``POST /v1/completions`` (others are refused); null means the default."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0)
    # refused unless null or neutral (``unsupported``)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo: echoing the prompt is not supported"
        if self.suffix:
            return "suffix: insertion (suffix) is not supported"
        if self.best_of is not None and self.best_of != (self.n or 1):
            return "best_of: only best_of equal to n is supported (every choice is returned)"
        return super().unsupported()


@dataclass(frozen=True)
class FunctionCall:
    """A tool call: the function's name and its arguments (a decoded JSON object)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ChatMessage:
    """A checked chat message: ``role`` is system, user, assistant or tool (OpenAI's ``developer`` is system),
    ``content`` its text (content parts joined), ``tool_calls`` the calls of an assistant message."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: tuple[FunctionCall, ...] = ()


@dataclass(frozen=True)
class Reply:
    """An assistant reply read by a chat template: its content and the tool calls it makes."""

    content: str
    tool_calls: tuple[FunctionCall, ...] = ()


class ChatTemplate(Protocol):
    """How ``/v1/chat/completions`` turns messages into a prompt and a generated text into a reply (the app layer's
    ``QwenChatTemplate`` is the format the environments train with)."""

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[Mapping[str, Any]]) -> list[int]:
        """The prompt ids: the conversation, ``tools`` (OpenAI function schemas) in it, then the generation prompt;
        a ``ValueError`` says what is wrong with the conversation."""
        ...

    def reply(self, text: str) -> Reply:
        """A whole generated text as content and tool calls."""
        ...

    def streamable(self, text: str) -> str:
        """The content of a text still being generated that is known already: a prefix of ``reply(text + more)``'s
        content, whatever ``more`` is."""
        ...


class _ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: str
    text: str | None = None


class _FunctionCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str = Field(min_length=1)
    arguments: str


class _ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"] = "function"
    function: _FunctionCallIn


class _MessageIn(BaseModel):
    """A message as the OpenAI API sends it (``name`` and ``tool_call_id`` are read by nothing and ignored)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_ContentPart] | None = None
    tool_calls: list[_ToolCallIn] | None = None


class _FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


class _ToolSpec(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    function: _FunctionSpec


class ChatCompletionRequest(_SamplingFields):
    """The fields of ``POST /v1/chat/completions`` (others are refused); null means the default.
    ``messages`` and ``tools`` are checked one by one when the prompt is rendered (``chat_messages``,
    ``chat_tools``), so that an error names the message or tool at fault."""

    messages: list[Any] = Field(min_length=1)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    # refused unless null or neutral (``unsupported``)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    @property
    def parses_tool_calls(self) -> bool:
        """Tool calls are read from the reply when the request offers tools (and ``tool_choice`` is not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    def unsupported(self) -> str | None:
        """The first field set to something this server cannot honour, with why; None when all are fine."""
        if self.tool_choice not in (None, "auto", "none"):
            return 'tool_choice: only "auto" and "none" are supported (decoding is not constrained to a tool call)'
        if self.parallel_tool_calls is False:
            return "parallel_tool_calls: a reply may hold several tool calls; false is not supported"
        if self.top_logprobs:
            return "top_logprobs: the sampler keeps no alternatives (send 0 or null)"
        if self.skip_special_tokens:
            return "skip_special_tokens: a chat reply keeps the template's tags, e.g. <tool_call> (send false or null)"
        if self.response_format is not None and self.response_format.get("type") != "text":
            return 'response_format: structured outputs are not supported (send {"type": "text"} or null)'
        return super().unsupported()

    @property
    def max_tokens_field(self) -> str:
        """The field that sets the reply's length: ``max_completion_tokens``, else the older ``max_tokens``."""
        if self.max_completion_tokens is None and self.max_tokens is not None:
            return "max_tokens"
        return "max_completion_tokens"

    def completion_request(self, prompt: list[int]) -> CompletionRequest:
        """The completion of ``prompt`` (the rendered messages) with this request's sampling fields (null
        ``max_tokens``: the chat default); the text keeps special tokens (the template reads its tags)."""
        own = {"stream_options", "max_tokens", "skip_special_tokens"}
        shared = self.model_dump(include=set(_SamplingFields.model_fields) - own)
        return CompletionRequest(
            **shared,
            stream_options=self.stream_options,
            prompt=prompt,
            max_tokens=self.max_completion_tokens or self.max_tokens,
            logprobs=0 if self.logprobs else None,
            skip_special_tokens=False,
        )


class UpdateWeightsRequest(BaseModel):
    """``POST /update_weights_from_disk`` as SGLang takes it (its other fields, e.g. ``flush_cache``, are ignored)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model_path: str = Field(min_length=1)
    weight_version: str | None = None
    load_format: str | None = None


class RequestError(ValueError):
    """A request the server answers with an HTTP error: ``status``, a message, the field at fault and OpenAI's
    ``code`` when it has one (e.g. ``context_length_exceeded``)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def payload(self) -> dict[str, Any]:
        return error_payload(str(self), self.status, self.param, self.code)


def error_payload(message: str, status: int, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body, its ``type`` from the status."""
    kinds = {404: "not_found_error", 429: "rate_limit_error", 503: "overloaded_error"}
    kind = kinds.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def parse_request(body: Any) -> CompletionRequest:
    """``body`` as a ``CompletionRequest``; a ``RequestError`` names the first bad or unsupported field."""
    return _parsed(body, CompletionRequest)


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    """``body`` as a ``ChatCompletionRequest``; a ``RequestError`` names the first bad or unsupported field
    (``messages`` and ``tools`` are checked when the prompt is rendered)."""
    return _parsed(body, ChatCompletionRequest)


_Request = TypeVar("_Request", bound=_SamplingFields)


def _parsed(body: Any, model: type[_Request]) -> _Request:
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        request = model.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        raise RequestError(validation_message(err), param=str(first["loc"][0]) if first["loc"] else None) from None
    problem = request.unsupported()
    if problem is not None:
        raise RequestError(problem, param=problem.split(":", 1)[0])
    return request


def chat_messages(bodies: Sequence[Any]) -> list[ChatMessage]:
    """The request's messages checked one by one; a ``RequestError`` names the message and its field."""
    return [_chat_message(body, f"messages[{index}]") for index, body in enumerate(bodies)]


def _chat_message(body: Any, where: str) -> ChatMessage:
    message = _validated(_MessageIn, body, where)
    tool_calls = tuple(
        _function_call(call.function, f"{where}.tool_calls[{k}].function")
        for k, call in enumerate(message.tool_calls or ())
    )
    if tool_calls and message.role != "assistant":
        raise RequestError(
            f"{where}.tool_calls: only an assistant message makes tool calls", param=f"{where}.tool_calls"
        )
    if message.content is None and not tool_calls:
        needs = "content or tool_calls" if message.role == "assistant" else "content"
        raise RequestError(f"{where}.content: a {message.role} message needs {needs}", param=f"{where}.content")
    role = "system" if message.role == "developer" else message.role
    return ChatMessage(role, _content_text(message.content, f"{where}.content"), tool_calls)


def _content_text(content: str | list[_ContentPart] | None, where: str) -> str:
    """The text of a message: a string, or its text parts joined (the served models read text only)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for k, part in enumerate(content):
        if part.type != "text":
            raise RequestError(f"{where}[{k}]: only text parts are supported, not {part.type!r}", param=where)
        if part.text is None:
            raise RequestError(f"{where}[{k}].text: a text part needs its text", param=where)
        texts.append(part.text)
    return "".join(texts)


def _function_call(function: _FunctionCallIn, where: str) -> FunctionCall:
    try:
        arguments = json.loads(function.arguments)
    except json.JSONDecodeError as err:
        raise RequestError(f"{where}.arguments: not JSON ({err})", param=f"{where}.arguments") from None
    if not isinstance(arguments, dict):
        raise RequestError(f"{where}.arguments: must be a JSON object", param=f"{where}.arguments")
    return FunctionCall(function.name, arguments)


def chat_tools(bodies: Sequence[Any] | None) -> list[dict[str, Any]]:
    """The request's tools, each checked as an OpenAI function tool and kept as sent (the template writes them)."""
    for index, body in enumerate(bodies or ()):
        _validated(_ToolSpec, body, f"tools[{index}]")
    return list(bodies or ())


def _validated(model: type[_Model], body: Any, where: str) -> _Model:
    if not isinstance(body, dict):
        raise RequestError(f"{where}: must be a JSON object, got {type(body).__name__}", param=where)
    try:
        return model.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        field_name = f"{where}.{first['loc'][0]}" if first["loc"] else where
        raise RequestError(validation_message(err, prefix=f"{where}."), param=field_name) from None


def parse_update_request(body: Any) -> UpdateWeightsRequest:
    """``body`` as an ``UpdateWeightsRequest``; a ``RequestError`` says what is wrong with it."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return UpdateWeightsRequest.model_validate(body)
    except ValidationError as err:
        raise RequestError(validation_message(err)) from None


def validation_message(err: ValidationError, prefix: str = "") -> str:
    """Pydantic's errors as one line per field (a union reports each branch; the field is named once), each field
    named after ``prefix``."""
    seen: dict[str, str] = {}
    for error in err.errors():
        name = str(error["loc"][0]) if error["loc"] else "request"
        unknown = error["type"] == "extra_forbidden"
        seen.setdefault(name, "unknown field (the API has no such field)" if unknown else error["msg"])
    return "; ".join(f"{prefix}{name}: {message}" for name, message in seen.items())
