"""Samplers: what the rollout loop needs of a policy, and a policy served over HTTP.

``Sampler`` is the small interface (``fork`` / ``generate`` / ``append``) the rollout loop drives; this module has no
torch dependency, so rollouts can run in a process without a model. ``OpenAISampler`` speaks to an
OpenAI-compatible completions server (vLLM, SGLang) with token-id prompts; ``TorchSampler``
(``longstraw_agents.torch_sampler``) runs the policy in-process with the engine.

Behaviour logprobs are the log-probabilities of the sampled tokens under the temperature-scaled distribution
(before top-p truncation); train with ``LossConfig(temperature=...)`` equal to the sampling temperature.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
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
    """One assistant turn: the sampled ids (incl. the stop token when one was sampled) and their logprobs."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason


class Sampler(Protocol):
    """What the rollout loop needs of a policy."""

    policy_version: int

    def fork(self, prompt_ids: Sequence[int], n: int) -> list[Any]: ...

    def generate(self, handle: Any, max_new_tokens: int | None = None) -> Generation: ...

    def append(self, handle: Any, ids: Sequence[int]) -> None: ...

    def num_tokens(self, handle: Any) -> int: ...


class SamplerError(RuntimeError):
    """A sampler could not produce a generation (server unreachable after retries, malformed response...)."""


@dataclass
class OpenAIHandle:
    token_ids: list[int]


class OpenAISampler:
    """Sampling from an OpenAI-compatible completions endpoint (vLLM, SGLang) with token-id prompts.

    Request: ``POST {base_url}/v1/completions`` with ``prompt`` = token ids, ``logprobs=1``,
    ``return_tokens_as_token_ids=true`` (vLLM), ``stop_token_ids``, ``skip_special_tokens=false``. The response's
    ``choices[0].logprobs.tokens`` (``"token_id:123"``) and ``token_logprobs`` give ids and behaviour logprobs.
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
    ):
        import httpx

        self.base_url = base_url.rstrip("/")
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self.config = config or SamplingConfig()
        self.model = model
        self.policy_version = policy_version
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self.requests = 0  # completions requested so far: each gets its own seed
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = client or httpx.Client(timeout=timeout_s, headers=headers)

    def fork(self, prompt_ids: Sequence[int], n: int) -> list[OpenAIHandle]:
        if len(prompt_ids) == 0:
            raise ValueError("empty prompt")
        return [OpenAIHandle(token_ids=[int(t) for t in prompt_ids]) for _ in range(n)]

    def generate(self, handle: OpenAIHandle, max_new_tokens: int | None = None) -> Generation:
        body = {
            "model": self.model,
            "prompt": handle.token_ids,
            "max_tokens": max_new_tokens or self.config.max_new_tokens,
            "temperature": self.config.temperature,
            "top_p": self.config.top_p,
            "seed": self._next_seed(),
            "logprobs": 1,
            "stop_token_ids": self.stop_token_ids,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
        }
        generation = self._parse(self._post("/v1/completions", body))
        handle.token_ids.extend(generation.token_ids)
        return generation

    def append(self, handle: OpenAIHandle, ids: Sequence[int]) -> None:
        handle.token_ids.extend(int(i) for i in ids)

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
            ids = [_token_id(t) for t in logprobs["tokens"]]
            values = [float(v) for v in logprobs["token_logprobs"]]
            finish: FinishReason = "stop" if choice.get("finish_reason") == "stop" else "length"
        except (KeyError, IndexError, TypeError, ValueError) as err:
            raise SamplerError(f"malformed completions response ({err!r}): {str(payload)[:300]}") from None
        if len(ids) != len(values):
            raise SamplerError(f"{len(ids)} tokens but {len(values)} logprobs in the response")
        return Generation(ids, values, finish)


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
