"""The model configs a plan plans: named ones (``NAMED_MODELS``), a transformers ``config.json``, or a run's own;
cut to a few layers (``layer_period``: the special head and the period the rest repeats) and built on the meta
device (``meta_model``), where tensors have shapes and sizes but no storage.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from longstraw_agents.models.lora import LoraSpec, apply_lora
from longstraw_agents.models.presets import TINY_PRESETS, glm_5_2_like, qwen3_6_27b_like
from longstraw_agents.plan.shape import model_problem

NAMED_MODELS: dict[str, Callable[[], PretrainedConfig]] = {
    "qwen3.6-27b": qwen3_6_27b_like,
    "glm-5.2": glm_5_2_like,
    **{f"tiny-{name}": fn for name, fn in TINY_PRESETS.items()},
}
PER_LAYER_LISTS = ("layer_types", "indexer_types", "mlp_layer_types")


def load_config(model: str | PretrainedConfig) -> PretrainedConfig:
    """The config of a model named in ``NAMED_MODELS``, or of a transformers ``config.json`` (or a folder with one);
    a config itself as it is (a run's: ``PlanRequest.of_job``)."""
    if isinstance(model, PretrainedConfig):
        return model
    if model in NAMED_MODELS:
        return NAMED_MODELS[model]()
    problem = model_problem(model, NAMED_MODELS)
    if problem is not None:
        raise ValueError(problem)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    data = json.loads(path.read_text())
    return AutoConfig.for_model(data.pop("model_type"), **data)


def layer_kinds(config: PretrainedConfig) -> list[tuple[Any, ...]]:
    """Per layer, what distinguishes it (attention kind, indexer kind, MLP kind)."""
    lists = [getattr(config, name, None) or [None] * config.num_hidden_layers for name in PER_LAYER_LISTS]
    dense = getattr(config, "first_k_dense_replace", 0) or 0
    return [(*(lst[i] for lst in lists), i < dense) for i in range(config.num_hidden_layers)]


def layer_period(config: PretrainedConfig) -> tuple[int, int]:
    """``(head, period)``: the first ``head`` layers are special, the rest repeat every ``period`` layers."""
    kinds = layer_kinds(config)
    n = len(kinds)
    for head in range(n):
        tail = kinds[head:]
        for period in range(1, max(len(tail) // 2, 1) + 1):
            if all(tail[i] == tail[i % period] for i in range(len(tail))):
                return head, period
    return 0, n


def with_layers(config: PretrainedConfig, layers: int) -> PretrainedConfig:
    """The config cut to its first ``layers`` layers."""
    data = config.to_dict()
    data["num_hidden_layers"] = layers
    for name in PER_LAYER_LISTS:
        if data.get(name):
            data[name] = data[name][:layers]
    return type(config)(**data)


def meta_model(config: PretrainedConfig, dtype: torch.dtype, lora: LoraSpec | None = None) -> Any:
    """A transformers CausalLM of ``config`` on the meta device (no storage), with ``lora``'s adapters."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
        )
    model = model.to(dtype)
    return apply_lora(model, lora) if lora is not None else model


def routed_experts(layer: Any) -> int:
    """A decoder layer's routed experts' parameters (``mlp.experts``: 0 for a dense MLP)."""
    return sum(p.numel() for name, p in layer.named_parameters() if name.startswith("mlp.experts."))


def is_mixture_of_experts(config: PretrainedConfig) -> bool:
    """Whether ``config``'s model has routed experts (``mlp.experts``), found on its first layer period (meta)."""
    head, period = layer_period(config)
    cut = with_layers(config, min(head + period, config.num_hidden_layers))
    return any(routed_experts(layer) for layer in meta_model(cut, torch.bfloat16).model.layers)
