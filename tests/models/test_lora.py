"""LoRA through PEFT (``models/lora.py``): the weights the engine reads see the adapters, the settings it cannot train
are refused in one line, and the merged and saved forms are PEFT's.

Adapters are drawn random (``init=False``: B ≠ 0), so that an engine path that bypassed one would change the logits.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import Tensor, nn

from longstraw_agents.engine import Engine
from longstraw_agents.models.lora import (
    LoraSpec,
    LoraTargetError,
    apply_lora,
    check_same_settings,
    effective_weight,
    lora_layers,
    lora_settings,
    merged_copy,
    merged_tensors,
    save_adapter,
)
from longstraw_agents.models.presets import tiny_model

VOCAB = 256


@functools.cache
def base(family: str) -> nn.Module:
    return tiny_model(family, dtype=torch.float64)


def adapted(family: str, **spec) -> nn.Module:
    torch.manual_seed(0)
    return apply_lora(copy.deepcopy(base(family)), LoraSpec(**spec), init=False)


def ids(n: int = 24, seed: int = 0) -> Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def engine_logits(model: nn.Module, tokens: Tensor) -> Tensor:
    engine = Engine(model, chunk_size=8)
    with torch.no_grad():
        return engine.logits(engine.capture(tokens[:-5]), tokens[-5:])


# --- what the engine reads ------------------------------------------------------------------------------------------
# every kind of read: called projections, MLA's absorbed kv_b_proj, the MoE's router and stacked experts (PEFT's
# target_parameters, which "all-linear" gives on glm_moe_dsa), the LM head, the embeddings
READS = [
    ("llama", "all-linear"),
    ("llama", ["lm_head", "embed_tokens", "v_proj"]),
    ("qwen3_5", "all-linear"),  # the GatedDeltaNet projections (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj)
    ("glm_moe_dsa", "all-linear"),  # MLA's projections, the indexer's, the router and the routed experts
    ("glm_moe_dsa", ["kv_b_proj"]),
]


@pytest.mark.parametrize(("family", "targets"), READS, ids=lambda v: v if isinstance(v, str) else "+".join(v))
def test_engine_computes_as_the_merged_model(family: str, targets):
    """The engine over the adapted model equals the engine over PEFT's merge of it (plain transformers modules, no
    adapter code on the engine's side), in fp64, and the adapters change the logits."""
    model = adapted(family, r=4, alpha=8, target_modules=targets)
    tokens = ids()
    logits = engine_logits(model, tokens)
    assert torch.allclose(logits, engine_logits(merged_copy(model), tokens), rtol=0, atol=1e-12)
    assert (logits - engine_logits(base(family), tokens)).abs().max() > 1e-2


def test_the_peft_forward_is_the_reference_too():
    """transformers' own forward through PEFT's wrappers (fp32 norms and rotary: 1e-6 in fp64) gives the engine's
    logits: the merge is not a shared mistake."""
    model = adapted("llama", r=4, target_modules=["q_proj", "v_proj", "lm_head"])
    tokens = ids()
    with torch.no_grad():
        expected = model(tokens.unsqueeze(0)).logits[0, -5:]
    assert torch.allclose(engine_logits(model, tokens), expected, rtol=0, atol=1e-6)


def test_effective_weight_of_a_plain_module_is_its_weight():
    linear = nn.Linear(3, 2)
    assert effective_weight(linear) is linear.weight


def test_only_the_adapters_train():
    model = adapted("qwen3_5", r=2, target_modules=["in_proj_qkv", "out_proj"])
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in name for name in trained)
    assert len(trained) == 2 * 2 * 3  # A and B of two projections on the 3 GatedDeltaNet layers


# --- refused in one line ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("family", "spec", "said"),
    [
        ("llama", {"target_modules": ["q_proj", "qkv_proj"]}, "'qkv_proj' matches no module"),
        ("qwen3_5", {"target_modules": ["conv1d"]}, r"grouped \(depthwise\) convolution"),
        ("glm_moe_dsa", {"target_modules": ["kv_b_proj"], "dropout": 0.1}, "dropout on its input cannot apply"),
        ("llama", {"target_modules": ["input_layernorm"]}, "PEFT refuses"),
        ("qwen3", {"target_modules": ["lm_head"]}, "tied to another module's"),
    ],
    ids=["no-match", "depthwise-conv", "dropout-on-a-read-weight", "not-adaptable", "tied-head"],
)
def test_refused_in_one_line(family: str, spec: dict, said: str):
    with pytest.raises(LoraTargetError, match=said) as caught:
        apply_lora(copy.deepcopy(base(family)), LoraSpec(**spec))
    assert "\n" not in str(caught.value)


def test_settings_must_match_to_resume():
    model = adapted("llama", r=4, target_modules=["q_proj"])
    saved = lora_settings(model)
    check_same_settings(saved, model)
    for other, said in [
        (adapted("llama", r=2, target_modules=["q_proj"]), "differ from the model's"),
        (adapted("llama", r=4, alpha=4, target_modules=["q_proj"]), "alpha=4"),
        (adapted("llama", r=4, target_modules=["k_proj"]), "the first model.layers.0.self_attn.k_proj"),
        (base("llama"), "the model is without LoRA"),
    ]:
        with pytest.raises(LoraTargetError, match=said) as caught:
            check_same_settings(saved, other)
        assert "\n" not in str(caught.value)


# --- merged and saved forms -------------------------------------------------------------------------------------------
def test_merged_tensors_are_the_merged_models_state():
    """What a served policy is pushed (the adapters merged a part at a time, over tensors rather than the modules'
    own parameters) is the merged model's state, under transformers' names."""
    model = adapted("glm_moe_dsa", r=4, target_modules="all-linear")
    expected = merged_copy(model).state_dict()
    tensors = {name: t.detach().clone() for name, t in model.state_dict().items()}
    merged = merged_tensors(model, tensors)
    assert merged.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.allclose(merged[name], tensor, rtol=0, atol=1e-14), name


def test_saved_adapter_loads_into_peft(tmp_path):
    """``save_adapter`` writes PEFT's format: ``PeftModel.from_pretrained`` over the base computes as the policy."""
    from peft import PeftModel

    model = adapted("llama", r=4, target_modules=["q_proj", "down_proj"])
    save_adapter(model, tmp_path, base_model=None)
    assert {p.name for p in tmp_path.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    loaded = PeftModel.from_pretrained(copy.deepcopy(base("llama")), tmp_path)
    tokens = ids().unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)
    assert len(lora_layers(loaded)) == len(lora_layers(model))
