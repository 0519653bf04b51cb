"""Hybrid family: Qwen3.5 text models — GatedDeltaNet linear attention + gated full attention (Qwen3.6-27B layout:
three linear-attention layers per full-attention layer).

Full-attention layers keep K/V per token (the dense mixer with a sigmoid output gate and zero-centred q/k norms).
GatedDeltaNet layers keep a fixed-size state: the short-conv tail (the last ``kernel-1`` pre-conv inputs) and the
delta-rule state ``[H_v, D_k, D_v]``. The delta rule runs chunked in pure torch in ``compute_dtype`` (transformers'
fallback always computes in fp32; here fp64 models stay fp64), or with flash-linear-attention's kernel on CUDA
when it is installed. The recurrent state is kept in compute precision, as transformers does.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
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
from longstraw_agents.models.dense import (
    KEY_VALUE_PARAMETERS,
    AttentionMixer,
    attention_pair_flops,
    kv_bytes_per_token,
)

DELTA_CHUNK = 64  # positions per block of the chunked delta rule (as transformers' fallback and fla)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None, chunk: int = DELTA_CHUNK
) -> tuple[Tensor, Tensor]:
    """Gated delta rule over ``n`` positions, exact and differentiable (also w.r.t. ``initial_state``).

    q, k: ``[n, H, Dk]`` (already one per value head); v: ``[n, H, Dv]``; g (log decay, <= 0), beta: ``[n, H]``.
    Returns the outputs ``[n, H, Dv]`` and the state after the last position ``[H, Dk, Dv]``. Same algorithm as
    transformers' ``torch_chunk_gated_delta_rule`` (UT transform within a chunk, a scan across chunks), written
    without a batch dimension and without in-place writes so autograd can replay it.
    """
    n, heads, dk = k.shape
    dv = v.shape[-1]
    chunk = min(chunk, n)  # short inputs (decoding) need no padding to a full block; the result is the same
    q = l2norm(q) * dk**-0.5
    k = l2norm(k)
    pad = (chunk - n % chunk) % chunk
    # [H, N, C, d]: zero padding has beta = 0 and g = 0, so it neither writes nor decays the state
    q, k, v = (F.pad(t.transpose(0, 1), (0, 0, 0, pad)).reshape(heads, -1, chunk, t.shape[-1]) for t in (q, k, v))
    beta, g = (F.pad(t.transpose(0, 1), (0, pad)).reshape(heads, -1, chunk) for t in (beta, g))
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    cum = g.cumsum(dim=-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair_decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pair_decay
    intra = (q @ k.transpose(-1, -2)) * pair_decay
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    state = initial_state if initial_state is not None else q.new_zeros(heads, dk, dv)
    outs = []
    for c in range(q.shape[1]):
        v_new = new_values[:, c] - k_cumdecay[:, c] @ state
        outs.append(q_decayed[:, c] @ state + intra[:, c] @ v_new)
        state = state * chunk_decay[:, c] + k_to_end[:, c].transpose(-1, -2) @ v_new
    out = torch.cat(outs, dim=1)[:, :n]  # [H, n, Dv]
    return out.transpose(0, 1), state


_FLA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The gated delta rule as the mixer runs it: fla's kernel on a GPU where it works (Triton: no fp64), else
    ``chunk_gated_delta_rule``."""
    fla = _fla_kernel(q.device) if q.is_cuda and q.dtype in _FLA_DTYPES else None
    if fla is not None:
        out, final = fla(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
            initial_state=None if initial is None else initial.unsqueeze(0),
            output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        return out[0], final[0]
    return chunk_gated_delta_rule(q, k, v, g, beta, initial)


_FLA_ON: dict[torch.device, Callable[..., Any] | None] = {}  # per device: fla's kernel, or None where it fails


def _fla_kernel(device: torch.device) -> Callable[..., Any] | None:
    """flash-linear-attention's ``chunk_gated_delta_rule`` where it is installed and runs a forward and a backward on
    ``device`` — fla refuses its backward on some Triton and GPU pairs (a wrong-results guard), and a training step
    must not fail there: the pure-torch delta rule runs instead, said once per device. Checked once per device."""
    if device not in _FLA_ON:
        _FLA_ON[device] = _working_fla(device)
    return _FLA_ON[device]


def _working_fla(device: torch.device) -> Callable[..., Any] | None:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    except ImportError:
        return None
    try:
        _fla_probe(fla_chunk, device)
    except Exception as err:  # whatever fla raises (its guards raise RuntimeError; Triton its own errors)
        warnings.warn(
            f"flash-linear-attention failed a forward and backward on {device}, so GatedDeltaNet layers run the "
            f"pure-torch delta rule there: {type(err).__name__}: {err}",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return fla_chunk


def _fla_probe(kernel: Callable[..., Any], device: torch.device, n: int = 2 * DELTA_CHUNK, dim: int = 64) -> None:
    """One forward and backward of ``kernel`` on a small random input (bf16, one head)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 1, dim, generator=gen).to(device, torch.bfloat16) for _ in range(3))
    g = -torch.rand(1, n, 1, generator=gen).to(device)
    beta = torch.rand(1, n, 1, generator=gen).to(device, torch.bfloat16)
    with torch.enable_grad():
        for t in (q, k, v):
            t.requires_grad_(True)
        out, _ = kernel(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
        out.float().sum().backward()


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
        # depthwise cross-correlation over windows of K positions (F.conv1d's fp64 CPU path is ~100x slower)
        windows = full.unfold(0, self.kernel, 1)  # [n, C, K]
        out = (windows * self.mod.conv1d.weight[:, 0, :]).sum(dim=-1)
        if self.mod.conv1d.bias is not None:
            out = out + self.mod.conv1d.bias
        # the tail is copied: a view would keep the whole [K-1+n, C] input alive for as long as the state holds it
        return F.silu(out), full[full.shape[0] - (self.kernel - 1) :].clone()

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
        conv = (window.transpose(1, 2) * self.mod.conv1d.weight[:, 0, :]).sum(dim=-1)
        if self.mod.conv1d.bias is not None:
            conv = conv + self.mod.conv1d.bias
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


def delta_rule_flops(config: Any, new: int, chunk: int = DELTA_CHUNK) -> int:
    """Forward FLOPs of ``chunk_gated_delta_rule`` over ``new`` positions (padded to whole blocks of ``chunk``), per
    value head and position: the block's two score products (``4 C dk``), its two triangular solves
    (``C (dk + dv)``), the intra-block output (``2 C dv``) and three products with the ``dk x dv`` state."""
    if new == 0:
        return 0
    block = min(chunk, new)
    padded = -(-new // block) * block
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    per_position = block * (5 * dk + 3 * dv) + 6 * dk * dv
    return config.linear_num_value_heads * padded * per_position
