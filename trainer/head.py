"""The policy's LM head as the loss reads it: log-probabilities of target tokens from final hidden states, in token x
vocabulary tiles (``longstraw_agents.logprobs``), so a long loss node never holds [n, V] logits."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from longstraw_agents.engine import Engine
from longstraw_agents.logprobs import DEFAULT_TILE_ELEMENTS, head_logprobs
from longstraw_agents.models.lora import base_module, effective_weight


@dataclass(frozen=True)
class Head:
    """An LM head (its weight ``[V, H]`` and bias, read at each call: a LoRA adapter's included) with the tile budget
    of its log-probs."""

    module: nn.Module
    max_tile_elements: int = DEFAULT_TILE_ELEMENTS

    @classmethod
    def of(cls, engine: Engine, max_tile_elements: int = DEFAULT_TILE_ELEMENTS) -> Head:
        return cls(engine.adapter.model.lm_head, max_tile_elements)

    def logprobs(self, hidden: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
        """``log_softmax(head(hidden) / temperature)[target]`` per row ``[n]``, in at least fp32."""
        weight, bias = effective_weight(self.module), getattr(base_module(self.module), "bias", None)
        return head_logprobs(hidden, weight, targets, bias, temperature, self.max_tile_elements)
