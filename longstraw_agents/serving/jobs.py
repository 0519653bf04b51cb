"""A request's work: ``Job`` (a completions request) and ``ChatJob`` (a chat request, completed by a ``Job``) hold a
checked request with its prompts as ids and its limits known; started in a turn of the server's engine, they decode
their choices together, a turn per step (``Flight``), into one response or a stream of chunks in OpenAI's shapes."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from longstraw_agents.serving.limits import Turns
from longstraw_agents.serving.protocol import (
    DEFAULT_MAX_TOKENS,
    MAX_CHOICES,
    ChatCompletionRequest,
    ChatTemplate,
    CompletionRequest,
    FunctionCall,
    Reply,
    RequestError,
    chat_messages,
    chat_tools,
)
from longstraw_agents.torch_sampler import BatchDecoding, TorchSampler


class JobServer(Protocol):
    """What a job asks of the server that runs it (``CompletionServer`` is one): its request checked against the
    served model and the server's limits, a sampler of its own, and its tokens as text."""

    @property
    def model_name(self) -> str: ...

    @property
    def sampler(self) -> TorchSampler:
        """The served sampler (a chat turn's default length is its ``max_new_tokens``)."""
        ...

    @property
    def special_ids(self) -> frozenset[int]: ...

    def prompt_ids(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[list[int]]: ...

    def max_tokens(self, asked: int | None, prompt_tokens: int, default: int, field_name: str) -> int: ...

    def request_bytes(self, prompts: list[list[int]], n: int, max_tokens: int, field_name: str) -> int: ...

    def request_sampler(self, request: CompletionRequest, max_tokens: int) -> TorchSampler: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_label(self, token: int, as_id: bool | None) -> str: ...


class Cancelled(Exception):
    """The request's client has gone: its decoding stops."""


@dataclass(frozen=True)
class Flight:
    """How a request in flight runs: a turn of the server's engine per step, and its client still there."""

    turns: Turns
    client_gone: Callable[[], bool]

    def check(self) -> None:
        if self.client_gone():
            raise Cancelled

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


class Job:
    """A checked request, its prompts as ids and its limits known (nothing computed yet): ``start`` forks the prompts
    (in the engine's turns), then ``run`` (one response) or ``events`` (stream chunks) decode its choices together, a
    turn of the engine per step.

    default_max_tokens: the length when the request sets none (lowered to the limits), and ``max_tokens_field`` the
    field a limit names."""

    def __init__(
        self,
        server: JobServer,
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

    def start(self, flight: Flight) -> None:
        """Capture and fork the prompts (call in a turn of the engine; a long prompt passes it between chunks)."""
        handles = [h for ids in self.prompts for h in self.sampler.fork_pausing(ids, self.n, flight.pause)]
        # (choice p·n + k is member p·n + k of the request's sampler: its own seed)
        self.choices = [_Choice(index) for index in range(len(handles))]
        self.decoding = BatchDecoding(self.sampler, handles, self.max_tokens, keep_states=False)

    def run(self, flight: Flight) -> dict[str, Any]:
        for _ in self.steps(flight):
            pass
        choices = [self._choice_payload(c, c.ids, c.logprobs, self.text(c, final=True)) for c in self.choices]
        return {**self._envelope(), "choices": choices, "usage": self.usage()}

    def events(self, flight: Flight) -> Iterator[dict[str, Any]]:
        """One chunk per generated token of each choice (round robin), then a chunk with each finish reason."""
        for choice, new in self.steps(flight):
            yield self._chunk(choice, new)
        if self.wants_usage:
            yield {**self._envelope(), "choices": [], "usage": self.usage()}

    def steps(self, flight: Flight) -> Iterator[tuple[_Choice, tuple[list[int], list[float]]]]:
        """Each choice's tokens as they are drawn, a step of all the choices still going per turn of the engine (so
        round robin): the choice and its new ids and logprobs (a choice is ``done`` after its last). Stops, with
        ``Cancelled``, when the client has gone."""
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


class ChatJob:
    """A checked chat request: its messages rendered to one prompt and completed by a ``Job``; ``run`` (one
    response) or ``events`` (stream chunks) in the chat completions shape."""

    def __init__(self, server: JobServer, request: ChatCompletionRequest, template: ChatTemplate):
        self.server = server
        self.request = request
        self.template = template
        messages, tools = chat_messages(request.messages), chat_tools(request.tools)
        try:
            prompt = template.render(messages, tools)
        except ValueError as err:  # the conversation as a whole, e.g. a tool result before any assistant turn
            raise RequestError(f"messages: {err}", param="messages") from None
        self.job = Job(
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

    def start(self, flight: Flight) -> None:
        self.job.start(flight)

    def run(self, flight: Flight) -> dict[str, Any]:
        for _ in self.job.steps(flight):
            pass
        choices = [self._choice_payload(choice) for choice in self.job.choices]
        return {**self._envelope("chat.completion"), "choices": choices, "usage": self.job.usage()}

    def events(self, flight: Flight) -> Iterator[dict[str, Any]]:
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
