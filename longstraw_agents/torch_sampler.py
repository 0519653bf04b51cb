"""``TorchSampler``: in-process sampling with the engine.

The group's prompt is captured once and forked for the G members; each member's state is then extended with its own
tokens and with the environment's observations, so no turn ever re-prefills the episode. Behaviour logprobs are the
log-probabilities of the sampled tokens under the temperature-scaled distribution (before top-p truncation); train
with ``LossConfig(temperature=...)`` equal to the sampling temperature.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from longstraw_agents.engine import Engine
from longstraw_agents.sampler import FinishReason, Generation, SamplingConfig
from longstraw_agents.state import State


def sample_token(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator) -> tuple[int, float]:
    """Draw one token from ``logits [V]``; returns (id, logprob under the temperature-scaled distribution)."""
    logits = logits.detach().double()
    if config.temperature == 0.0:
        logprobs = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logits))
        return token, float(logprobs[token])
    logprobs = torch.log_softmax(logits / config.temperature, dim=-1)
    probs = logprobs.exp()
    if config.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= config.top_p  # keeps at least one token
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    token = int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
    return token, float(logprobs[token])


@dataclass
class TorchHandle:
    """A member's position in its episode: the engine state and the next-token logits after it."""

    state: State
    next_logits: torch.Tensor
    history: list[int] = field(default_factory=list, repr=False)


class TorchSampler:
    """In-process sampling with the engine (capture once, fork, extend per turn)."""

    def __init__(
        self,
        model: torch.nn.Module | Engine,
        stop_token_ids: Sequence[int],
        config: SamplingConfig | None = None,
        *,
        policy_version: int = 0,
        chunk_size: int = 512,
    ):
        self.engine = model if isinstance(model, Engine) else Engine(model, chunk_size=chunk_size)
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        if not self.stop_token_ids:
            raise ValueError("stop_token_ids is empty: generation could only end by length")
        self.config = config or SamplingConfig()
        self.policy_version = policy_version
        self.generator = torch.Generator().manual_seed(self.config.seed)

    def fork(self, prompt_ids: Sequence[int], n: int) -> list[TorchHandle]:
        """``n`` members sharing one capture of the prompt."""
        ids = torch.as_tensor(list(prompt_ids), dtype=torch.long)
        if ids.numel() == 0:
            raise ValueError("empty prompt")
        with torch.no_grad():
            state = self.engine.capture(ids[:-1]) if ids.numel() > 1 else self.engine.empty_state()
            state, logits = self.engine.step(state, ids[-1:], reserve=self._reserve())
        return [TorchHandle(state=state, next_logits=logits, history=ids.tolist()) for _ in range(n)]

    def generate(self, handle: TorchHandle, max_new_tokens: int | None = None) -> Generation:
        limit = max_new_tokens or self.config.max_new_tokens
        ids: list[int] = []
        logprobs: list[float] = []
        finish: FinishReason = "length"
        with torch.no_grad():
            while len(ids) < limit:
                token, logprob = sample_token(handle.next_logits, self.config, self.generator)
                ids.append(token)
                logprobs.append(logprob)
                handle.state, handle.next_logits = self.engine.step(
                    handle.state, torch.tensor([token]), reserve=self._reserve()
                )
                if token in self.stop_token_ids:
                    finish = "stop"
                    break
        handle.history.extend(ids)
        return Generation(ids, logprobs, finish)

    def append(self, handle: TorchHandle, ids: Sequence[int]) -> None:
        if len(ids) == 0:
            return
        with torch.no_grad():
            handle.state, handle.next_logits = self.engine.step(
                handle.state, torch.as_tensor(list(ids), dtype=torch.long), reserve=self._reserve()
            )
        handle.history.extend(int(i) for i in ids)

    def num_tokens(self, handle: TorchHandle) -> int:
        return handle.state.num_tokens

    def complete(self, prompt_ids: Sequence[int], max_new_tokens: int | None = None) -> Generation:
        """One completion of a token prompt (what an OpenAI-compatible server answers)."""
        return self.generate(self.fork(prompt_ids, 1)[0], max_new_tokens)

    def _reserve(self) -> int:
        return self.config.max_new_tokens
