"""A reference forward for GLM-MoE-DSA (MLA + DeepSeek sparse attention + MoE), written from the definition.

transformers 5.24's own DSA paths are not causally consistent when ``index_topk`` < context (its ``topk`` breaks
the many exact ties of the relu-gated index scores differently as the sequence grows), so tests of the engine
compare against this module instead. It reads the weights of a ``GlmMoeDsaForCausalLM`` straight from its
transformers modules and shares no code with ``longstraw_agents``. Everything is a plain full-sequence forward:

- MLA is written the non-absorbed way, as the paper writes it: the KV latent is expanded per head with
  ``kv_b_proj`` into keys ``[k_nope, k_rope]`` and values; the rope key is shared by all heads.
- DSA: on layers with their own indexer (``indexer_types[i] == "full"``) query t scores each visible key s with
  ``Σ_h w_h(t) · relu(q_h(t)·k(s) · softmax_scale)`` and attends to its ``index_topk`` best keys only (all of them
  while it sees fewer); ties go to the earlier position. "shared" layers reuse the previous full layer's selection.
- MoE: sigmoid router, group-limited top-k choice on the bias-corrected scores, weights from the uncorrected
  scores, routed experts plus the shared experts.

Precision: norms, router, indexer and softmax run in ``max(dtype, fp32)`` — like transformers in fp32 and bf16,
but never downcast an fp64 model (transformers computes those parts in fp32, so fp64 parity with it bottoms out
near 1e-7).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision of norms, router, indexer and softmax: fp32, or the model's dtype when that is wider."""
    return torch.promote_types(dtype, torch.float32)


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def rms_norm(x: Tensor, norm: nn.Module) -> Tensor:
    """RMSNorm: normalise in wide precision, cast back, then scale by the norm's weight."""
    wide = x.to(wide_dtype(x.dtype))
    wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * wide.to(x.dtype)


def rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [n, H, D]`` in the interleaved pairs (x0, x1), (x2, x3), … by the per-pair angles.

    ``cos``/``sin`` are ``[n, D]`` as the rotary embedding returns them (``cat(freqs, freqs)``): the first half
    holds one angle per pair. The output is laid out as transformers' ``apply_rotary_pos_emb_interleave`` lays it
    out — rotated evens, then rotated odds — which only permutes dimensions shared by queries and keys.
    """
    half = x.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


def causal_visibility(n: int, device: torch.device) -> Tensor:
    """``[n, n]`` boolean: query t sees key s iff s <= t."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


# --- DSA -------------------------------------------------------------------------------------------------------
def index_scores(indexer: nn.Module, x: Tensor, q_resid: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The lightning indexer's ``[n, n]`` scores ``Σ_h w_h(t) · relu(q_h(t)·k(s) · softmax_scale)``, in wide
    precision; keys after the query are -inf. Index queries and keys are ``[rope part, pass part]`` with
    interleaved RoPE on the rope part."""
    n, heads, dim, rope_dim = x.shape[0], indexer.n_heads, indexer.head_dim, indexer.qk_rope_head_dim
    dt = wide_dtype(x.dtype)

    q = indexer.wq_b(q_resid).view(n, heads, dim)
    k = indexer.k_norm(indexer.wk(x)).view(n, 1, dim)
    q = torch.cat([rope_interleaved(q[..., :rope_dim], cos, sin), q[..., rope_dim:]], dim=-1).to(dt)
    k = torch.cat([rope_interleaved(k[..., :rope_dim], cos, sin), k[..., rope_dim:]], dim=-1)[:, 0].to(dt)

    per_head = F.relu(torch.einsum("thd,sd->ths", q, k) * indexer.softmax_scale)
    head_weights = F.linear(x.to(dt), indexer.weights_proj.weight.to(dt)) * heads**-0.5  # [n, H]
    scores = torch.einsum("th,ths->ts", head_weights, per_head)
    # + 0.0 turns -0.0 (a negative head weight times relu's 0) into +0.0, so every exact zero ties with every other
    return (scores + 0.0).masked_fill(~causal_visibility(n, x.device), float("-inf"))


def select_keys(scores: Tensor, topk: int) -> Tensor:
    """``[n, n]`` boolean: each query's ``topk`` highest-scoring visible keys (all of them when it sees fewer).

    A stable descending sort ranks equal scores by position, so ties go to the earlier key. Invisible keys score
    -inf and rank after every visible one, so the final causal AND only drops them when a query sees < topk keys.
    """
    n = scores.shape[0]
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=scores.device).expand(n, n))
    return (rank < topk) & causal_visibility(n, scores.device)


# --- MLA -------------------------------------------------------------------------------------------------------
def mla_attention(attn: nn.Module, x: Tensor, q_resid: Tensor, cos: Tensor, sin: Tensor, visible: Tensor) -> Tensor:
    """Multi-head latent attention, non-absorbed: each query attends to the keys ``visible [n, n]`` marks."""
    n, heads = x.shape[0], attn.config.num_attention_heads
    nope, rope_dim, v_dim, rank = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim, attn.kv_lora_rank

    q = attn.q_b_proj(q_resid).view(n, heads, nope + rope_dim)
    q = torch.cat([q[..., :nope], rope_interleaved(q[..., nope:], cos, sin)], dim=-1)

    latent, k_rope = attn.kv_a_proj_with_mqa(x).split([rank, rope_dim], dim=-1)
    kv = attn.kv_b_proj(rms_norm(latent, attn.kv_a_layernorm)).view(n, heads, nope + v_dim)
    k_nope, v = kv.split([nope, v_dim], dim=-1)
    k_rope = rope_interleaved(k_rope.view(n, 1, rope_dim), cos, sin).expand(n, heads, rope_dim)
    k = torch.cat([k_nope, k_rope], dim=-1)

    scores = torch.einsum("thd,shd->hts", q, k) * attn.scaling
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = scores.softmax(dim=-1, dtype=wide_dtype(x.dtype)).to(x.dtype)
    out = torch.einsum("hts,shv->thv", probs, v).reshape(n, heads * v_dim)
    return attn.o_proj(out)


# --- MoE -------------------------------------------------------------------------------------------------------
def route(gate: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    """Group-limited top-k routing: ``(experts [n, k], weights [n, k])``.

    Experts are chosen on sigmoid scores + ``e_score_correction_bias`` within the ``topk_group`` groups whose two
    best corrected scores sum highest; the weights are the uncorrected scores of the chosen experts.
    """
    dt = wide_dtype(x.dtype)
    scores = F.linear(x.to(dt), gate.weight.to(dt)).sigmoid()
    for_choice = scores + gate.e_score_correction_bias.to(dt)
    grouped = for_choice.view(x.shape[0], gate.num_group, -1)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    best_groups = group_scores.topk(gate.topk_group, dim=-1).indices
    in_best_group = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    for_choice = grouped.masked_fill(~in_best_group[..., None], float("-inf")).flatten(1)
    experts = for_choice.topk(gate.top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if gate.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return experts, weights * gate.routed_scaling_factor


def moe(mlp: nn.Module, x: Tensor) -> Tensor:
    """Routed experts (a gated MLP each, weighted by the router) plus the shared experts."""
    experts, weights = route(mlp.gate, x)
    routed = mlp.experts
    gate, up = torch.einsum("nkfd,nd->nkf", routed.gate_up_proj[experts], x).chunk(2, dim=-1)
    expert_out = torch.einsum("nkdf,nkf->nkd", routed.down_proj[experts], routed.act_fn(gate) * up)
    return torch.einsum("nk,nkd->nd", weights.to(x.dtype), expert_out) + mlp.shared_experts(x)


def feed_forward(mlp: nn.Module, x: Tensor) -> Tensor:
    return moe(mlp, x) if hasattr(mlp, "experts") else mlp(x)


# --- the model -------------------------------------------------------------------------------------------------
def reference_logits(model: nn.Module, ids: Tensor) -> Tensor:
    """Logits ``[n, V]`` of a ``GlmMoeDsaForCausalLM`` over the whole sequence ``ids [n]``, in the model's dtype."""
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"ids must be a non-empty 1-D tensor, got shape {tuple(ids.shape)}")
    config, backbone = model.config, model.model
    n = ids.shape[0]
    h = backbone.embed_tokens(ids)
    cos, sin = (t[0] for t in backbone.rotary_emb(h[None], torch.arange(n, device=ids.device)[None]))

    selected: Tensor | None = None
    for i, layer in enumerate(backbone.layers):
        attn = layer.self_attn
        x = rms_norm(h, layer.input_layernorm)
        q_resid = rms_norm(attn.q_a_proj(x), attn.q_a_layernorm)
        if config.indexer_types[i] == "full":
            selected = select_keys(index_scores(attn.indexer, x, q_resid, cos, sin), config.index_topk)
        elif selected is None:
            raise ValueError(f"layer {i} is a 'shared' DSA layer but no earlier layer runs its own indexer")
        h = h + mla_attention(attn, x, q_resid, cos, sin, selected)
        h = h + feed_forward(layer.mlp, rms_norm(h, layer.post_attention_layernorm))
    return model.lm_head(rms_norm(h, backbone.norm))
