"""What every family adapter shares: the decoder loop, the mixer interface, norms in the right precision.

An adapter reads a transformers CausalLM's modules for their weights and re-implements the token mixers so that
they read the engine's state instead of a transformers cache (see DESIGN.md, "Engine"). Position-wise parts (dense
MLPs) call the transformers module directly; anything that transformers computes in fp32 regardless of the model
dtype (norms, routers, the GatedDeltaNet fallback) is computed here in ``compute_dtype`` — fp32 for fp32/bf16
models, exactly as transformers does, and fp64 for fp64 models, so that fp64 gradient checks are exact.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from longstraw_agents.attention import Attention
from longstraw_agents.models.batch import DecodeBatch, DecodeContext, DecodeInput

HFModule = Any
"""A transformers module (a decoder layer, its attention, a norm...): the adapters read its weights and settings by
attribute, which differ per architecture, so it is typed dynamically."""


class UnsupportedModelError(ValueError):
    """The model is not of a family the engine supports (the message names the supported ones)."""


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision and fp32 models (as transformers), the model's own dtype when it is wider."""
    return torch.promote_types(dtype, torch.float32)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama-style RMSNorm: normalise in compute precision, cast back, then scale (``weight * x.to(dtype)``)."""
    xc = x.to(compute_dtype(x.dtype))
    xc = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xc.to(x.dtype)


def rms_norm_zero_centered(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3.5-style RMSNorm with weight ``1 + w``, scaled in compute precision before the cast back."""
    dt = compute_dtype(x.dtype)
    xc = x.to(dt)
    xc = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    return (xc * (1.0 + weight.to(dt))).to(x.dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Half-split RoPE on the first ``cos.shape[-1]`` dims of ``x [n, H, D]`` (partial rotary keeps the rest)."""
    rot = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [n, 1, rot]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x_rot = x_rot * cos + rotate_half(x_rot) * sin
    return torch.cat((x_rot, x_pass), dim=-1) if x_pass.shape[-1] else x_rot


def norm_eps(module: HFModule) -> float:
    """transformers' RMSNorm modules call their epsilon ``variance_epsilon`` or ``eps``."""
    eps = getattr(module, "variance_epsilon", None)
    return float(module.eps if eps is None else eps)


def bound_norm(fn: Callable[[Tensor, Tensor, float], Tensor], module: HFModule) -> Callable[[Tensor], Tensor]:
    """``fn(x, module's weight, module's epsilon)`` as a function of ``x``. The weight is read at each call, not
    bound: a wrapper that swaps the module's parameter (FSDP2's unshard / reshard) must be seen."""
    eps = norm_eps(module)
    return lambda x: fn(x, module.weight, eps)


@dataclass(frozen=True)
class LayerWork:
    """A layer's forward work beyond its weight matmuls, by the kind of work (the time model's classes)."""

    attention: float = 0.0  # FLOPs of softmax attention over (query, key) pairs in a fused kernel
    recurrent: float = 0.0  # FLOPs of a recurrent mixer's own arithmetic (the chunked delta rule)
    selection: float = 0.0  # (query, key) scores chosen from (DSA's index scores and their top-k; no gradient)
    gathered: float = 0.0  # bytes gathered row by row (DSA's selected rows)
    steps: float = 0.0  # sequential steps of a few kernels each (the delta rule's blocks, a MoE's grouped experts)


def causal_pairs(new: int, earlier: int) -> int:
    """(query, key) pairs a causal kernel computes for ``new`` queries after ``earlier`` positions: every earlier
    key, and the triangle of the new ones (a fused kernel skips the masked half of the diagonal block)."""
    return new * earlier + new * (new + 1) // 2


@dataclass(frozen=True)
class PastBlock:
    """Earlier positions of a growing layer's state: its tensors there (views of the state) and, when the state's
    gradient is wanted, the buffers those tensors' gradients are added into (same shapes)."""

    tensors: tuple[Tensor, ...]
    grads: tuple[Tensor, ...] | None = None
    start: int = 0  # the token position of the first row

    def grad(self, i: int) -> Tensor | None:
        return None if self.grads is None else self.grads[i]


@dataclass
class MixerInput:
    """What a token mixer sees for ``n`` new tokens.

    ``past``: earlier blocks of this layer's per-position state (growing mixers), in position order from 0.
    ``recurrent``: the layer's state before the first new token (recurrent mixers), None at position 0.
    ``shared``: scratch shared by the layers of one forward (e.g. DSA's top-k reused by "shared" layers).
    ``attention``: the attention op (backend and memory bounds, see ``longstraw_agents.attention``).
    """

    x: Tensor
    positions: Tensor
    rope: tuple[Tensor, Tensor]
    past: list[PastBlock] = field(default_factory=list)
    recurrent: tuple[Tensor, ...] | None = None
    shared: dict[str, Any] = field(default_factory=dict)
    attention: Attention = field(default_factory=Attention)

    @property
    def start(self) -> int:
        """The position of the first new token, read without a device sync (``positions`` may be on the meta
        device when the memory planner runs the model)."""
        return self._start if self._start is not None else int(self.positions[0])

    _start: int | None = None


@dataclass
class MixerOutput:
    """The mixer's output ``y [n, hidden]`` and what it adds to the state (per-position tensors or a new state)."""

    y: Tensor
    new: tuple[Tensor, ...]


class Mixer(ABC):
    """A token mixer over the engine's state. ``grows``: per-position state (attention) vs fixed (recurrent)."""

    grows: ClassVar[bool]

    @abstractmethod
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per-position shapes (growing mixers) or whole-state shapes (recurrent mixers)."""

    @abstractmethod
    def forward(self, inp: MixerInput) -> MixerOutput: ...

    def state_entries(self, inp: MixerInput) -> tuple[Tensor, ...]:
        """What ``forward`` adds to the state, when its output ``y`` is not wanted (the last layer of a forward whose
        hidden states nobody reads): a mixer overrides it to skip the work that feeds ``y`` alone."""
        return self.forward(inp).new

    @abstractmethod
    def decode(self, inp: DecodeInput) -> MixerOutput:
        """One new token for each of B members (``inp.x [B, hidden]``, see ``models.batch``); ``new`` holds the
        members' additions with the member first (one position each, or each member's new recurrent state)."""


@dataclass
class DecoderLayer:
    """Pre-norm residual block: ``h += mixer(norm1(h)); h += mlp(norm2(h))``."""

    mixer: Mixer
    input_norm: Callable[[Tensor], Tensor]
    post_norm: Callable[[Tensor], Tensor]
    mlp: Callable[[Tensor], Tensor]

    @classmethod
    def from_hf(
        cls,
        hf_layer: HFModule,
        mixer: Mixer,
        norm: Callable[[Tensor, Tensor, float], Tensor],
        mlp: Callable[[Tensor], Tensor] | None = None,
    ) -> DecoderLayer:
        """A layer over a transformers decoder layer's norms and MLP (``mlp`` replaces its MLP when given)."""
        return cls(
            mixer=mixer,
            input_norm=bound_norm(norm, hf_layer.input_layernorm),
            post_norm=bound_norm(norm, hf_layer.post_attention_layernorm),
            mlp=hf_layer.mlp if mlp is None else mlp,
        )


@dataclass
class LayerContext:
    """What one layer reads of the state: past blocks (growing layers) or the recurrent state (recurrent layers)."""

    past: list[PastBlock] = field(default_factory=list)
    recurrent: tuple[Tensor, ...] | None = None


# runner(layer index, the layer's forward (h -> (h, *new state entries)), h): how a decoder loop calls each layer
LayerRunner = Callable[[int, Callable[[Tensor], Any], Tensor], Any]


class FamilyAdapter(ABC):
    """Adapter for one model family. Subclasses build ``self.layers`` and say which model types they take."""

    family: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    decode_graph_blocker: ClassVar[str | None] = None
    """Why the family's ``decode`` step cannot be captured in a CUDA graph (it waits for the host), said when a
    decoder runs it eagerly instead; None: it can (``step_graph.host_syncs`` finds nothing in it)."""

    def __init__(self, model: HFModule):
        self.model: HFModule = model
        self.config: Any = model.config
        self.backbone: HFModule = model.model
        self.check_config(self.config)
        self.layers: list[DecoderLayer] = self.build_layers()

    # --- per family -----------------------------------------------------------------------------------------
    @classmethod  # noqa: B027 - an optional hook: most families accept every config
    def check_config(cls, config: Any) -> None:
        """Raise UnsupportedModelError for configurations of the family the adapter does not implement."""

    @abstractmethod
    def build_layers(self) -> list[DecoderLayer]: ...

    @abstractmethod
    def final_norm(self, h: Tensor) -> Tensor: ...

    @classmethod
    @abstractmethod
    def layer_state_bytes(cls, config: Any, itemsize: int) -> list[tuple[int, int]]:
        """Per layer: (bytes per token, fixed bytes) of the state, computed from the config alone."""

    @classmethod
    @abstractmethod
    def layer_work(cls, config: Any, new: int, earlier: int, itemsize: int) -> list[LayerWork]:
        """Per layer: its forward work for ``new`` positions after ``earlier`` ones, as the engine's kernels do it
        (the weight matmuls are counted from the parameters: ``active_fraction``); ``itemsize``: the state's."""

    @classmethod
    @abstractmethod
    def state_parameters(cls, config: Any) -> tuple[str, ...]:
        """The last layer's parameters (names within the layer) its state entries use: a capture computes that
        layer's ``Mixer.state_entries`` alone."""

    @classmethod
    def active_fraction(cls, config: Any, name: str) -> float:
        """The share of parameter ``name``'s weights one token multiplies (1, except a mixture of experts')."""
        return 1.0

    @classmethod
    def window_limit(cls, config: Any) -> int | None:
        """The longest sequence the engine computes exactly for this config regardless of its position limit (a
        sliding window it stops at), or None."""
        return None

    def check_reach(self, end: int) -> None:  # noqa: B027 - an optional hook: most families compute any length
        """Raise when a forward reaching position ``end - 1`` is one the adapter does not compute exactly."""

    def decode_regime(self, reach: int) -> int:
        """Which of the family's decode paths a step takes whose longest member reaches ``reach`` positions (its
        new one included): ``DecodeBatch.regime``, known on the host, so that the step reads no position to choose
        (a captured step replays one path; the decoder enters a new shape class when the regime changes). 0: one
        path for every length."""
        return 0

    # --- shared ---------------------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.backbone.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.backbone.embed_tokens.weight.device

    @property
    def vocab_size(self) -> int:
        return self.backbone.embed_tokens.weight.shape[0]

    def rope(self, h: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = self.backbone.rotary_emb(h.unsqueeze(0), positions.unsqueeze(0))
        return cos[0], sin[0]

    def forward(
        self,
        ids: Tensor,
        start: int,
        contexts: list[LayerContext],
        shared: dict[str, Any] | None = None,
        attention: Attention | None = None,
        checkpoint_layers: bool = False,
        runner: LayerRunner | None = None,
    ) -> tuple[Tensor, list[tuple[Tensor, ...]]]:
        """Run ``ids`` (positions ``start..``) through the decoder; returns the final-normed hidden states
        ``[n, hidden]`` and, per layer, what the layer adds to the state.

        checkpoint_layers: under autograd, keep only each layer's input and recompute the layer in backward
        (activation checkpointing, ``torch.utils.checkpoint``): a graph then holds one hidden vector per token and
        layer plus one layer's activations, instead of every layer's.
        runner: calls each layer's forward, ``runner(i, forward, h)`` (the engine's way to have a layer's weights
        present only while they are used); default: called directly."""
        self.check_reach(start + ids.shape[0])
        h, new_entries = self._decoder(ids, start, contexts, shared, attention, checkpoint_layers, runner, True)
        return self.final_norm(h), new_entries

    def state_entries(
        self,
        ids: Tensor,
        start: int,
        contexts: list[LayerContext],
        attention: Attention | None = None,
        runner: LayerRunner | None = None,
    ) -> list[tuple[Tensor, ...]]:
        """Per layer, what ``forward`` adds to the state for ``ids``, the same entries, without the hidden states (a
        capture's chunk): the last layer runs only what makes its entries (``Mixer.state_entries``), since its mixer
        output and its MLP feed nothing but the hidden states."""
        self.check_reach(start + ids.shape[0])
        _, new_entries = self._decoder(ids, start, contexts, None, attention, False, runner, False)
        return new_entries

    def _decoder(
        self,
        ids: Tensor,
        start: int,
        contexts: list[LayerContext],
        shared: dict[str, Any] | None,
        attention: Attention | None,
        checkpoint_layers: bool,
        runner: LayerRunner | None,
        last_hidden: bool,
    ) -> tuple[Tensor, list[tuple[Tensor, ...]]]:
        """The decoder loop: the last layer's output (its input when ``last_hidden`` is False: that layer then adds
        its state entries only) and every layer's state entries."""
        h, positions, rope = self.embed(ids, start)
        shared = {} if shared is None else shared
        attention = Attention() if attention is None else attention
        new_entries: list[tuple[Tensor, ...]] = []
        recompute = checkpoint_layers and torch.is_grad_enabled()
        for index, (layer, ctx) in enumerate(zip(self.layers, contexts, strict=True)):
            # a layer reads the scratch as it was before it: a recomputation must not see what later layers wrote
            seen: dict[str, Any] = dict(shared)
            written: dict[str, Any] = {}
            entries_only = not last_hidden and index == len(self.layers) - 1

            def run(
                h: Tensor,
                layer: DecoderLayer = layer,
                ctx: LayerContext = ctx,
                seen=seen,
                written=written,
                entries_only: bool = entries_only,
            ):
                scratch = dict(seen)
                if entries_only:
                    inp = _mixer_input(layer, h, positions, rope, ctx, scratch, attention, start)
                    new = layer.mixer.state_entries(inp)
                else:
                    h, new = self.run_layer(layer, h, positions, rope, ctx, scratch, attention, start)
                written.update(scratch)
                return (h, *new)

            layer_forward = functools.partial(checkpoint, run, use_reentrant=False) if recompute else run
            h, *new = layer_forward(h) if runner is None else runner(index, layer_forward, h)
            shared.update(written)
            new_entries.append(tuple(new))
        return h, new_entries

    def embed(self, ids: Tensor, start: int) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
        """The embeddings of ``ids`` at positions ``start..``, those positions, and their rotary tables."""
        positions = torch.arange(start, start + ids.shape[0], device=ids.device)
        h = self.backbone.embed_tokens(ids)
        return h, positions, self.rope(h, positions)

    @staticmethod
    def run_layer(
        layer: DecoderLayer,
        h: Tensor,
        positions: Tensor,
        rope: tuple[Tensor, Tensor],
        ctx: LayerContext,
        shared: dict[str, Any],
        attention: Attention,
        start: int,
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """One decoder layer over ``h`` (positions ``start..``): the layer's output and what it adds to the state
        (``shared``: the forward's scratch, which the layer may read and write)."""
        out = layer.mixer.forward(_mixer_input(layer, h, positions, rope, ctx, shared, attention, start))
        h = h + out.y
        return h + layer.mlp(layer.post_norm(h)), out.new

    def decode(
        self,
        ids: Tensor,
        batch: DecodeBatch,
        contexts: list[DecodeContext],
        attention: Attention | None = None,
        runner: LayerRunner | None = None,
    ) -> tuple[Tensor, list[tuple[Tensor, ...]]]:
        """One new token per member (``ids [B]`` at ``batch.positions``) through the decoder in one batched forward:
        the final-normed hidden states ``[B, hidden]`` and, per layer, what it adds to each member's state.
        ``runner``: as ``forward``'s. The caller checks the positions' reach (``check_reach``): it knows them on the
        host, and a step that reads them from the device cannot be captured in a CUDA graph."""
        h = self.backbone.embed_tokens(ids)
        rope = self.rope(h, batch.positions)
        shared: dict[str, Any] = {}
        attention = Attention() if attention is None else attention
        new_entries: list[tuple[Tensor, ...]] = []
        for index, (layer, ctx) in enumerate(zip(self.layers, contexts, strict=True)):

            def run(h: Tensor, layer: DecoderLayer = layer, ctx: DecodeContext = ctx) -> tuple[Tensor, ...]:
                out = layer.mixer.decode(DecodeInput(layer.input_norm(h), rope, batch, ctx, shared, attention))
                h = h + out.y
                return (h + layer.mlp(layer.post_norm(h)), *out.new)

            h, *new = run(h) if runner is None else runner(index, run, h)
            new_entries.append(tuple(new))
        return self.final_norm(h), new_entries

    def lm_head(self, hidden: Tensor) -> Tensor:
        return self.model.lm_head(hidden)


def _mixer_input(
    layer: DecoderLayer,
    h: Tensor,
    positions: Tensor,
    rope: tuple[Tensor, Tensor],
    ctx: LayerContext,
    shared: dict[str, Any],
    attention: Attention,
    start: int,
) -> MixerInput:
    return MixerInput(layer.input_norm(h), positions, rope, ctx.past, ctx.recurrent, shared, attention, start)
