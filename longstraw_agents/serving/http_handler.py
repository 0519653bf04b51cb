"""The HTTP side of a ``CompletionServer``: its routes, each request's JSON body read whole and checked (its type,
its length), answers as JSON or as server-sent events, a client that has gone seen between steps, and whatever goes
wrong in a request answered (a 400 naming the field, a 503 with ``Retry-After``, a 500 with a JSON body; in a
stream that has begun, an ``error`` event) without taking the server down, and each answer tallied (``ServerStats``).
It calls the server through ``Completions``, what it needs of one."""

from __future__ import annotations

import contextlib
import json
import logging
import select
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal, Protocol

import torch

from longstraw_agents.serving.jobs import Cancelled, ChatJob, Flight, Job
from longstraw_agents.serving.limits import RETRY_AFTER_S, Busy
from longstraw_agents.serving.protocol import RequestError, error_payload

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20
"""A request body at most: a million-token prompt is about 8 MB of JSON ids."""
CLIENT_TIMEOUT_S = 300
"""How long a connection may stall the server's reads and writes (a body announced but not sent, a stream its client
stopped reading) before the request is dropped; decoding itself is not bounded by it."""


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


class Completions(Protocol):
    """What the HTTP side asks of the server it answers for (``CompletionServer`` is one): a checked job per request
    and its admission, the served model's cards, weight updates, and the tally of what was answered."""

    @property
    def model_name(self) -> str: ...

    @property
    def policy_version(self) -> int: ...

    @property
    def stats(self) -> ServerStats: ...

    def job(self, body: Any) -> Job: ...

    def chat_job(self, body: Any) -> ChatJob: ...

    def admitted(
        self, job: Job | ChatJob, client_gone: Callable[[], bool]
    ) -> contextlib.AbstractContextManager[Flight]: ...

    def models(self) -> dict[str, Any]: ...

    def model_card(self) -> dict[str, Any]: ...

    def model_info(self) -> dict[str, Any]: ...

    def update_weights_from_disk(self, body: Any) -> dict[str, Any]: ...


class CompletionHTTPServer(ThreadingHTTPServer):
    """The HTTP side of a ``CompletionServer``: a thread per connection (daemon threads: stopping the server never
    waits for a request still decoding)."""

    daemon_threads = True
    request_queue_size = 1024  # connections not accepted yet (socketserver's 5 resets a burst of clients)

    def __init__(self, address: tuple[str, int], completions: Completions):
        self.completions = completions
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: CompletionHTTPServer
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
        routes: dict[str, Callable[[Any], Job | ChatJob]] = {
            "/v1/completions": server.job,
            "/v1/chat/completions": server.chat_job,
        }
        make_job = routes.get(route)
        if make_job is None:
            self._send(404, RequestError(f"no route POST {self.path}", 404).payload())
            return
        self._answer(lambda: make_job(body))

    def _answer(self, make_job: Callable[[], Job | ChatJob]) -> None:
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
        except Cancelled:
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
        away cancels the request (``Cancelled``); a failure after the first event is sent as an ``error`` event."""
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
        except Cancelled:
            raise
        except OSError:  # the client went away while an event was written: stop generating
            raise Cancelled from None
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
