"""LoRA policies in every mode: the gradient of every adapter parameter equals, in fp64, the one a full-graph reference
of the same model gives, on three families; the optimizer holds the adapters' state only; checkpoints keep and resume
the adapters alone.

The reference never runs adapter code on the engine's side: PEFT merges the adapters into a copy of the model
(``W' = W + s·B A``: plain transformers modules), the trainer's naive mode (one full graph per member over its whole
sequence) gives dL/dW' on it, and the adapters' gradients follow by the chain rule through PEFT's own
``get_delta_weight``. Exact mode must equal it; detached mode must equal detached mode on the merged copy (the same
chain rule). Each LoRA target reads its weight one way or another (called projections, MLA's absorbed ``kv_b_proj``,
the MoE router and stacked experts, the LM head, the embeddings), so a path that bypassed an adapter would differ.
"""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch
from torch import Tensor, nn

from longstraw_agents.models.lora import ADAPTER, LoraSpec, LoraTargetError, apply_lora, lora_layers, merged_copy
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.trainer import GRPOConfig, GRPOTrainer, LossConfig, grpo_backward

VOCAB = 256
CHUNK = 8
PROMPT_LEN = 30  # 4 chunks of context, so that exact mode's walk crosses chunk boundaries
TOL = 1e-10  # fp64, relative L2 over all adapter gradients

# three families, each with adapters on what it reads as weights: llama's LM head and embeddings; Qwen3.5's
# GatedDeltaNet projections (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj) and gated attention; GLM's MLA
# projections (kv_b_proj absorbed), indexer, router and routed experts ("all-linear" there: PEFT's target_parameters)
CASES = {
    "llama": ["q_proj", "v_proj", "down_proj", "lm_head", "embed_tokens"],
    "qwen3_5": "all-linear",
    "glm_moe_dsa": "all-linear",
}


@functools.cache
def policy(family: str) -> nn.Module:
    """A tiny fp64 model with random adapters (B ≠ 0: each adapter acts)."""
    torch.manual_seed(0)
    model = tiny_model(family, dtype=torch.float64)
    return apply_lora(model, LoraSpec(r=4, alpha=8, target_modules=CASES[family]), init=False)


@functools.cache
def merged(family: str) -> nn.Module:
    return merged_copy(policy(family))


def group(seed: int = 0) -> tuple[Tensor, list[Tensor], list[float]]:
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=gen)
    completions = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (4, 6, 3)]
    return prompt, completions, [1.0, 0.0, 0.5]


def gradients(model: nn.Module, mode: str) -> tuple[float, dict[str, Tensor]]:
    """The group's loss and every parameter's gradient (zeros where autograd left none: an indexer)."""
    model.zero_grad(set_to_none=True)
    prompt, completions, rewards = group()
    config = LossConfig(epsilon=0.2, beta=0.0)
    stats = grpo_backward(model, prompt, completions, rewards, mode=mode, config=config, chunk_size=CHUNK)
    grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
    return stats.loss, {n: g for n, g in grads.items() if dict(model.named_parameters())[n].requires_grad}


def adapter_grads_by_chain_rule(model: nn.Module, weight_grads: dict[str, Tensor]) -> dict[str, Tensor]:
    """dL/d(adapter) from dL/dW' of the merged weights: the vector-Jacobian product of PEFT's delta weight."""
    model.zero_grad(set_to_none=True)
    deltas, upstream = [], []
    for name, layer in lora_layers(model).items():
        weight = f"{name}.{getattr(layer, 'parameter_name', 'weight')}".replace(".base_layer", "")
        deltas.append(layer.get_delta_weight(ADAPTER))
        upstream.append(weight_grads[weight])
    torch.autograd.backward(deltas, upstream)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def relative_l2(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> float:
    assert actual.keys() == expected.keys()
    num = sum(float((actual[k] - expected[k]).pow(2).sum()) for k in expected)
    return (num / sum(float(expected[k].pow(2).sum()) for k in expected)) ** 0.5


@pytest.mark.parametrize("family", list(CASES))
@pytest.mark.parametrize(("mode", "reference_mode"), [("exact", "naive"), ("detached", "detached")])
def test_adapter_gradients_equal_the_full_graph_reference(family: str, mode: str, reference_mode: str):
    model = policy(family)
    loss, grads = gradients(model, mode)
    reference_loss, weight_grads = gradients(merged(family), reference_mode)
    expected = adapter_grads_by_chain_rule(model, weight_grads)
    assert all(".lora_" in name for name in grads)
    assert relative_l2(grads, expected) <= TOL
    assert loss == pytest.approx(reference_loss, rel=1e-12)
    # every adapter reached by the loss has a gradient (the indexer's are discrete: none, as for full weights)
    reached = [n for n, g in grads.items() if ".indexer." not in n]
    assert all(grads[n].abs().max() > 0 for n in reached)


def test_exact_mode_differs_from_detached_on_adapters():
    """Guards the equality above: the layers' adapters take a gradient through the context that is not negligible."""
    _, exact = gradients(policy("llama"), "exact")
    _, detached = gradients(policy("llama"), "detached")
    layers = [name for name in exact if ".layers." in name]
    assert relative_l2({n: detached[n] for n in layers}, {n: exact[n] for n in layers}) > 1e-2


# --- the trainer ------------------------------------------------------------------------------------------------------
def lora_model(r: int = 4, alpha: int = 8, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = tiny_model("llama", dtype=torch.float64)
    return apply_lora(model, LoraSpec(r=r, alpha=alpha, target_modules=["q_proj", "v_proj"]))


def config() -> GRPOConfig:
    return GRPOConfig(group_size=3, mode="exact", chunk_size=CHUNK, lr=1e-2, max_grad_norm=None)


def train_step(trainer: GRPOTrainer, seed: int = 0) -> None:
    prompt, completions, rewards = group(seed)
    trainer.train_step([trainer.group_from_completions(prompt, completions, rewards)])


def test_the_optimizer_holds_adapter_state_only():
    model = lora_model()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer = GRPOTrainer(model, config())
    train_step(trainer)
    held = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for p in model.parameters() if p.requires_grad}
    assert set(map(id, trainer.optimizer.state)) == held  # AdamW's moments for the adapters alone
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], t) for n, t in frozen.items())
    assert any(not torch.equal(params[n], t) for n, t in adapters.items())  # B starts at 0: A's gradient is 0


def test_checkpoints_keep_and_resume_the_adapters(tmp_path):
    trainer = GRPOTrainer(lora_model(), config())
    train_step(trainer)
    trainer.save_checkpoint(tmp_path / "ckpt")
    train_step(trainer, seed=1)
    after_two = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    saved = json.loads((tmp_path / "ckpt" / "trainer_state.json").read_text())
    assert saved["lora"]["r"] == 4 and saved["lora"]["adapted"][0] == "model.layers.0.self_attn.q_proj"
    metadata = torch.distributed.checkpoint.FileSystemReader(str(tmp_path / "ckpt" / "sharded")).read_metadata()
    weights = [k for k in metadata.state_dict_metadata if k.startswith("model.") and k.endswith("weight")]
    assert weights and all(".lora_" in k for k in weights)  # no frozen weight written

    resumed = GRPOTrainer(lora_model(seed=1), config())  # other adapters drawn: the checkpoint's replace them
    resumed.load_checkpoint(tmp_path / "ckpt")
    train_step(resumed, seed=1)
    for name, param in resumed.model.named_parameters():
        assert torch.equal(param, after_two[name]), name  # bit-identical to the uninterrupted run


@pytest.mark.parametrize(
    ("model", "said"),
    [
        (lambda: lora_model(r=2), "differ from the model's"),
        (lambda: lora_model(alpha=4), "alpha=4"),
        (lambda: tiny_model("llama", dtype=torch.float64), "the model is without LoRA"),
    ],
    ids=["rank", "alpha", "no-lora"],
)
def test_a_resume_across_other_lora_settings_fails_in_one_line(tmp_path, model, said: str):
    trainer = GRPOTrainer(lora_model(), config())
    trainer.save_checkpoint(tmp_path / "ckpt")
    other = GRPOTrainer(model(), config())
    with pytest.raises(LoraTargetError, match=said) as caught:
        other.load_checkpoint(tmp_path / "ckpt")
    assert "\n" not in str(caught.value)


def test_exact_mode_refuses_dropout():
    torch.manual_seed(0)
    model = apply_lora(tiny_model("llama"), LoraSpec(r=2, target_modules=["q_proj"], dropout=0.1))
    with pytest.raises(LoraTargetError, match="with mode 'exact'"):
        GRPOTrainer(model, config())
    GRPOTrainer(copy.deepcopy(model), config().model_copy(update={"mode": "detached"}))
