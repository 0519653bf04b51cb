"""Typed model presets: tiny random-init configs for tests, benchmarks and the CPU demo, and full-size layouts
(Qwen3.6-27B-like, GLM-5.2-like) to build on the meta device for the state-size planner.

Nothing here downloads weights; every model is built from its config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import torch
from transformers import (
    GlmMoeDsaConfig,
    LlamaConfig,
    PretrainedConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
)
from transformers.modeling_outputs import CausalLMOutputWithPast

Family = Literal["llama", "qwen3", "qwen3_5", "glm_moe_dsa"]


def tiny_llama(vocab_size: int = 256, hidden: int = 64, layers: int = 2, rope_theta: float = 10_000.0) -> LlamaConfig:
    """rope_theta: RoPE's base; long-context models raise it (Qwen3: 1e6) so that a head can match content
    thousands of positions back, where the default base's low frequencies have turned by radians."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1 << 20,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
    )


def tiny_qwen3(vocab_size: int = 256, hidden: int = 64, layers: int = 2) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1 << 20,
        tie_word_embeddings=True,
    )


def hybrid_layer_types(layers: int, interval: int = 4) -> list[str]:
    """Qwen3.5 / Qwen3.6's layout: every ``interval``-th layer is full attention, the others GatedDeltaNet."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]


def tiny_qwen3_5(vocab_size: int = 256, hidden: int = 64, layers: int = 4) -> Qwen3_5TextConfig:
    """Three GatedDeltaNet layers per full-attention layer, as in Qwen3.6-27B."""
    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        max_position_embeddings=1 << 20,
        layer_types=hybrid_layer_types(layers),
        tie_word_embeddings=False,
    )


def tiny_glm_moe_dsa(vocab_size: int = 256, hidden: int = 64, layers: int = 3, index_topk: int = 8) -> GlmMoeDsaConfig:
    """MLA + DSA (a full indexer then a shared one) + MoE after one dense layer, as in GLM-5.2."""
    return GlmMoeDsaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        index_topk=index_topk,
        index_head_dim=16,
        index_n_heads=2,
        first_k_dense_replace=1,
        indexer_types=["full"] + ["shared" if i % 2 else "full" for i in range(1, layers)],
        max_position_embeddings=1 << 20,
        tie_word_embeddings=False,
    )


TINY_PRESETS: dict[str, Callable[..., PretrainedConfig]] = {
    "llama": tiny_llama,
    "qwen3": tiny_qwen3,
    "qwen3_5": tiny_qwen3_5,
    "glm_moe_dsa": tiny_glm_moe_dsa,
}


def qwen3_6_27b_like() -> Qwen3_5TextConfig:
    """The Qwen3.6-27B text layout (64 layers, 3 GatedDeltaNet : 1 gated attention)."""
    return Qwen3_5TextConfig(
        vocab_size=248320,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        layer_types=hybrid_layer_types(64),
        max_position_embeddings=262144,
    )


def glm_5_2_like() -> GlmMoeDsaConfig:
    """The GLM-5 layout transformers ships as GlmMoeDsaConfig's defaults (78 layers, MLA + DSA + 256 experts)."""
    return GlmMoeDsaConfig()


def build_model(config: PretrainedConfig, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """A random-init CausalLM for ``config`` (eager attention and experts, so any dtype runs on CPU)."""
    from transformers import AutoModelForCausalLM

    # transformers initialises weights from torch's global generator: seed it for this call only, so that building
    # a model neither depends on nor changes anyone else's random state
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
        )
    # transformers keeps some modules in fp32 whatever the dtype (MoE router weights); cast them too so that an
    # fp64 model is fp64 throughout and fp64 gradient checks are not capped at fp32 precision.
    return model.to(dtype).eval()


# The name under which a transformers forward takes and returns its cache: ``cache`` from transformers 5.24,
# ``past_key_values`` before. A forward drops an unknown keyword into its ``**kwargs`` without a word, so the other
# name would run it from position 0 with no cache.
CACHE_KEYWORD = (
    "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"
)


def forward_with_cache(model: torch.nn.Module, ids: torch.Tensor, cache: Any, **kwargs: Any) -> Any:
    """transformers' incremental forward: ``model(ids)`` continuing from ``cache`` (which it extends in place)."""
    return model(ids, **{CACHE_KEYWORD: cache}, **kwargs)


def returned_cache(output: Any) -> Any:
    """The cache a transformers forward run with ``use_cache=True`` returns."""
    return getattr(output, CACHE_KEYWORD)


def tiny_model(family: Family, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides) -> torch.nn.Module:
    return build_model(TINY_PRESETS[family](**overrides), dtype=dtype, seed=seed)
