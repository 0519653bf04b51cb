"""Engine settings (``EngineConfig``) and the spacings derived from them for a given model."""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from longstraw_agents.attention import BACKEND_NAMES, DEFAULT_SCORE_ELEMENTS
from longstraw_agents.models import state_size

GradAccumulation = Literal["fp32", "state"]
MAX_CHECKPOINT_SPACING = 64  # models without per-token state (all recurrent) keep one snapshot per 64 chunks


class EngineConfig(BaseModel):
    """How the engine evaluates context: chunking, the attention backend, and what exact mode keeps or recomputes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    chunk_size: int = Field(
        512,
        ge=1,
        description="tokens evaluated per forward during capture/extend; bounds activation memory (and, in exact "
        "mode, the size of one recomputed graph)",
    )
    attention: str = Field(
        "auto",
        description="the attention backend: 'auto' (the fastest one that takes the shapes), 'cuda' (flash or cuDNN "
        "per shape, by measurement), 'cuda-flash', 'cuda-cudnn', 'cpu-flash' or 'eager' "
        "(longstraw_agents.attention)",
    )
    max_score_elements: int = Field(
        DEFAULT_SCORE_ELEMENTS,
        ge=1,
        description="what the eager backend, DSA's indexer and its sparse attention materialise at once: attention "
        "scores (heads x queries x keys), index scores (queries x keys) and, off the GPU kernels, gathered rows "
        "(queries x selected x width); longer key blocks and more queries are processed in pieces, so a chunk's "
        "transient memory does not grow with the prefix. In backward, a state block's key/value gradient is "
        "computed chunk_size positions at a time",
    )
    exact_products: bool = Field(
        False,
        description="DSA's GPU kernels (index scores, sparse attention) multiply in full fp32; False: on bf16 "
        "tensor cores with fp32 sums — the rows and queries are bf16 values, so the score products are exact and "
        "only the order of the sums changes (which can reorder index scores within rounding of each other, "
        "i.e. flip a near-tie in the top-k). CPU paths always multiply in the model's precision",
    )
    checkpoint_every: int | None = Field(
        None,
        ge=1,
        description="exact gradients: keep the recurrent (GatedDeltaNet) state after every k-th chunk; the reverse "
        "walk recomputes the ones between forward from the nearest checkpoint (one extra no-grad forward of those "
        "chunks). None: the smallest k whose checkpoints take no more memory per token than the attention state "
        "(1 for the tiny presets; 5 for a Qwen3.6-27B layout at chunk 512)",
    )
    grad_accumulation: GradAccumulation = Field(
        "fp32",
        description="the state gradient's buffers: 'fp32' (at least fp32: bf16 models get fp32 buffers) or 'state' "
        "(the state's own dtype)",
    )
    graph_budget_bytes: int = Field(
        0,
        ge=0,
        description="exact mode keeps the autograd graphs of the last prefix chunks that fit in this many bytes "
        "instead of recomputing them in the reverse walk (0: recompute every chunk, the smallest peak); a budget "
        "at a full-graph trainer's peak makes exact mode about as fast as one. With context parallelism a budget "
        "makes the capture replicated (the kept graphs need every chunk on every rank), and so the reverse walk",
    )
    activation_checkpointing: bool = Field(
        False,
        description="graphs (branch replays, recomputed chunks) keep each layer's input only and recompute the "
        "layer in backward: a large model's branch graph shrinks from every layer's activations to one layer's "
        "(one more forward of the branch or chunk)",
    )
    wavefront_walk: bool = Field(
        True,
        description="with context parallelism, exact mode's capture keeps each rank's layer inputs (one hidden "
        "vector per position of its shard and kept layer) and the reverse walk runs sharded in a wavefront over "
        "(rank, layer); False: every rank recomputes every chunk in the walk (no layer inputs kept; the choice when "
        "they do not fit: `longstraw plan` shows both). See docs/distributed.md",
    )
    sharded_extend_tokens: int | None = Field(
        None,
        ge=1,
        description="with context parallelism, an extend of at least this many tokens (a long tool output, a "
        "member's long first turn) is computed sharded like a capture — each rank evaluates its even share, the "
        "earlier rows sent to it — even when shorter than the context before it; shorter extends run replicated "
        "(every rank computes them, attention partials merged). None: only extends at least as long as their "
        "context are sharded. Either way the new positions' state is spread over the ranks; with sharded_extends "
        "off, none is",
    )
    balanced_captures: bool = Field(
        True,
        description="with context parallelism, cut a sharded extend in 2N parts, rank r computing the r-th and the "
        "(2N - 1 - r)-th: every rank's attention work even (in rank order the last rank's is up to twice the mean), "
        "at the cost, with sharded weights, of gathering each layer twice (once per wave of runs: N layers whole "
        "on every rank, against 1 + r on rank r in rank order: `longstraw plan --capture`). Exact mode's wavefront "
        "walk walks the same cut (with sharded weights: each segment's inputs recomputed when the first run enters "
        "it and each layer's gradient reduced per wave, so a rank holds up to N - 1 more layers' inputs and "
        "gradients). See docs/distributed.md",
    )
    sharded_extends: bool = Field(
        True,
        description="with context parallelism, compute long extends (a capture) sharded; False: every extend "
        "replicated — every rank computes every chunk, attention partials merged, each position's state still "
        "stored by one rank — so that every rank makes the same layer calls in the same order (expert "
        "parallelism's default: a MoE call sums each rank's experts' share with one all-reduce; sharded, its MoE "
        "calls are rounds of all-to-alls instead, parallel.expert_dispatch); exact mode then walks replicated too",
    )
    layer_inputs_every: int | None = Field(
        None,
        ge=1,
        description="the wavefront walk keeps layer inputs at every k-th layer only and recomputes the ones between, "
        "a segment of k layers at a time (forward, no graph): L / k + k hidden vectors per position instead of L. "
        "None: k = ceil(sqrt(L))",
    )

    @field_validator("attention")
    @classmethod
    def _known_backend(cls, name: str) -> str:
        if name not in BACKEND_NAMES:
            raise ValueError(f"must be one of {list(BACKEND_NAMES)}, got {name!r}")
        return name

    def updated(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes`` applied, validated like the original."""
        return EngineConfig.model_validate({**self.model_dump(), **changes})


def checkpoint_spacing(model_config: Any, dtype: torch.dtype, config: EngineConfig) -> int:
    """``config.checkpoint_every``, or the smallest k whose recurrent checkpoints (one every k chunks) take no more
    memory per token than the attention state of ``model_config`` (1 without recurrent layers)."""
    if config.checkpoint_every is not None:
        return config.checkpoint_every
    size = state_size(model_config, dtype)
    per_chunk = size.bytes_per_token * config.chunk_size
    if size.fixed_bytes == 0:
        return 1
    if per_chunk == 0:
        return MAX_CHECKPOINT_SPACING
    return max(1, min(MAX_CHECKPOINT_SPACING, math.ceil(size.fixed_bytes / per_chunk)))


def layer_inputs_spacing(num_layers: int, config: EngineConfig) -> int:
    """``config.layer_inputs_every``, or ceil(sqrt(layers)): the kept inputs and one recomputed segment then take
    about ``2 sqrt(L)`` hidden vectors per position."""
    return config.layer_inputs_every or math.ceil(math.sqrt(num_layers))
