"""Dense attention family: Llama, Qwen2, Qwen3, Mistral (GQA, RoPE, RMSNorm; Qwen3's per-head q/k norms).

The state of every layer is its post-RoPE keys and values, ``[n, H_kv, D]`` each. The attention mixer here is also
used by the hybrid family's full-attention layers (which add a sigmoid output gate and zero-centred norms).

Sliding-window configs (Mistral's default ``sliding_window=4096``, Qwen2/Qwen3 with ``use_sliding_window``) are
accepted: while a sequence fits in the window, sliding-window attention *is* full attention (transformers lets query
q see key k iff ``q - W < k <= q``). The engine attends to the full context, so a forward that would reach past the
window raises ``SlidingWindowExceededError`` instead of silently computing something else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from longstraw_agents.attention import KVBlock
from longstraw_agents.models.base import (
    DecoderLayer,
    FamilyAdapter,
    HFModule,
    LayerWork,
    Mixer,
    MixerInput,
    MixerOutput,
    apply_rope,
    bound_norm,
    causal_pairs,
    norm_eps,
    rms_norm,
)
from longstraw_agents.models.batch import DecodeInput, cascade_attention, write_session


class AttentionMixer(Mixer):
    """Causal GQA attention over the state's K/V blocks plus the new tokens' own K/V (the attention core's one op)."""

    grows = True

    def __init__(
        self,
        attn: HFModule,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qk_norm: Callable[[Tensor, Tensor, float], Tensor] | None = None,
        output_gate: bool = False,
    ):
        self.attn = attn
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = float(attn.scaling)
        self.output_gate = output_gate
        self.q_norm = bound_norm(qk_norm, attn.q_norm) if qk_norm is not None else None
        self.k_norm = bound_norm(qk_norm, attn.k_norm) if qk_norm is not None else None

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim))

    def _project(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Queries ``[n, H, D]``, keys and values ``[n, H_kv, D]`` (normed, rotated) and the output gate (or None)."""
        n = x.shape[0]
        q = self.attn.q_proj(x)
        gate = None
        if self.output_gate:  # Qwen3.5 / Qwen3-Next: q_proj emits the query and a per-channel gate per head
            q, gate = q.view(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(n, -1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        k, v = self._keys_values(x, rope)
        return apply_rope(q, *rope), k, v, gate

    def _keys_values(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """Keys (normed, rotated) and values ``[n, H_kv, D]``: what a token adds to the state."""
        n = x.shape[0]
        k = self.attn.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.attn.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k, *rope), v

    def _output(self, out: Tensor, gate: Tensor | None) -> Tensor:
        out = out.reshape(out.shape[0], -1)
        if gate is not None:
            out = out * gate.sigmoid()
        return self.attn.o_proj(out)

    def forward(self, inp: MixerInput) -> MixerOutput:
        q, k, v, gate = self._project(inp.x, inp.rope)
        blocks = [KVBlock(b.tensors[0], b.tensors[1], b.grad(0), b.grad(1)) for b in inp.past]
        out = inp.attention(q, blocks, k, v, self.scale)
        return MixerOutput(y=self._output(out, gate), new=(k, v))

    def state_entries(self, inp: MixerInput) -> tuple[Tensor, ...]:
        """The keys and values alone (no queries, no attention)."""
        return self._keys_values(inp.x, inp.rope)

    def decode(self, inp: DecodeInput) -> MixerOutput:
        q, k, v, gate = self._project(inp.x, inp.rope)
        keys, values = write_session(inp, (k, v))
        return MixerOutput(y=self._output(cascade_attention(q, keys, values, inp, self.scale), gate), new=())


KEY_VALUE_PARAMETERS = ("self_attn.k_proj.weight", "self_attn.v_proj.weight")


def attention_pair_flops(config: Any) -> int:
    """FLOPs of one (query, key) pair of softmax attention: a score and a weighted value per query head."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 4 * config.num_attention_heads * head_dim


def kv_bytes_per_token(config: Any, itemsize: int) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_key_value_heads * head_dim * itemsize


class SlidingWindowExceededError(ValueError):
    """A sequence of a sliding-window model reached past its window (the engine implements full attention only)."""


def sliding_windows(config: Any) -> list[int | None]:
    """Per layer, the attention window in tokens (None: full attention), read as transformers reads the config."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:  # Qwen2 / Qwen3: per-layer "sliding_attention" | "full_attention"
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    if config.model_type == "mistral":  # every layer uses config.sliding_window
        return [window] * config.num_hidden_layers
    return [None] * config.num_hidden_layers


class DenseAdapter(FamilyAdapter):
    family = "dense"
    model_types = ("llama", "qwen2", "qwen3", "mistral")

    def __init__(self, model: HFModule):
        super().__init__(model)
        self.window = self.window_limit(self.config)

    @classmethod
    def window_limit(cls, config: Any) -> int | None:
        windows = [w for w in sliding_windows(config) if w is not None]
        return min(windows) if windows else None

    def check_reach(self, end: int) -> None:
        if self.window is not None and end > self.window:
            raise SlidingWindowExceededError(
                f"{self.config.model_type} uses sliding-window attention (sliding_window={self.window}) and this "
                f"sequence reaches {end} tokens; the engine implements full attention, identical to the window only "
                f"up to {self.window} tokens. Keep contexts within the window, or set sliding_window=None if the "
                "model was trained with full attention"
            )

    def build_layers(self) -> list[DecoderLayer]:
        cfg = self.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        layers = []
        for hf_layer in self.backbone.layers:
            attn = hf_layer.self_attn
            mixer = AttentionMixer(
                attn,
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                head_dim,
                qk_norm=rms_norm if hasattr(attn, "q_norm") else None,
            )
            layers.append(DecoderLayer.from_hf(hf_layer, mixer, rms_norm))
        return layers

    def final_norm(self, h: Tensor) -> Tensor:
        return rms_norm(h, self.backbone.norm.weight, norm_eps(self.backbone.norm))

    @classmethod
    def layer_state_bytes(cls, config: Any, itemsize: int) -> list[tuple[int, int]]:
        return [(kv_bytes_per_token(config, itemsize), 0)] * config.num_hidden_layers

    @classmethod
    def layer_work(cls, config: Any, new: int, earlier: int, itemsize: int) -> list[LayerWork]:
        attention = LayerWork(attention=attention_pair_flops(config) * causal_pairs(new, earlier))
        return [attention] * config.num_hidden_layers

    @classmethod
    def state_parameters(cls, config: Any) -> tuple[str, ...]:
        return KEY_VALUE_PARAMETERS
