"""The policy's LM head as the loss reads it: log-probabilities of target tokens from final hidden states, in token x
vocabulary tiles (``longstraw_agents.logprobs``), so a long loss node never holds [n, V] logits."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from longstraw_agents.engine import Engine
from longstraw_agents.logprobs import DEFAULT_TILE_ELEMENTS, head_logprobs


@dataclass(frozen=True)
class Head:
    """An LM head's weight ``[V, H]`` (and bias) with the tile budget of its log-probs."""

    weight: Tensor
    bias: Tensor | None = None
    max_tile_elements: int = DEFAULT_TILE_ELEMENTS

    @classmethod
    def of(cls, engine: Engine, max_tile_elements: int = DEFAULT_TILE_ELEMENTS) -> Head:
        module = engine.adapter.model.lm_head
        return cls(module.weight, getattr(module, "bias", None), max_tile_elements)

    def logprobs(self, hidden: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
        """``log_softmax(head(hidden) / temperature)[target]`` per row ``[n]``, in at least fp32."""
        return head_logprobs(hidden, self.weight, targets, self.bias, temperature, self.max_tile_elements)
