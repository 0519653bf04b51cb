"""Hybrid family: Qwen3.5 text models — GatedDeltaNet linear attention + gated full attention (Qwen3.6-27B layout:
three linear-attention layers per full-attention layer).

Full-attention layers keep K/V per token (the dense mixer with a sigmoid output gate and zero-centred q/k norms).
GatedDeltaNet layers keep a fixed-size state: the short-conv tail (the last ``kernel-1`` pre-conv inputs) and the
delta-rule state ``[H_v, D_k, D_v]``. The delta rule (``models/delta_rule.py``) runs in ``compute_dtype``
(transformers' fallback always computes in fp32; here fp64 models stay fp64): chunked in pure torch on CPU, with
Triton and flash-linear-attention kernels on a GPU. The recurrent state is kept in compute precision, as
transformers does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from longstraw_agents.models.base import (
    DecoderLayer,
    FamilyAdapter,
    HFModule,
    LayerWork,
    Mixer,
    MixerInput,
    MixerOutput,
    causal_pairs,
    compute_dtype,
    norm_eps,
    rms_norm_zero_centered,
)
from longstraw_agents.models.batch import DecodeInput
from longstraw_agents.models.delta_rule import delta_rule, delta_rule_flops
from longstraw_agents.models.dense import (
    KEY_VALUE_PARAMETERS,
    AttentionMixer,
    attention_pair_flops,
    kv_bytes_per_token,
)
from longstraw_agents.models.lora import base_module, effective_weight


def depthwise_conv(full: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Depthwise cross-correlation of ``full [K-1+n, C]`` with ``weight [C, K]`` over windows of K positions:
    ``[n, C]``. On a GPU, ``F.conv1d`` (cuDNN's depthwise kernel, as transformers' fallback runs it; no
    causal-conv1d extension needed); on CPU, windows times weights summed (``F.conv1d``'s fp64 CPU path is ~100x
    slower)."""
    if full.is_cuda:
        return F.conv1d(full.t().unsqueeze(0), weight.unsqueeze(1), bias, groups=weight.shape[0])[0].t()
    out = (full.unfold(0, weight.shape[1], 1) * weight).sum(dim=-1)  # [n, C, K] summed over K
    return out if bias is None else out + bias


class GatedDeltaNetMixer(Mixer):
    """GatedDeltaNet over a (conv tail, delta-rule state) pair; the new tokens update both."""

    grows = False

    def __init__(self, mod: HFModule):
        self.mod = mod
        self.kernel = mod.conv_kernel_size
        self.num_k_heads, self.num_v_heads = mod.num_k_heads, mod.num_v_heads
        self.head_k_dim, self.head_v_dim = mod.head_k_dim, mod.head_v_dim
        self.conv_dim = mod.conv_dim
        self.norm_eps = norm_eps(mod.norm)

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.kernel - 1, self.conv_dim), (self.num_v_heads, self.head_k_dim, self.head_v_dim))

    def _conv(self, mixed: Tensor, tail: Tensor | None) -> tuple[Tensor, Tensor]:
        """Causal depthwise conv + SiLU over ``[tail; mixed]``; returns outputs ``[n, C]`` and the new tail."""
        if tail is None:
            tail = mixed.new_zeros(self.kernel - 1, self.conv_dim)
        full = torch.cat([tail, mixed], dim=0)  # [K-1+n, C]
        out = depthwise_conv(full, *self._conv_weights())
        # the tail is copied: a view would keep the whole [K-1+n, C] input alive for as long as the state holds it
        return F.silu(out), full[full.shape[0] - (self.kernel - 1) :].clone()

    def _conv_weights(self) -> tuple[Tensor, Tensor | None]:
        """The depthwise conv's weight ``[C, K]`` and bias, read (``lora.effective_weight``) rather than called."""
        return effective_weight(self.mod.conv1d)[:, 0, :], base_module(self.mod.conv1d).bias

    def _gated_norm(self, core: Tensor, gate: Tensor) -> Tensor:
        """Qwen3.5's RMSNormGated: norm in compute precision, scale, then multiply by SiLU(gate)."""
        dt = compute_dtype(core.dtype)
        x = core.to(dt)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        x = self.mod.norm.weight * x.to(core.dtype)
        return (x * F.silu(gate.to(dt))).to(core.dtype)

    def _heads(self, mixed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The conv output ``[n, C]`` as q, k ``[n, H_v, D_k]`` (one per value head) and v ``[n, H_v, D_v]``."""
        mod, n = self.mod, mixed.shape[0]
        q, k, v = torch.split(mixed, [mod.key_dim, mod.key_dim, mod.value_dim], dim=-1)
        q = q.reshape(n, self.num_k_heads, self.head_k_dim)
        k = k.reshape(n, self.num_k_heads, self.head_k_dim)
        v = v.reshape(n, self.num_v_heads, self.head_v_dim)
        if self.num_v_heads != self.num_k_heads:  # each q/k head serves consecutive value heads
            rep = self.num_v_heads // self.num_k_heads
            q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
        return q, k, v

    def _gates(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The log decay g (<= 0) and the write strength beta ``[n, H_v]``, in compute precision."""
        mod, dt = self.mod, compute_dtype(x.dtype)
        a = mod.in_proj_a(x).to(dt)
        beta = mod.in_proj_b(x).sigmoid().to(dt)
        return -mod.A_log.to(dt).exp() * F.softplus(a + mod.dt_bias.to(dt)), beta

    def _output(self, x: Tensor, core: Tensor) -> Tensor:
        z = self.mod.in_proj_z(x).reshape(x.shape[0], self.num_v_heads, self.head_v_dim)
        out = self._gated_norm(core.to(x.dtype), z)
        return self.mod.out_proj(out.reshape(x.shape[0], -1))

    def forward(self, inp: MixerInput) -> MixerOutput:
        core, new_tail, new_ssm = self._recurrence(inp)
        return MixerOutput(y=self._output(inp.x, core), new=(new_tail, new_ssm))

    def state_entries(self, inp: MixerInput) -> tuple[Tensor, ...]:
        """The new conv tail and delta-rule state alone (no gated norm, no output projection)."""
        _, new_tail, new_ssm = self._recurrence(inp)
        return new_tail, new_ssm

    def _recurrence(self, inp: MixerInput) -> tuple[Tensor, Tensor, Tensor]:
        """The delta rule's output ``[n, H_v, D_v]`` (compute precision), the new conv tail and delta-rule state."""
        x = inp.x
        tail, ssm = inp.recurrent if inp.recurrent is not None else (None, None)
        mixed, new_tail = self._conv(self.mod.in_proj_qkv(x), tail)
        q, k, v = self._heads(mixed)
        g, beta = self._gates(x)
        dt = g.dtype
        core, new_ssm = delta_rule(q.to(dt), k.to(dt), v.to(dt), g, beta, ssm)
        return core, new_tail, new_ssm

    def decode(self, inp: DecodeInput) -> MixerOutput:
        """B members' states stepped at once (``inp.context.recurrent``: conv tails ``[B, K-1, C]`` and delta-rule
        states ``[B, H_v, D_k, D_v]``): members are independent, so they stack along the head dimension of one
        delta-rule call (``[1, B·H_v, ...]``); the conv runs over each member's ``[tail; new]`` window."""
        x, batch = inp.x, inp.x.shape[0]
        tails, states = inp.context.recurrent
        window = torch.cat([tails, self.mod.in_proj_qkv(x).unsqueeze(1)], dim=1)  # [B, K, C]
        weight, bias = self._conv_weights()
        conv = (window.transpose(1, 2) * weight).sum(dim=-1)
        if bias is not None:
            conv = conv + bias
        q, k, v = self._heads(F.silu(conv))
        g, beta = self._gates(x)
        dt = g.dtype
        q, k, v = (t.to(dt).reshape(1, batch * self.num_v_heads, t.shape[-1]) for t in (q, k, v))
        initial = states.reshape(-1, self.head_k_dim, self.head_v_dim)
        core, new_states = delta_rule(q, k, v, g.reshape(1, -1), beta.reshape(1, -1), initial)
        core = core.reshape(batch, self.num_v_heads, self.head_v_dim)
        new = (window[:, 1:], new_states.reshape(batch, self.num_v_heads, self.head_k_dim, self.head_v_dim))
        return MixerOutput(y=self._output(x, core), new=new)


class HybridAdapter(FamilyAdapter):
    family = "hybrid"
    model_types = ("qwen3_5_text",)

    def build_layers(self) -> list[DecoderLayer]:
        cfg = self.config
        layers = []
        for hf_layer in self.backbone.layers:
            if hf_layer.block_type == "linear_attention":
                mixer: Mixer = GatedDeltaNetMixer(hf_layer.linear_attn)
            else:
                mixer = AttentionMixer(
                    hf_layer.self_attn,
                    cfg.num_attention_heads,
                    cfg.num_key_value_heads,
                    hf_layer.self_attn.head_dim,
                    qk_norm=rms_norm_zero_centered,
                    output_gate=True,
                )
            layers.append(DecoderLayer.from_hf(hf_layer, mixer, rms_norm_zero_centered))
        return layers

    def rope(self, h: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        # the rotary table of Qwen3.5 takes one row of positions per grid axis (time, height, width), as its model
        # passes them; text sits at the same position on all three (transformers before 5.19 accepts only this form)
        cos, sin = self.backbone.rotary_emb(h.unsqueeze(0), positions.expand(3, 1, -1))
        return cos[0], sin[0]

    def final_norm(self, h: Tensor) -> Tensor:
        return rms_norm_zero_centered(h, self.backbone.norm.weight, norm_eps(self.backbone.norm))

    @classmethod
    def layer_state_bytes(cls, config: Any, itemsize: int) -> list[tuple[int, int]]:
        conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim + (
            config.linear_num_value_heads * config.linear_value_head_dim
        )
        conv_bytes = (config.linear_conv_kernel_dim - 1) * conv_dim * itemsize
        state_itemsize = max(itemsize, 4)  # the delta-rule state is kept in compute precision (>= fp32)
        delta_bytes = (
            config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * state_itemsize
        )
        sizes = []
        for layer_type in config.layer_types[: config.num_hidden_layers]:
            if layer_type == "linear_attention":
                sizes.append((0, conv_bytes + delta_bytes))
            else:
                sizes.append((kv_bytes_per_token(config, itemsize), 0))
        return sizes

    @classmethod
    def layer_work(cls, config: Any, new: int, earlier: int, itemsize: int) -> list[LayerWork]:
        attention = LayerWork(attention=attention_pair_flops(config) * causal_pairs(new, earlier))
        delta = LayerWork(recurrent=delta_rule_flops(config, new))  # its blocks' steps: in the scan's measured rate
        types = config.layer_types[: config.num_hidden_layers]
        return [delta if layer_type == "linear_attention" else attention for layer_type in types]

    @classmethod
    def state_parameters(cls, config: Any) -> tuple[str, ...]:
        if config.layer_types[config.num_hidden_layers - 1] != "linear_attention":
            return KEY_VALUE_PARAMETERS
        names = ("in_proj_qkv.weight", "in_proj_b.weight", "in_proj_a.weight", "conv1d.weight")
        return tuple(f"linear_attn.{name}" for name in names)
