"""``CompletionServer``: one model served over the OpenAI API — its requests checked against the model's context,
the server's limits and its memory budget, each sampled with its own fields and seed, and its weights reloaded
between requests (SGLang's ``/update_weights_from_disk``). The HTTP side is ``http_handler``'s."""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

from pydantic import ValidationError

from longstraw_agents.models import context_limit, state_size
from longstraw_agents.sampler import SamplingConfig, weight_version_number
from longstraw_agents.serving.http_handler import CompletionHTTPServer, ServerStats
from longstraw_agents.serving.jobs import ChatJob, Flight, Job
from longstraw_agents.serving.limits import MemoryBudget, ServingLimits, Turns, default_budget, request_bytes
from longstraw_agents.serving.protocol import (
    ChatTemplate,
    CompletionRequest,
    RequestError,
    parse_chat_request,
    parse_request,
    parse_update_request,
    validation_message,
)
from longstraw_agents.tokenizer import Tokenizer
from longstraw_agents.torch_sampler import TorchSampler
from longstraw_agents.weight_sync import WeightsMismatch, load_weights


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
        self._httpd = CompletionHTTPServer((host, port), self)
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
    def admitted(self, job: Job | ChatJob, client_gone: Callable[[], bool]) -> Iterator[Flight]:
        """Hold ``job``'s bytes of the memory budget (waiting for room, or ``Busy``) and start it in a turn of the
        engine; the flight steps it."""
        with self.budget.hold(job.nbytes):
            flight = Flight(self.turns, client_gone)
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
        request = parse_update_request(body)
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

    def job(self, body: Any) -> Job:
        """A checked completions request, its prompts as ids and its limits checked (no engine work yet)."""
        request = parse_request(body)
        self._check_model(request.model)
        return Job(self, request)

    def chat_job(self, body: Any) -> ChatJob:
        """A checked chat request with its prompt rendered and its limits checked (no engine work yet)."""
        if self.chat_template is None:
            raise RequestError(
                "this server has no chat template: use /v1/completions, or start it with one "
                "(CompletionServer(..., chat_template=...); `longstraw serve` does)"
            )
        request = parse_chat_request(body)
        self._check_model(request.model)
        return ChatJob(self, request, self.chat_template)

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
        """The most memory a request can hold (``limits.request_bytes``); a 400 when that is more than the
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
            raise RequestError(validation_message(err)) from None
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
