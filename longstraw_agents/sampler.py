"""Samplers: what the rollout loop needs of a policy, and a policy served over HTTP.

``Sampler`` is the small interface (``fork`` / ``generate`` / ``append``) the rollout loop drives; this module has no
torch dependency, so rollouts can run in a process without a model. ``OpenAISampler`` speaks to an
OpenAI-compatible completions server (vLLM, SGLang) with token-id prompts; ``TorchSampler``
(``longstraw_agents.torch_sampler``) runs the policy in-process with the engine.

Served policy versions: SGLang (and ``CompletionServer``) report the version of the weights they serve, a string, as
``metadata.weight_version`` in every completion and from ``GET /model_info`` (older SGLang: ``GET
/get_weight_version``); the trainer sets it to its policy version when it pushes weights (``weight_sync``). An
``OpenAISampler``'s ``policy_version`` follows the versions its responses report, so an episode records the version that
was served when it started and each turn (``Generation.policy_version``) the version that sampled it; with
``pinned_version`` a response of another version is a ``SamplerError`` (a synchronous rollout is one policy's). A server
that reports none (vLLM) leaves ``policy_version`` as given.

Behaviour logprobs are the log-probabilities of the sampled tokens under the temperature-scaled distribution
(before top-p truncation); train with ``LossConfig(temperature=...)`` equal to the sampling temperature.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

FinishReason = Literal["stop", "length"]


class SamplingConfig(BaseModel):
    """How tokens are drawn."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(default=1.0, ge=0.0, description="0 means greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="nucleus sampling mass")
    max_new_tokens: int = Field(default=256, ge=1, description="tokens per assistant turn at most")
    seed: int = Field(default=0, description="seed of the sampler's random generator (base of the per-request seeds)")


@dataclass
class Generation:
    """One assistant turn: the sampled ids (incl. the stop token when one was sampled), their logprobs and the
    version of the weights that sampled them (None: unknown)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int | None = None


class Sampler(Protocol):
    """What the rollout loop needs of a policy."""

    @property
    def policy_version(self) -> int:
        """The version of the weights it samples with (read only: the rollout loop records it)."""
        ...

    def fork(self, prompt_ids: Sequence[int], n: int) -> list[Any]: ...

    def generate(self, handle: Any, max_new_tokens: int | None = None) -> Generation: ...

    def append(self, handle: Any, ids: Sequence[int]) -> None: ...

    def replace(self, handle: Any, ids: Sequence[int], kept: int) -> None:
        """The member's context is now ``ids`` (the environment edited it); its first ``kept`` tokens are what the
        context held before."""
        ...

    def num_tokens(self, handle: Any) -> int: ...


class SamplerError(RuntimeError):
    """A sampler could not produce a generation (server unreachable after retries, malformed response...)."""


@dataclass
class OpenAIHandle:
    token_ids: list[int]


class OpenAISampler:
    """Sampling from an OpenAI-compatible completions endpoint (vLLM, SGLang) with token-id prompts.

    Request: ``POST {base_url}/v1/completions`` with ``prompt`` = token ids, ``logprobs=1``,
    ``return_token_ids=true`` (SGLang), ``return_tokens_as_token_ids=true`` (vLLM), ``stop_token_ids``,
    ``skip_special_tokens=false``. The sampled ids are the choice's ``token_ids`` (SGLang) or else read from
    ``choices[0].logprobs.tokens`` (``"token_id:123"``, vLLM); ``token_logprobs`` are the behaviour logprobs.
    ``versioned``: a response that does not report the weight version that sampled it is a ``SamplerError``
    (asynchronous GRPO attributes every turn to a version).
    Transient failures (connection errors, timeouts, HTTP 429/5xx) are retried with exponential backoff; then a
    ``SamplerError`` says what failed. Point it at vLLM with
    ``vllm serve MODEL --port 8000`` and ``OpenAISampler("http://127.0.0.1:8000", model="MODEL", ...)``.
    """

    RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})

    def __init__(
        self,
        base_url: str,
        stop_token_ids: Sequence[int],
        config: SamplingConfig | None = None,
        *,
        model: str = "default",
        policy_version: int = 0,
        timeout_s: float = 60.0,
        max_retries: int = 4,
        backoff_s: float = 0.5,
        api_key: str | None = None,
        client: Any | None = None,
        max_concurrency: int = 64,
        pinned_version: int | None = None,
        versioned: bool = False,
    ):
        import httpx

        self.base_url = base_url.rstrip("/")
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self.config = config or SamplingConfig()
        self.model = model
        self.policy_version = policy_version
        self.served_versions: set[int] = set()  # the weight versions the responses reported
        self.pinned_version = pinned_version
        self.versioned = versioned  # every response must say which weights sampled it
        self.max_retries, self.backoff_s = max_retries, backoff_s
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
        self.max_concurrency = max_concurrency
        self.requests = 0  # completions requested so far: each gets its own seed
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = client or httpx.Client(timeout=timeout_s, headers=headers)

    def fork(self, prompt_ids: Sequence[int], n: int) -> list[OpenAIHandle]:
        if len(prompt_ids) == 0:
            raise ValueError("empty prompt")
        return [OpenAIHandle(token_ids=[int(t) for t in prompt_ids]) for _ in range(n)]

    def generate(self, handle: OpenAIHandle, max_new_tokens: int | None = None) -> Generation:
        generation = self._parse(self._post("/v1/completions", self._body(handle, max_new_tokens)))
        handle.token_ids.extend(generation.token_ids)
        return generation

    def generate_batch(
        self, handles: Sequence[OpenAIHandle], max_new_tokens: Sequence[int | None] | int | None = None
    ) -> list[Generation]:
        """A turn of every member, as up to ``max_concurrency`` requests in flight at once (a server batches
        concurrent requests; one at a time it would idle). Each member gets the seed ``generate`` would give it
        called in the same order, so batched and one-by-one sampling ask for the same draws."""
        limits = max_new_tokens if isinstance(max_new_tokens, Sequence) else [max_new_tokens] * len(handles)
        if len(limits) != len(handles):
            raise ValueError(f"{len(handles)} handles but {len(limits)} token limits")
        bodies = [self._body(handle, limit) for handle, limit in zip(handles, limits, strict=True)]
        if len(bodies) <= 1:
            payloads = [self._post("/v1/completions", body) for body in bodies]
        else:
            with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(bodies))) as pool:
                payloads = list(pool.map(lambda body: self._post("/v1/completions", body), bodies))
        generations = [self._parse(payload) for payload in payloads]
        for handle, generation in zip(handles, generations, strict=True):
            handle.token_ids.extend(generation.token_ids)
        return generations

    def _body(self, handle: OpenAIHandle, max_new_tokens: int | None) -> dict[str, Any]:
        """The completion request of ``handle``'s next turn (with the next request seed)."""
        return {
            "model": self.model,
            "prompt": list(handle.token_ids),
            "max_tokens": max_new_tokens or self.config.max_new_tokens,
            "temperature": self.config.temperature,
            "top_p": self.config.top_p,
            "seed": self._next_seed(),
            "logprobs": 1,
            "stop_token_ids": self.stop_token_ids,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
        }

    def append(self, handle: OpenAIHandle, ids: Sequence[int]) -> None:
        handle.token_ids.extend(int(i) for i in ids)

    def replace(self, handle: OpenAIHandle, ids: Sequence[int], kept: int) -> None:
        """The next request sends the edited context ``ids`` whole (the server's prefix cache finds the ``kept``
        tokens it still holds)."""
        check_kept(handle.token_ids, ids, kept)
        handle.token_ids = [int(i) for i in ids]

    def _next_seed(self) -> int:
        """A distinct seed per request, derived from (config seed, request number): with one seed for all, the G
        members of a group (same prompt) would come back identical and their advantages would all be zero; derived
        this way, a run with the same base seed still draws the same completions."""
        index, self.requests = self.requests, self.requests + 1
        return request_seed(self.config.seed, index)

    def num_tokens(self, handle: OpenAIHandle) -> int:
        return len(handle.token_ids)

    def close(self) -> None:
        self.client.close()

    def served_version(self) -> int | None:
        """The weight version the server reports now (``GET /model_info``, else ``GET /get_weight_version``); None
        when it reports none or one that is not a number (SGLang's ``"default"`` before any update)."""
        return served_weight_version(self.client, self.base_url)

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        import httpx

        url = self.base_url + path
        last_error = "no attempt made"
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                response = self.client.post(url, json=body)
            except httpx.TransportError as err:  # connection refused, reset, timeouts
                last_error = f"{type(err).__name__}: {err}"
                continue
            if response.status_code in self.RETRY_STATUS:
                last_error = f"HTTP {response.status_code}: {response.text[:200]}"
                continue
            if response.status_code != 200:
                raise SamplerError(f"{url} answered HTTP {response.status_code}: {response.text[:500]}")
            try:
                return response.json()
            except ValueError as err:
                raise SamplerError(f"{url} returned invalid JSON: {err}") from None
        raise SamplerError(f"{url} failed after {self.max_retries + 1} attempts; last error: {last_error}")

    def _parse(self, payload: dict[str, Any]) -> Generation:
        try:
            choice = payload["choices"][0]
            logprobs = choice["logprobs"]
            listed = choice.get("token_ids")  # SGLang's return_token_ids: the ids themselves, stop token included
            ids = [int(t) for t in listed] if isinstance(listed, list) else [_token_id(t) for t in logprobs["tokens"]]
            values = [float(v) for v in logprobs["token_logprobs"]]
            finish: FinishReason = "stop" if choice.get("finish_reason") == "stop" else "length"
        except (KeyError, IndexError, TypeError, ValueError) as err:
            raise SamplerError(f"malformed completions response ({err!r}): {str(payload)[:300]}") from None
        if len(ids) != len(values):
            raise SamplerError(f"{len(ids)} tokens but {len(values)} logprobs in the response")
        version = self._follow_version(payload.get("metadata"))
        return Generation(ids, values, finish, self.policy_version if version is None else version)

    def _follow_version(self, metadata: Any) -> int | None:
        """Take the weight version a response reports (SGLang's ``metadata.weight_version``) as the policy version;
        returns it (None: the response reports none)."""
        version = weight_version_number(metadata.get("weight_version")) if isinstance(metadata, dict) else None
        if version is None:
            if self.versioned:
                raise SamplerError(
                    f"{self.base_url} says with no completion which weights sampled it (metadata.weight_version, a "
                    "number): asynchronous GRPO (max_staleness) records each turn's version, so it needs a server that "
                    "reports it (SGLang, CompletionServer)"
                )
            return None
        self.served_versions.add(version)
        if self.pinned_version is not None and version != self.pinned_version:
            raise SamplerError(
                f"{self.base_url} answered with weight version {version}, not {self.pinned_version}: its weights "
                "changed during the rollout (something else loaded weights into the server)"
            )
        self.policy_version = version
        return version


def check_kept(old: Sequence[int], new: Sequence[int], kept: int) -> None:
    """An edit keeps the first ``kept`` tokens of the context: refuse a replacement that says otherwise."""
    if not 0 <= kept <= min(len(old), len(new)) or list(old[:kept]) != list(new[:kept]):
        raise ValueError(f"the edited context does not start with the {kept} tokens it is said to keep")


def weight_version_number(value: Any) -> int | None:
    """A served weight version as the policy version it names: ``"3"`` or 3 is 3; anything else (SGLang's
    ``"default"``, a tag) is None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


def served_weight_version(client: Any, base_url: str) -> int | None:
    """The weight version a server reports: ``GET /model_info`` (SGLang, ``CompletionServer``), else the older
    ``GET /get_weight_version``; None when neither answers with a numeric ``weight_version`` (vLLM has none).
    Transport errors propagate (``httpx.TransportError``): the caller says what was unreachable."""
    base = base_url.rstrip("/")
    for path in ("/model_info", "/get_weight_version"):
        response = client.get(base + path)
        if response.status_code == 200:
            try:
                return weight_version_number(response.json().get("weight_version"))
            except (ValueError, AttributeError):  # not JSON, or not an object
                return None
    return None


def request_seed(base: int, index: int) -> int:
    """The seed of request ``index`` of a sampler seeded with ``base``: well mixed (nearby bases and indices give
    unrelated seeds) and in [0, 2**31) so that every server accepts it."""
    state = np.random.SeedSequence([base % 2**64, index]).generate_state(1, dtype=np.uint32)
    return int(state[0]) >> 1


def _token_id(token: Any) -> int:
    """vLLM's ``return_tokens_as_token_ids`` gives ``"token_id:123"``; plain ints are accepted too."""
    if isinstance(token, int):
        return token
    if isinstance(token, str) and token.startswith("token_id:"):
        return int(token.split(":", 1)[1])
    raise ValueError(f"cannot read a token id from {token!r} (is return_tokens_as_token_ids supported?)")
