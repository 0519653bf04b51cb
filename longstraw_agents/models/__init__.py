"""Per-family model adapters for the engine (one file per family) and the analytic state-size model.

- ``dense``: Llama / Qwen2 / Qwen3 / Mistral — K/V per attention layer.
- ``hybrid``: Qwen3.5 text (GatedDeltaNet + gated full attention, the Qwen3.6-27B layout) — K/V on the attention
  layers, a fixed-size recurrent state and conv tail on the linear-attention layers.
- ``mla``: GLM-MoE-DSA (the GLM-5.2 layout) — MLA's compressed latent + rope key, the DSA indexer key, MoE MLPs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from longstraw_agents.models.base import FamilyAdapter, UnsupportedModelError
from longstraw_agents.models.dense import DenseAdapter
from longstraw_agents.models.hybrid import HybridAdapter
from longstraw_agents.models.mla import MLAAdapter

ADAPTERS: tuple[type[FamilyAdapter], ...] = (DenseAdapter, HybridAdapter, MLAAdapter)


def supported_model_types() -> dict[str, str]:
    """model_type → family, for every supported transformers model type."""
    return {mt: a.family for a in ADAPTERS for mt in a.model_types}


def _supported_text() -> str:
    return ", ".join(f"{a.family} ({', '.join(a.model_types)})" for a in ADAPTERS)


def adapter_class(config: Any) -> type[FamilyAdapter]:
    model_type = getattr(config, "model_type", None)
    for adapter in ADAPTERS:
        if model_type in adapter.model_types:
            return adapter
    raise UnsupportedModelError(f"model_type {model_type!r} is not supported; supported families: {_supported_text()}")


def adapter_for(model: nn.Module) -> FamilyAdapter:
    """The adapter for a transformers CausalLM of a supported family."""
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a transformers model (no .config); supported families: {_supported_text()}"
        )
    adapter = adapter_class(config)
    if not hasattr(model, "model") or not hasattr(model, "lm_head"):
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a CausalLM with .model and .lm_head (pass e.g. "
            f"AutoModelForCausalLM, not the base model); supported families: {_supported_text()}"
        )
    return adapter(model)


def context_limit(config: Any, max_positions: int | None = None) -> int | None:
    """The longest sequence the engine runs for ``config``: ``max_positions`` (default: the config's
    ``max_position_embeddings``), capped by a sliding window the engine stops at (see ``models.dense``)."""
    limits = [
        max_positions or getattr(config, "max_position_embeddings", None),
        adapter_class(config).window_limit(config),
    ]
    known = [limit for limit in limits if limit is not None]
    return min(known) if known else None


@dataclass(frozen=True)
class StateSize:
    """Analytic state size of a config: bytes that grow per token, and fixed bytes per recurrent snapshot."""

    bytes_per_token: int
    fixed_bytes: int

    def total(self, num_tokens: int, snapshots: int = 1) -> int:
        """Bytes of a state over ``num_tokens`` holding ``snapshots`` recurrent states (1 + checkpoints)."""
        return self.bytes_per_token * num_tokens + self.fixed_bytes * (snapshots if num_tokens else 0)


def state_size(config: Any, dtype: torch.dtype | None = None) -> StateSize:
    """Analytic bytes/token and fixed bytes of the engine state for any supported config (meta models too)."""
    if dtype is None:
        dtype = getattr(config, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_layer = adapter_class(config).layer_state_bytes(config, itemsize)
    return StateSize(sum(p for p, _ in per_layer), sum(f for _, f in per_layer))


__all__ = [
    "ADAPTERS",
    "FamilyAdapter",
    "StateSize",
    "UnsupportedModelError",
    "adapter_for",
    "context_limit",
    "state_size",
    "supported_model_types",
]
