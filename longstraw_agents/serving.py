"""An OpenAI-compatible server over ``TorchSampler`` (completions and chat completions): what the official ``openai``
client and vLLM-style token-id clients (``OpenAISampler``) use.

It exists so that ``OpenAISampler`` can be tested end to end on one machine, and to serve a local policy to tools
that speak the OpenAI API (``longstraw serve`` starts one from a run or a model directory). Bind it to loopback
only; it serves one model, and no request can take it down (see "Requests in flight" below).

    server = CompletionServer(TorchSampler(model, stop_token_ids=[eos]), tokenizer=load_tokenizer())
    server.start()          # serves http://127.0.0.1:<server.port>/v1/completions and /v1/models
    OpenAI(base_url=server.url + "/v1", api_key="unused").completions.create(model="default", prompt="Hi", n=3)
    server.stop()

What is served (``POST /v1/completions``, ``GET /v1/models``, ``GET /v1/models/{id}``):

- Responses carry ``id``, ``object``, ``created``, ``model``, ``choices`` and ``usage`` (with ``total_tokens``).
- ``prompt``: token ids, or text when the server has a tokenizer; a list of either is a batch of prompts.
- ``n`` choices per prompt, decoded together; choice k of prompt p draws with its own seed, derived from (request
  seed, p·n + k), so a seeded request repeats and its choices differ. A null or missing ``seed`` is a random one.
- ``stream=True``: server-sent events in OpenAI's format, one chunk per generated token of each choice (the chunk
  of a choice's last token carries its ``finish_reason``), a usage chunk when ``stream_options.include_usage``,
  then ``data: [DONE]``. Streamed and non-streamed requests with one seed draw the same tokens.
- Null sampling fields (``temperature``, ``top_p``, ``max_tokens``, ``n``, ``seed``, ...) mean their defaults
  (1, 1, 16, 1, random), as in the OpenAI API.
- ``text`` is decoded with the server's tokenizer (``tokenizer=``, e.g. ``load_tokenizer()``): special tokens are
  skipped unless ``skip_special_tokens`` is false, and a final stop token is left out of the text unless
  ``include_stop_str_in_output``. Without a tokenizer ``text`` is always ``""``, text prompts are refused and the
  logprob tokens are ids.
- vLLM's extensions: ``stop_token_ids`` (default: the sampler's), ``return_tokens_as_token_ids`` (logprob tokens
  as ``"token_id:N"``), ``skip_special_tokens``, ``include_stop_str_in_output``.
- ``logprobs`` (any integer) returns each sampled token's log-probability under the temperature-scaled
  distribution; ``top_logprobs`` is always null (the sampler keeps no alternatives).

Weights and versions (SGLang's protocol, what ``weight_sync.DiskWeightSync`` pushes to):

- ``POST /update_weights_from_disk`` with ``{"model_path": DIR, "weight_version": "N"}`` loads a ``save_pretrained``
  directory into the served model in place (``weight_sync.load_weights``) between requests, and answers
  ``{"success": true, "message": ..., "weight_version": "N"}``. Without ``weight_version`` the version goes up by
  one. A missing directory, another architecture (the message names what differs) or a version that is not a
  number is a 400 with ``"success": false``, and the served weights and version stay as they were.
- The policy version served (0 at start) is ``metadata.weight_version`` of every completion (as SGLang's) and of
  ``GET /model_info`` (also ``/get_model_info``) and ``GET /get_weight_version``; SGLang's ``return_token_ids``
  adds each choice's sampled ids as ``token_ids``.

Refused with a 400 that names the field: stop strings (``stop``), ``echo``, ``suffix``, ``best_of`` other than
``n``, non-zero penalties and ``logit_bias`` — the sampler cannot honour them, and ignoring them would silently
change what the client asked for. Requests are checked as OpenAI checks them: ``model`` is required (missing or
null: a 400), a field the API does not have is refused with a 400 that names it, and the body must be
``application/json`` (else a 415) of at most ``MAX_BODY_BYTES`` (else a 413). A request for another model than
``model_name`` is a 404, as with vLLM.

Requests in flight (``serving_limits``; what a vLLM or SGLang user expects of one server over one engine):

- Each request is served by a thread of its own, its choices decoded as one batch (one forward per step). The
  requests in flight take turns on the engine a step at a time, first come first served (``Turns``), and a long
  prompt is captured a chunk per turn, so a long request shares the engine but never holds it: a short request
  beside a 100,000-token one is answered after its own few steps. (vLLM and SGLang batch all the requests in flight
  into one forward per step, continuous batching; here each request's step is its own forward: the same
  interleaving and fairness, less throughput for many small requests.)
- A request whose client disconnects is cancelled before its next step: streamed, when a chunk cannot be written
  or the connection is seen closed; not streamed, when the connection is seen closed between steps.
- ``max_tokens`` (chat: ``max_completion_tokens``) is at most the context minus the prompt (a 400 with code
  ``context_length_exceeded``) and at most ``ServingLimits.max_tokens`` (``longstraw serve --max-tokens``; a 400
  naming it). A default one is lowered to both instead.
- Memory is reserved as decoding proceeds (the decoder's buffers double), never ``max_tokens`` positions up front.
  A request is counted at the most it can hold (``request_bytes``, from the model's ``state_size`` per token), and
  the requests in flight hold at most ``ServingLimits.memory_budget`` together (default: half the memory free on
  the device at start). One that could never fit is a 400; one that does not fit now waits, first come first
  served, up to ``queue_timeout_s``, then gets a 503 with ``Retry-After`` — as does one arriving while
  ``max_waiting`` requests wait already.
- An allocation that fails anyway (``torch.OutOfMemoryError``, ``MemoryError``, an allocator's ``RuntimeError``),
  or anything else that goes wrong in a request, is a 500 with a JSON error body (in a stream that has begun: an
  ``error`` event, then ``[DONE]``); the request's memory is freed and the server goes on serving.
- Loading new weights (``/update_weights_from_disk``) waits, in line with the requests, until those in flight have
  ended, so that every completion is sampled by one version.

Chat (``POST /v1/chat/completions``, with a ``chat_template``; without one it is a 400):

- The messages (OpenAI's shape: text content or text parts, ``developer`` read as ``system``, an assistant's
  ``tool_calls``, tool results) and ``tools`` are checked one by one — a 400 names e.g. ``messages[2].content`` —
  and rendered to prompt ids by the template; the prompt is then completed as a ``/v1/completions`` request would be:
  ``n``, ``seed``, ``temperature``, ``top_p``, ``stop_token_ids`` and the usage counts are the same. The reply keeps
  special tokens (the template reads its tags), all but a final stop token.
- ``max_completion_tokens`` (or ``max_tokens``) defaults to the sampler's ``max_new_tokens``: a turn as long as in
  training, not the completions endpoint's 16.
- With ``tools`` (and ``tool_choice`` null, "auto" or "none"), the template reads the reply's tool calls: they come
  back as ``message.tool_calls`` (arguments as a JSON string, content null when nothing else was said) with
  ``finish_reason: "tool_calls"``. ``tool_choice: "none"`` leaves the reply as text.
- ``logprobs: true`` gives ``choices[i].logprobs.content``: one entry per sampled token (the stop token too, as the
  trainer scores it) with its ``bytes`` and an empty ``top_logprobs``.
- ``stream=True``: ``chat.completion.chunk`` events, first each choice's role, then one chunk per generated token with
  the content it adds; content that may still turn out to be a tool call (from ``<tool_call>`` on) is held back, and
  the last chunk of a choice carries the rest of the content, its ``tool_calls`` and its ``finish_reason``. The
  deltas add up to the non-streamed reply of the same seed.
- Refused with a 400: what completions refuse (``stop``, penalties, ``logit_bias``), a ``tool_choice`` that forces a
  call, ``parallel_tool_calls: false``, ``top_logprobs`` above 0, ``skip_special_tokens: true`` and a
  ``response_format`` other than text.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal, Protocol, TypeVar, cast

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from longstraw_agents.models import context_limit, state_size
from longstraw_agents.sampler import SamplingConfig, weight_version_number
from longstraw_agents.serving_limits import (
    RETRY_AFTER_S,
    Busy,
    MemoryBudget,
    ServingLimits,
    Turns,
    default_budget,
    request_bytes,
)
from longstraw_agents.tokenizer import Tokenizer
from longstraw_agents.torch_sampler import BatchDecoding, TorchSampler
from longstraw_agents.weight_sync import WeightsMismatch, load_weights

log = logging.getLogger(__name__)

MAX_CHOICES = 128
"""Choices per request at most (``n`` × prompts): every one is decoded in the same batch."""
DEFAULT_MAX_TOKENS = 16  # the OpenAI API's default for completions
MAX_BODY_BYTES = 64 << 20
"""A request body at most: a million-token prompt is about 8 MB of JSON ids."""
CLIENT_TIMEOUT_S = 300
"""How long a connection may stall the server's reads and writes (a body announced but not sent, a stream its client
stopped reading) before the request is dropped; decoding itself is not bounded by it."""

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


class _Cancelled(Exception):
    """The request's client has gone: its decoding stops."""


@dataclass(frozen=True)
class _Flight:
    """How a request in flight runs: a turn of the server's engine per step, and its client still there."""

    turns: Turns
    client_gone: Callable[[], bool]

    def check(self) -> None:
        if self.client_gone():
            raise _Cancelled

    def pause(self) -> None:
        """Between a long prompt's chunks: the others' turns first."""
        self.turns.pass_turn()
        self.check()


@dataclass
class _Choice:
    """One choice being generated: what it drew so far and the text already sent."""

    index: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    sent_chars: int = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class _Job:
    """A checked request, its prompts as ids and its limits known (nothing computed yet): ``start`` forks the prompts
    (in the engine's turns), then ``run`` (one response) or ``events`` (stream chunks) decode its choices together, a
    turn of the engine per step.

    default_max_tokens: the length when the request sets none (lowered to the limits), and ``max_tokens_field`` the
    field a limit names."""

    def __init__(
        self,
        server: CompletionServer,
        request: CompletionRequest,
        *,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        max_tokens_field: str = "max_tokens",
    ):
        self.server = server
        self.request = request
        self.id = f"cmpl-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.prompts = server.prompt_ids(request.prompt)
        self.n = request.n or 1
        if self.n * len(self.prompts) > MAX_CHOICES:
            raise RequestError(
                f"{self.n} choices x {len(self.prompts)} prompts exceed {MAX_CHOICES} per request", param="n"
            )
        longest = max(len(p) for p in self.prompts)
        self.max_tokens = server.max_tokens(request.max_tokens, longest, default_max_tokens, max_tokens_field)
        self.nbytes = server.request_bytes(self.prompts, self.n, self.max_tokens, max_tokens_field)
        self.sampler = server.request_sampler(request, self.max_tokens)
        self.prompt_tokens = sum(len(p) for p in self.prompts)
        self.choices: list[_Choice] = []
        self.decoding: BatchDecoding | None = None

    def start(self, flight: _Flight) -> None:
        """Capture and fork the prompts (call in a turn of the engine; a long prompt passes it between chunks)."""
        handles = [h for ids in self.prompts for h in self.sampler.fork_pausing(ids, self.n, flight.pause)]
        # (choice p·n + k is member p·n + k of the request's sampler: its own seed)
        self.choices = [_Choice(index) for index in range(len(handles))]
        self.decoding = BatchDecoding(self.sampler, handles, self.max_tokens, keep_states=False)

    def run(self, flight: _Flight) -> dict[str, Any]:
        for _ in self.steps(flight):
            pass
        choices = [self._choice_payload(c, c.ids, c.logprobs, self.text(c, final=True)) for c in self.choices]
        return {**self._envelope(), "choices": choices, "usage": self.usage()}

    def events(self, flight: _Flight) -> Iterator[dict[str, Any]]:
        """One chunk per generated token of each choice (round robin), then a chunk with each finish reason."""
        for choice, new in self.steps(flight):
            yield self._chunk(choice, new)
        if self.wants_usage:
            yield {**self._envelope(), "choices": [], "usage": self.usage()}

    def steps(self, flight: _Flight) -> Iterator[tuple[_Choice, tuple[list[int], list[float]]]]:
        """Each choice's tokens as they are drawn, a step of all the choices still going per turn of the engine (so
        round robin): the choice and its new ids and logprobs (a choice is ``done`` after its last). Stops, with
        ``_Cancelled``, when the client has gone."""
        decoding = self.decoding
        assert decoding is not None, "start the job first"
        while not decoding.done:
            flight.check()
            with flight.turns.turn():
                drawn = decoding.step()
            for k, token, logprob in drawn:
                choice, turn = self.choices[k], decoding.turns[k]
                choice.ids.append(token)
                choice.logprobs.append(logprob)
                if turn.done:
                    choice.finish_reason = turn.finish
                yield choice, ([token], [logprob])

    @property
    def wants_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
        return self.request.stream_options is not None and bool(self.request.stream_options.include_usage)

    def _chunk(self, choice: _Choice, new: tuple[list[int], list[float]]) -> dict[str, Any]:
        ids, logprobs = new
        payload = self._choice_payload(choice, ids, logprobs, self.text(choice, final=choice.done))
        return {**self._envelope(), "choices": [payload], "usage": None}

    def text(self, choice: _Choice, *, final: bool) -> str:
        """The text of ``choice`` not sent yet; before the end, an incomplete trailing character is held back."""
        text = self.visible_text(choice, final=final)
        delta = text[choice.sent_chars :]
        choice.sent_chars = max(choice.sent_chars, len(text))
        return delta

    def visible_text(self, choice: _Choice, *, final: bool) -> str:
        """The whole text of ``choice`` so far; before the end, an incomplete trailing character is held back."""
        text = self.server.decode(self._visible_ids(choice))
        return text if final else text.rstrip("\ufffd")  # bytes of a character split across tokens: wait for the rest

    def _visible_ids(self, choice: _Choice) -> list[int]:
        ids = choice.ids
        if choice.finish_reason == "stop" and not self.request.include_stop_str_in_output:
            ids = ids[:-1]
        if self.request.skip_special_tokens is not False:
            special = self.server.special_ids
            ids = [t for t in ids if t not in special]
        return ids

    def _choice_payload(self, choice: _Choice, ids: list[int], logprobs: list[float], text: str) -> dict[str, Any]:
        payload = {
            "index": choice.index,
            "text": text,
            "logprobs": self._logprobs(ids, logprobs) if self.request.logprobs is not None else None,
            "finish_reason": choice.finish_reason,
        }
        if self.request.return_token_ids:  # SGLang's extension: the sampled ids themselves
            payload["token_ids"] = list(ids)
        return payload

    def _logprobs(self, ids: list[int], logprobs: list[float]) -> dict[str, Any]:
        tokens = [self.server.token_label(t, self.request.return_tokens_as_token_ids) for t in ids]
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": None}

    def _envelope(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.server.model_name,
            "metadata": {"weight_version": str(self.sampler.policy_version)},  # as SGLang: the weights that sampled
        }

    def usage(self) -> dict[str, int]:
        completion = sum(len(c.ids) for c in self.choices)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }


class _ChatJob:
    """A checked chat request: its messages rendered to one prompt and completed by a ``_Job``; ``run`` (one
    response) or ``events`` (stream chunks) in the chat completions shape."""

    def __init__(self, server: CompletionServer, request: ChatCompletionRequest, template: ChatTemplate):
        self.server = server
        self.request = request
        self.template = template
        messages, tools = chat_messages(request.messages), chat_tools(request.tools)
        try:
            prompt = template.render(messages, tools)
        except ValueError as err:  # the conversation as a whole, e.g. a tool result before any assistant turn
            raise RequestError(f"messages: {err}", param="messages") from None
        self.job = _Job(
            server,
            request.completion_request(prompt),
            default_max_tokens=server.sampler.config.max_new_tokens,  # a turn as long as in training
            max_tokens_field=request.max_tokens_field,
        )
        self.id = f"chatcmpl-{secrets.token_hex(12)}"
        self.sent_chars = [0] * (self.job.n * len(self.job.prompts))  # content already streamed, per choice

    @property
    def nbytes(self) -> int:
        return self.job.nbytes

    def start(self, flight: _Flight) -> None:
        self.job.start(flight)

    def run(self, flight: _Flight) -> dict[str, Any]:
        for _ in self.job.steps(flight):
            pass
        choices = [self._choice_payload(choice) for choice in self.job.choices]
        return {**self._envelope("chat.completion"), "choices": choices, "usage": self.job.usage()}

    def events(self, flight: _Flight) -> Iterator[dict[str, Any]]:
        """Each choice's role first, then one chunk per generated token of each choice (round robin): its new
        content, and with its last token the rest of the content, the tool calls and the finish reason."""
        for choice in self.job.choices:
            yield self._chunk(choice, {"role": "assistant", "content": ""}, ([], []), None)
        for choice, new in self.job.steps(flight):
            yield self._step_chunk(choice, new)
        if self.job.wants_usage:
            yield {**self._envelope("chat.completion.chunk"), "choices": [], "usage": self.job.usage()}

    def reply(self, choice: _Choice) -> Reply:
        """The reply of a finished choice (tool calls are read only when the request offers tools)."""
        text = self.job.visible_text(choice, final=True)
        return self.template.reply(text) if self.request.parses_tool_calls else Reply(text)

    def _choice_payload(self, choice: _Choice) -> dict[str, Any]:
        reply = self.reply(choice)
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            message["content"] = reply.content or None  # as OpenAI: a reply of tool calls only has no content
            message["tool_calls"] = [_tool_call_payload(call) for call in reply.tool_calls]
        payload = {
            "index": choice.index,
            "message": message,
            "logprobs": self._logprobs(choice.ids, choice.logprobs),
            "finish_reason": _finish_reason(choice, reply),
        }
        if self.request.return_token_ids:
            payload["token_ids"] = list(choice.ids)
        return payload

    def _step_chunk(self, choice: _Choice, new: tuple[list[int], list[float]]) -> dict[str, Any]:
        """The chunk of the token just drawn: the content it adds; after the last, the tool calls too."""
        reply = self.reply(choice) if choice.done else None
        if reply is not None:
            content = reply.content
        else:
            text = self.job.visible_text(choice, final=False)
            content = self.template.streamable(text) if self.request.parses_tool_calls else text
        delta: dict[str, Any] = {"content": content[self.sent_chars[choice.index] :]}
        self.sent_chars[choice.index] = max(self.sent_chars[choice.index], len(content))
        if reply is not None and reply.tool_calls:
            delta["tool_calls"] = [{"index": k, **_tool_call_payload(call)} for k, call in enumerate(reply.tool_calls)]
        finish = _finish_reason(choice, reply) if reply is not None else None
        return self._chunk(choice, delta, new, finish)

    def _chunk(
        self, choice: _Choice, delta: dict[str, Any], new: tuple[list[int], list[float]], finish: str | None
    ) -> dict[str, Any]:
        ids, logprobs = new
        logprobs_payload = self._logprobs(ids, logprobs) if ids else None
        payload = {"index": choice.index, "delta": delta, "logprobs": logprobs_payload, "finish_reason": finish}
        if self.request.return_token_ids:  # SGLang's extension: the ids this chunk adds
            payload["token_ids"] = list(ids)
        return {**self._envelope("chat.completion.chunk"), "choices": [payload], "usage": None}

    def _logprobs(self, ids: list[int], logprobs: list[float]) -> dict[str, Any] | None:
        """OpenAI's chat logprobs: one entry per sampled token (the stop token too, as the trainer scores it)."""
        if not self.request.logprobs:
            return None
        content = []
        for token, logprob in zip(ids, logprobs, strict=True):
            label = self.server.token_label(token, self.request.return_tokens_as_token_ids)
            content.append({"token": label, "logprob": logprob, "bytes": list(label.encode()), "top_logprobs": []})
        return {"content": content, "refusal": None}

    def _envelope(self, kind: str) -> dict[str, Any]:
        return {**self.job._envelope(), "id": self.id, "object": kind}


def _finish_reason(choice: _Choice, reply: Reply) -> str | None:
    return "tool_calls" if reply.tool_calls else choice.finish_reason


def _tool_call_payload(call: FunctionCall) -> dict[str, Any]:
    arguments = json.dumps(call.arguments, ensure_ascii=False)
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": call.name, "arguments": arguments},
    }


@dataclass
class ServerStats:
    """What the server did since it started: requests answered 200, cancelled (their client went away), answered
    503 (no room in the memory budget) and failed (500)."""

    completed: int = 0
    cancelled: int = 0
    busy: int = 0
    failed: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, outcome: Literal["completed", "cancelled", "busy", "failed"]) -> None:
        with self._lock:
            setattr(self, outcome, getattr(self, outcome) + 1)


class CompletionServer:
    """The server; ``sampler`` gives the engine, the default stop tokens and the policy version.

    tokenizer: decodes ``text`` and encodes text prompts; without one ``text`` is ``""`` (see the module docstring).
    model_path: what ``/model_info`` reports until weights are loaded from a directory (default: ``model_name``).
    chat_template: renders ``/v1/chat/completions`` requests and reads their replies (it needs ``tokenizer`` too);
        without one that route answers 400.
    limits: what a request may ask and the requests in flight may hold (``ServingLimits``; the module docstring).
    """

    def __init__(
        self,
        sampler: TorchSampler,
        host: str = "127.0.0.1",
        port: int = 0,
        model_name: str = "default",
        tokenizer: Tokenizer | None = None,
        model_path: str | None = None,
        chat_template: ChatTemplate | None = None,
        limits: ServingLimits | None = None,
    ):
        if chat_template is not None and tokenizer is None:
            raise ValueError("a chat template needs the tokenizer that decodes the replies (tokenizer=...)")
        self.sampler = sampler
        self.model_name = model_name
        self.model_path = model_path or model_name
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_ids = frozenset(tokenizer.special_tokens.values()) if tokenizer is not None else frozenset()
        self.created = int(time.time())
        self.limits = limits or ServingLimits()
        engine = sampler.engine
        self.context = self.limits.context or context_limit(engine.model.config)
        self.state_size = state_size(engine.model.config, engine.adapter.dtype)
        budget = self.limits.memory_budget or default_budget(engine.adapter.device)
        self.budget = MemoryBudget(budget, self.limits.queue_timeout_s, self.limits.max_waiting)
        self.turns = Turns()
        self.stats = ServerStats()
        self._httpd = _HTTPServer((host, port), self)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        host = self._httpd.server_address[0]
        assert isinstance(host, str)  # the name of an AF_INET socket is (host, port)
        return f"http://{host}:{self.port}"

    @property
    def in_flight(self) -> int:
        """Requests admitted and not ended yet (decoding, or sending their answer)."""
        return self.budget.holders

    def start(self) -> CompletionServer:
        """Serve from a thread of its own (``stop`` ends it within 50 ms: socketserver's default poll takes 0.5 s)."""
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve in this thread until interrupted (Ctrl-C raises ``KeyboardInterrupt`` here), then close the socket."""
        try:
            self._httpd.serve_forever()
        finally:
            self._httpd.server_close()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> CompletionServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- requests -------------------------------------------------------------------------------------------
    def complete(self, body: Any) -> dict[str, Any]:
        """The response to a completions request as one JSON object, as the HTTP route computes it (``RequestError``
        for a bad request, ``Busy`` when no room comes in the memory budget)."""
        job = self.job(body)
        with self.admitted(job, lambda: False) as flight:
            return job.run(flight)

    @contextlib.contextmanager
    def admitted(self, job: _Job | _ChatJob, client_gone: Callable[[], bool]) -> Iterator[_Flight]:
        """Hold ``job``'s bytes of the memory budget (waiting for room, or ``Busy``) and start it in a turn of the
        engine; the flight steps it."""
        with self.budget.hold(job.nbytes):
            flight = _Flight(self.turns, client_gone)
            with self.turns.turn():
                job.start(flight)
            yield flight

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "longstraw-agents"}

    @property
    def policy_version(self) -> int:
        """The version of the weights served (0 at start; set by each ``update_weights_from_disk``)."""
        return self.sampler.policy_version

    def model_info(self) -> dict[str, Any]:
        """``GET /model_info`` as SGLang answers it: the model's path and the weight version served."""
        return {
            "model_path": self.model_path,
            "tokenizer_path": None,
            "is_generation": True,
            "weight_version": str(self.policy_version),
        }

    def update_weights_from_disk(self, body: Any) -> dict[str, Any]:
        """Load a ``save_pretrained`` directory into the served model between requests and take its version (the
        request's ``weight_version``, else one more); ``RequestError`` (400) leaves weights and version as they were.
        It waits in line with the requests until those in flight have ended (``Busy`` after the queue timeout)."""
        request = _update_request(body)
        if request.load_format not in (None, "auto", "safetensors"):
            raise RequestError(f"load_format: only safetensors directories load, not {request.load_format!r}")
        version = self.policy_version + 1
        if request.weight_version is not None:
            number = weight_version_number(request.weight_version)
            if number is None:
                raise RequestError(
                    f"weight_version: this server numbers its versions; send a number as a string, not "
                    f"{request.weight_version!r} (or leave it out to count up by one)",
                    param="weight_version",
                )
            version = number
        with self.budget.exclusive(), self.turns.turn():  # never while a request samples
            try:
                load_weights(self.sampler.engine.model, request.model_path)
            except (FileNotFoundError, WeightsMismatch) as err:
                raise RequestError(str(err), param="model_path") from None
            self.sampler.policy_version = version
            self.model_path = request.model_path
        return {
            "success": True,
            "message": f"Succeeded to update model weights from {request.model_path} (weight version {version})",
            "num_paused_requests": 0,
            "weight_version": str(version),
        }

    def job(self, body: Any) -> _Job:
        """A checked completions request, its prompts as ids and its limits checked (no engine work yet)."""
        request = parse_request(body)
        self._check_model(request.model)
        return _Job(self, request)

    def chat_job(self, body: Any) -> _ChatJob:
        """A checked chat request with its prompt rendered and its limits checked (no engine work yet)."""
        if self.chat_template is None:
            raise RequestError(
                "this server has no chat template: use /v1/completions, or start it with one "
                "(CompletionServer(..., chat_template=...); `longstraw serve` does)"
            )
        request = parse_chat_request(body)
        self._check_model(request.model)
        return _ChatJob(self, request, self.chat_template)

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise RequestError(
                f"the model {model!r} does not exist; this server serves {self.model_name!r}", 404, "model"
            )

    def max_tokens(self, asked: int | None, prompt_tokens: int, default: int, field_name: str) -> int:
        """A request's completion length: ``asked`` when the context (after its longest prompt, ``prompt_tokens``)
        and the server's limit allow it, else a 400 naming the limit; none asked: ``default``, lowered to both."""
        room = None if self.context is None else self.context - prompt_tokens
        if room is not None and room < 1:
            raise RequestError(
                f"prompt: this model's context is {self.context:,} tokens and the prompt holds {prompt_tokens:,}: "
                "no room is left for a completion",
                param="prompt",
                code="context_length_exceeded",
            )
        cap = self.limits.max_tokens
        if asked is None:
            return min(default, cap, room if room is not None else default)
        if room is not None and asked > room:
            raise RequestError(
                f"{field_name}: this model's context is {self.context:,} tokens and the prompt holds "
                f"{prompt_tokens:,}, so {field_name} can be at most {room:,}, not {asked:,}",
                param=field_name,
                code="context_length_exceeded",
            )
        if asked > cap:
            raise RequestError(
                f"{field_name}: {asked:,} is more than this server allows ({cap:,}: longstraw serve --max-tokens)",
                param=field_name,
            )
        return asked

    def request_bytes(self, prompts: list[list[int]], n: int, max_tokens: int, field_name: str) -> int:
        """The most memory a request can hold (``serving_limits.request_bytes``); a 400 when that is more than the
        whole memory budget, so that it could never run."""
        nbytes = request_bytes(self.state_size, [len(p) for p in prompts], n, max_tokens, self._vocab_size)
        if nbytes > self.budget.total_bytes:
            raise RequestError(
                f"{field_name}: {n * len(prompts)} choices of up to {max_tokens:,} tokens may hold "
                f"{nbytes / 2**30:.2f} GiB, more than this server's whole memory budget of "
                f"{self.budget.total_bytes / 2**30:.2f} GiB (longstraw serve --memory-budget): lower {field_name} or n",
                param=field_name,
            )
        return nbytes

    def request_sampler(self, request: CompletionRequest, max_tokens: int) -> TorchSampler:
        """A sampler for one request: its sampling fields (null: the defaults), stop tokens and seed."""
        try:
            config = SamplingConfig(
                temperature=1.0 if request.temperature is None else request.temperature,
                top_p=1.0 if request.top_p is None else request.top_p,
                max_new_tokens=max_tokens,
                seed=secrets.randbits(31) if request.seed is None else request.seed,
            )
        except ValidationError as err:
            raise RequestError(_validation_message(err)) from None
        stop = request.stop_token_ids or sorted(self.sampler.stop_token_ids)
        if not all(0 <= t < self._vocab_size for t in stop):
            raise RequestError(f"stop_token_ids must be in [0, {self._vocab_size})", param="stop_token_ids")
        sampler = self.sampler
        return TorchSampler(sampler.engine, stop, config, policy_version=sampler.policy_version, graphs=sampler.graphs)

    def prompt_ids(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[list[int]]:
        """The request's prompts as token ids (a text prompt needs the tokenizer)."""
        batch: Sequence[str | list[int]]
        if isinstance(prompt, str):
            batch = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            batch = [cast(list[int], prompt)]  # one prompt of ids
        else:
            batch = cast(Sequence[str | list[int]], prompt)  # a batch of prompts
        if not batch:
            raise RequestError("prompt is empty", param="prompt")
        return [self._ids(p, k) for k, p in enumerate(batch)]

    def _ids(self, prompt: str | list[int], index: int) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(
                    "text prompts need a tokenizer (CompletionServer(..., tokenizer=...)); send token ids",
                    param="prompt",
                )
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise RequestError(f"prompt {index} is empty: give at least one token", param="prompt")
        if not all(0 <= t < self._vocab_size for t in ids):
            raise RequestError(f"prompt {index}: token ids must be in [0, {self._vocab_size})", param="prompt")
        return ids

    @property
    def _vocab_size(self) -> int:
        return self.sampler.engine.adapter.vocab_size

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None and ids else ""

    def token_label(self, token: int, as_id: bool | None) -> str:
        """A logprob token: ``"token_id:N"`` (vLLM's ``return_tokens_as_token_ids``, or without a tokenizer), else
        the token's text."""
        if as_id or self.tokenizer is None:
            return f"token_id:{token}"
        return self.tokenizer.decode([token])


class _HTTPServer(ThreadingHTTPServer):
    """The HTTP side of a ``CompletionServer``: a thread per connection (daemon threads: stopping the server never
    waits for a request still decoding)."""

    daemon_threads = True
    request_queue_size = 1024  # connections not accepted yet (socketserver's 5 resets a burst of clients)

    def __init__(self, address: tuple[str, int], completions: CompletionServer):
        self.completions = completions
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    timeout = CLIENT_TIMEOUT_S

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        server = self.server.completions
        path = self.path.rstrip("/")
        if path in ("/model_info", "/get_model_info"):
            self._send(200, server.model_info())
        elif path == "/get_weight_version":
            self._send(200, {"weight_version": str(server.policy_version)})
        elif path == "/update_weights_from_disk":  # a POST route, as a web framework answers a GET of it
            self._send(405, RequestError("use POST /update_weights_from_disk", 405).payload())
        elif path == "/v1/models":
            self._send(200, server.models())
        elif path == f"/v1/models/{server.model_name}":
            self._send(200, server.model_card())
        elif path.startswith("/v1/models/"):
            self._send(404, RequestError(f"the model {path[11:]!r} does not exist", 404).payload())
        else:
            self._send(404, RequestError(f"no route GET {self.path}", 404).payload())

    def do_POST(self) -> None:  # noqa: N802
        server = self.server.completions
        route = self.path.rstrip("/")
        try:
            body = self._json_body()  # read whole first: an answer sent over an unread body can be lost to a reset
        except RequestError as err:
            self._send(err.status, err.payload())
            return
        except OSError:  # the client stalled (CLIENT_TIMEOUT_S) or left while sending its body
            self.close_connection = True
            return
        if route == "/update_weights_from_disk":
            self._update_weights(body)
            return
        routes: dict[str, Callable[[Any], _Job | _ChatJob]] = {
            "/v1/completions": server.job,
            "/v1/chat/completions": server.chat_job,
        }
        make_job = routes.get(route)
        if make_job is None:
            self._send(404, RequestError(f"no route POST {self.path}", 404).payload())
            return
        self._answer(lambda: make_job(body))

    def _answer(self, make_job: Callable[[], _Job | _ChatJob]) -> None:
        """Check the request, admit it, decode it and answer; whatever happens, one answer and the server alive."""
        server = self.server.completions
        try:
            job = make_job()  # checked: its prompts, its limits, its bytes
        except ValueError as err:  # a RequestError, or a prompt the tokenizer refuses
            error = err if isinstance(err, RequestError) else RequestError(str(err))
            self._send(error.status, error.payload())
            return
        try:
            with server.admitted(job, self._client_gone) as flight:
                if job.request.stream:
                    self._send_events(job.events(flight))
                else:
                    self._send(200, job.run(flight))
                    server.stats.count("completed")
        except RequestError as err:
            self._send(err.status, err.payload())
        except Busy as err:
            server.stats.count("busy")
            self._send(503, error_payload(f"the server is busy: {err}", 503), {"Retry-After": str(RETRY_AFTER_S)})
        except _Cancelled:
            server.stats.count("cancelled")
        except Exception as err:  # noqa: BLE001 - one request's failure is answered, never the server's end
            server.stats.count("failed")
            self._send(500, _failure_payload(err))

    def _update_weights(self, body: Any) -> None:
        """SGLang's answer shape: ``success`` and ``message``, HTTP 400 on a bad request."""
        try:
            self._send(200, self.server.completions.update_weights_from_disk(body))
        except RequestError as err:
            self._send(err.status, {"success": False, "message": str(err), "num_paused_requests": 0})
        except Busy as err:
            message = f"the requests in flight did not end in time: {err}"
            answer = {"success": False, "message": message, "num_paused_requests": 0}
            self._send(503, answer, {"Retry-After": str(RETRY_AFTER_S)})
        except Exception as err:  # noqa: BLE001 - a failed load is answered, the server goes on
            self._send(500, {"success": False, "message": _failure_payload(err)["error"]["message"]})

    def _json_body(self) -> Any:
        """The request's JSON body; a ``RequestError`` for a missing or oversized length, another content type
        (415) or text that is not JSON."""
        length_header = self.headers.get("Content-Length")
        try:
            length = int(length_header) if length_header is not None else 0
        except ValueError:
            raise RequestError(f"Content-Length is not a number: {length_header!r}") from None
        if length < 0:
            raise RequestError(f"Content-Length is negative: {length}")
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            raise RequestError(f"the body's {length:,} bytes are more than {MAX_BODY_BYTES:,}", 413)
        raw = self.rfile.read(length)
        content_type = self.headers.get("Content-Type")
        media = (content_type or "").split(";", 1)[0].strip().lower()
        if media != "application/json":
            got = f"got {content_type!r}" if content_type else "got none"
            raise RequestError(f"Content-Type must be application/json, {got}", 415)
        try:
            return json.loads(raw or b"null")
        except ValueError as err:  # not JSON, or not UTF-8
            raise RequestError(f"the body is not JSON: {err}") from None

    def _client_gone(self) -> bool:
        """Whether the client has closed its side of the connection (it waits for the answer without sending, so a
        readable socket with nothing to read is a closed one)."""
        try:
            poller = select.poll()  # (select.select fails on descriptors past 1023: many connections)
            poller.register(self.connection, select.POLLIN)
            if not poller.poll(0):
                return False
            return not self.connection.recv(1, socket.MSG_PEEK)
        except OSError:  # reset
            return True

    def _send(self, status: int, payload: dict[str, Any], headers: Mapping[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client went away before its answer
            self.close_connection = True

    def _send_events(self, events: Iterator[dict[str, Any]]) -> None:
        """Server-sent events; the body ends when the connection closes (HTTP/1.0, no length). A client that goes
        away cancels the request (``_Cancelled``); a failure after the first event is sent as an ``error`` event."""
        server = self.server.completions
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        try:
            for event in events:
                self._write_event(event)
            self.wfile.write(b"data: [DONE]\n\n")
            server.stats.count("completed")
        except _Cancelled:
            raise
        except OSError:  # the client went away while an event was written: stop generating
            raise _Cancelled from None
        except Exception as err:  # noqa: BLE001 - the stream has begun: the failure is its last event
            server.stats.count("failed")
            with contextlib.suppress(OSError):
                self._write_event(_failure_payload(err))
                self.wfile.write(b"data: [DONE]\n\n")

    def _write_event(self, event: dict[str, Any]) -> None:
        self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        self.wfile.flush()

    def log_message(self, *args: Any) -> None:  # keep test output clean
        pass


def _failure_payload(err: Exception) -> dict[str, Any]:
    """A 500's body for an exception in a request: out of memory said so (the request's memory is freed as it
    ends), anything else logged with its traceback."""
    if _out_of_memory(err):
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the request's tensors are gone: give their blocks back for the next one
        message = (
            f"out of memory while serving the request ({err}); lower max_tokens or n, or the server's memory budget "
            "(longstraw serve --memory-budget)"
        )
    else:
        log.exception("a request failed")
        message = f"the server failed to complete the request: {type(err).__name__}: {err}"
    return error_payload(message, 500)


def _out_of_memory(err: Exception) -> bool:
    """An allocation that failed: CUDA's ``OutOfMemoryError``, Python's ``MemoryError``, or the CPU allocator's
    ``RuntimeError`` ("DefaultCPUAllocator: can't allocate memory")."""
    if isinstance(err, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(err, RuntimeError) and "allocat" in str(err).lower()


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
        raise RequestError(_validation_message(err), param=str(first["loc"][0]) if first["loc"] else None) from None
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
        raise RequestError(_validation_message(err, prefix=f"{where}."), param=field_name) from None


def _update_request(body: Any) -> UpdateWeightsRequest:
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return UpdateWeightsRequest.model_validate(body)
    except ValidationError as err:
        raise RequestError(_validation_message(err)) from None


def _validation_message(err: ValidationError, prefix: str = "") -> str:
    """Pydantic's errors as one line per field (a union reports each branch; the field is named once), each field
    named after ``prefix``."""
    seen: dict[str, str] = {}
    for error in err.errors():
        name = str(error["loc"][0]) if error["loc"] else "request"
        unknown = error["type"] == "extra_forbidden"
        seen.setdefault(name, "unknown field (the API has no such field)" if unknown else error["msg"])
    return "; ".join(f"{prefix}{name}: {message}" for name, message in seen.items())
