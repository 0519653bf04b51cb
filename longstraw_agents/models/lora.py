"""LoRA policies through PEFT: adapters injected into a transformers CausalLM, and the adapted weights wherever the
engine reads a weight instead of calling its module.

``apply_lora`` injects PEFT's LoRA layers into the model in place (``peft.inject_adapter_in_model``: the model stays
the transformers CausalLM the engine takes, its targets wrapped) and leaves only the adapters trainable. Most targets
are modules the engine calls (the attention and MLP projections): PEFT's wrapper computes ``W x + s·B A x`` there.
Some weights the engine reads itself, and each such read goes through ``effective_weight`` (or, for the routed
experts, ``low_rank_factors``), so that it sees ``W + s·B A`` exactly as the wrapper's forward does:

- MLA's up-projection ``kv_b_proj``, absorbed into the queries and the output (``models.mla``);
- the MoE router's ``gate.weight`` and the routed experts' stacked ``gate_up_proj`` / ``down_proj``, which PEFT adapts
  as parameters (``target_parameters``: on glm_moe_dsa, transformers v5's conversion maps PEFT's ``gate``,
  ``gate_proj``, ``up_proj`` and ``down_proj`` targets there): the experts' adapters run as two more grouped products
  per projection, ``x A_eᵀ`` then ``B_e``, never a materialised ``W_e + s·B_e A_e``;
- the LM head the loss reads in tiles (``trainer.head``).

Refused in one line (``LoraTargetError``): a target that matches no module, a module PEFT cannot adapt, GatedDeltaNet's
depthwise ``conv1d`` (PEFT's adapter on a grouped convolution is a dense convolution, not a change of its weight: it
can be neither read as a weight nor merged), and dropout on a target whose weight is read (dropout acts on a module's
input, which a weight read has no hold of). Exact mode refuses dropout altogether (``check_exact``): its reverse
walk recomputes the context's chunks, which would draw other dropout masks than the capture did.
"""

from __future__ import annotations

import copy
import json
import re
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

ADAPTER = "default"  # PEFT's name for the one adapter a policy has
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # how PeftModel.save_pretrained names a CausalLM's adapter tensors

# modules whose weight the engine (or the loss) reads instead of calling them: dropout on their input cannot apply
READ_AS_WEIGHTS = ("kv_b_proj", "mlp.gate", "mlp.experts", "lm_head")


class LoraTargetError(ValueError):
    """A LoRA setting the engine cannot train as PEFT defines it (the message names the setting and why)."""


class LoraSpec(BaseModel):
    """LoRA adapters on the policy (PEFT's ``LoraConfig``): only they train; the model's own weights stay frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    r: int = Field(8, ge=1, description="the adapters' rank")
    alpha: int = Field(16, ge=1, description="scaling numerator: an adapter adds (alpha / r)·B A to its weight")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="module names (each matches modules whose name is it or ends with '.' + it), or 'all-linear' "
        "(every linear layer but the LM head, PEFT's shorthand)",
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on an adapter's input (not with exact mode)")

    def peft_config(self, init: bool = True) -> Any:
        """PEFT's ``LoraConfig`` of these settings. ``init``: PEFT's ``init_lora_weights`` (True: B = 0, so the
        adapted model starts as the base; False: both random, for tests that must see the adapters act)."""
        from peft import LoraConfig

        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            target_modules=targets,
            lora_dropout=self.dropout,
            init_lora_weights=init,
        )


def apply_lora(model: nn.Module, spec: LoraSpec, init: bool = True) -> nn.Module:
    """Inject ``spec``'s adapters into ``model`` (a transformers CausalLM, changed in place and returned): every
    parameter but the adapters' is frozen. Raises ``LoraTargetError`` for what the engine cannot train."""
    from peft import inject_adapter_in_model

    if lora_layers(model):
        raise LoraTargetError("the model has LoRA adapters already; apply_lora injects one adapter into a base model")
    _check_targets_match(model, spec)
    try:
        with warnings.catch_warnings():
            # transformers v5's conversion of MoE targets sets rank and alpha patterns for gate_up_proj that PEFT then
            # matches against modules only, and says so; the experts' adapters keep the spec's r and alpha
            warnings.filterwarnings("ignore", message=r"The following (rank|alpha)_pattern keys did not match")
            inject_adapter_in_model(spec.peft_config(init), model, adapter_name=ADAPTER)
    except (ValueError, TypeError, NotImplementedError) as err:
        raise LoraTargetError(f"model.lora: PEFT refuses these settings: {_first_line(err)}") from None
    _check_adapted(model, spec)
    return model


def _check_targets_match(model: nn.Module, spec: LoraSpec) -> None:
    """Each named target matches at least one module (PEFT's own check only fails when none of them does), and none
    is a grouped convolution (before PEFT, which refuses one only for some ranks)."""
    if isinstance(spec.target_modules, str):
        return
    modules = dict(model.named_modules())
    names: dict[int, int] = {}  # how many names each parameter has (tied weights have several)
    for _, p in model.named_parameters(remove_duplicate=False):
        names[id(p)] = names.get(id(p), 0) + 1
    for target in spec.target_modules:
        matched = [m for name, m in modules.items() if name == target or name.endswith(f".{target}")]
        if not matched:
            linear = sorted({name.rsplit(".", 1)[-1] for name, m in modules.items() if isinstance(m, nn.Linear)})
            raise LoraTargetError(
                f"model.lora.target_modules: {target!r} matches no module of the model; its linear layers are "
                f"{', '.join(linear)}"
            )
        for module in matched:
            _check_not_grouped(target, module)
            if any(names[id(p)] > 1 for p in module.parameters(recurse=False)):
                raise LoraTargetError(
                    f"model.lora.target_modules: {target}'s weight is tied to another module's (tie_word_embeddings): "
                    "its adapter could not be merged without changing that one too; leave it out"
                )


def _check_not_grouped(name: str, module: nn.Module) -> None:
    if isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d) and module.groups > 1:
        raise LoraTargetError(
            f"model.lora.target_modules: {name} is a grouped (depthwise) convolution, on which PEFT's adapter is a "
            "dense convolution rather than a change of its weight (it cannot be merged either); leave it out"
        )


def _check_adapted(model: nn.Module, spec: LoraSpec) -> None:
    """What PEFT wrapped is something the engine computes with as PEFT does."""
    layers = lora_layers(model)
    if not layers:
        raise LoraTargetError(f"model.lora.target_modules: {spec.target_modules!r} adapts no module of the model")
    for name, layer in layers.items():
        _check_not_grouped(name, base_module(layer))
        if spec.dropout > 0 and any(_named(name, read) for read in READ_AS_WEIGHTS):
            raise LoraTargetError(
                f"model.lora.dropout: {name}'s weight is read by the engine (not called on an input), so dropout on "
                "its input cannot apply; set dropout 0 or leave it out of target_modules"
            )


def _named(name: str, suffix: str) -> bool:
    return name == suffix or name.endswith(f".{suffix}") or f".{suffix}." in f".{name}."


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


# --- reading adapted weights ---------------------------------------------------------------------------------------
def is_lora_layer(module: nn.Module) -> bool:
    """A PEFT LoRA layer (a wrapper holding ``base_layer`` and ``lora_A`` / ``lora_B``)."""
    return hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "get_delta_weight")


def base_module(module: nn.Module) -> Any:
    """The module PEFT wrapped (``module`` itself when it is not wrapped; through nested wrappers)."""
    while is_lora_layer(module):
        module = module.base_layer  # type: ignore[assignment]
    return module


def _active(layer: Any, name: str) -> list[str]:
    """The adapters of ``layer`` that change its parameter ``name`` and are not merged into it already."""
    if getattr(layer, "disable_adapters", False):
        return []
    if getattr(layer, "parameter_name", "weight") != name:  # a ParamWrapper adapts its one parameter
        return []
    merged = set(getattr(layer, "merged_adapters", ()))
    return [a for a in layer.active_adapters if _holds(layer, a) and a not in merged]


def _holds(layer: Any, adapter: str) -> bool:
    """Whether ``layer`` has weights of ``adapter`` (an embedding's are ``lora_embedding_A`` / ``_B``)."""
    return adapter in layer.lora_A or adapter in getattr(layer, "lora_embedding_A", {})


def _wrappers(module: nn.Module) -> Iterator[Any]:
    while is_lora_layer(module):
        yield module
        module = module.base_layer  # type: ignore[assignment]


def effective_weight(module: nn.Module, name: str = "weight") -> Tensor:
    """``module``'s parameter ``name`` as its forward computes with it: the base tensor plus each active LoRA
    adapter's ``s·B A`` (PEFT's ``get_delta_weight``, differentiable in the adapters). The base tensor itself for a
    module without adapters. Every direct weight read of the engine goes through this."""
    weight: Tensor = getattr(base_module(module), name)
    for layer in _wrappers(module):
        for adapter in _active(layer, name):
            weight = weight + layer.get_delta_weight(adapter).to(weight.dtype)
    return weight


def low_rank_factors(module: nn.Module, name: str) -> list[tuple[Tensor, Tensor, float]]:
    """The active adapters of a stacked parameter ``name`` ``[E, out, in]`` (a MoE's experts) as factors
    ``(B [E, out, r], A [E, r, in], s)`` with ``W_e + Σ s·B_e A_e`` the weight expert ``e`` computes with (PEFT's
    ``get_delta_factors``), so that ``x`` goes through them as two low-rank products instead of a materialised
    weight."""
    factors = []
    for layer in _wrappers(module):
        for adapter in _active(layer, name):
            lhs, rhs, scale = layer.get_delta_factors(adapter)
            if lhs.shape[-1] != rhs.shape[-2] or lhs.shape[1] != getattr(base_module(module), name).shape[1]:
                raise LoraTargetError(f"model.lora: {name}'s adapter is not laid out as its [experts, out, in] weight")
            # contiguous (PEFT's are views): torch's grouped kernel takes contiguous weights only
            factors.append((lhs.contiguous(), rhs.contiguous(), float(scale)))
    return factors


# --- what the trainer, checkpoints and exports read ---------------------------------------------------------------
def lora_layers(model: nn.Module) -> dict[str, Any]:
    """Every LoRA layer of ``model`` by module name (nested wrappers of one module each under its own name)."""
    return {name: m for name, m in model.named_modules() if is_lora_layer(m)}


def lora_settings(model: nn.Module) -> dict[str, Any] | None:
    """What a checkpoint records of ``model``'s LoRA adapters (None: it has none): rank, alpha, dropout and the
    modules adapted. A resume with other settings is refused (``check_same_settings``)."""
    config = _peft_config(model)
    layers = lora_layers(model)
    if config is None or not layers:
        return None
    return {
        "r": int(config.r),
        "alpha": int(config.lora_alpha),
        "dropout": float(config.lora_dropout),
        "adapted": sorted(layers),
    }


def check_same_settings(saved: dict[str, Any] | None, model: nn.Module) -> None:
    """Raise ``LoraTargetError`` (one line) when ``model``'s LoRA settings differ from ``saved`` (a checkpoint's)."""
    now = lora_settings(model)
    if saved == now:
        return
    if saved is None or now is None:
        written = "without LoRA" if saved is None else f"with LoRA ({_described(saved)})"
        given = "without LoRA" if now is None else f"with LoRA ({_described(now)})"
        raise LoraTargetError(
            f"the checkpoint was written {written} and the model is {given}: resume as it was written"
        )
    raise LoraTargetError(
        f"the checkpoint's LoRA settings ({_described(saved)}) differ from the model's ({_described(now)}): resume "
        "with the model.lora it was written with"
    )


def with_adapters_of(model: nn.Module, like: nn.Module) -> nn.Module:
    """``model`` (a base model of ``like``'s architecture, changed in place and returned) with adapters laid out as
    ``like``'s — PEFT's names, ranks and targets — and their values still to be copied in; ``model`` as it is when
    ``like`` has none. For a copy whose weights come by name from ``like``'s (the asynchronous rollout thread's)."""
    from peft import inject_adapter_in_model

    config = _peft_config(like)
    if config is None or not lora_layers(like):
        return model
    with warnings.catch_warnings():  # (as in ``apply_lora``: the experts' pattern keys PEFT reports unmatched)
        warnings.filterwarnings("ignore", message=r"The following (rank|alpha)_pattern keys did not match")
        inject_adapter_in_model(copy.deepcopy(config), model, adapter_name=ADAPTER)
    return model.requires_grad_(False)


def _peft_config(model: nn.Module) -> Any:
    """PEFT's ``LoraConfig`` of the model's adapter (``inject_adapter_in_model`` keeps it on the model), or None."""
    return getattr(model, "peft_config", {}).get(ADAPTER)


def _described(settings: dict[str, Any]) -> str:
    return (
        f"r={settings['r']} alpha={settings['alpha']:g} dropout={settings['dropout']:g} on "
        f"{len(settings['adapted'])} modules, the first {settings['adapted'][0]}"
    )


def check_exact(model: nn.Module) -> None:
    """Exact mode recomputes the context's chunks in reverse: dropout would draw masks other than the capture's."""
    for name, layer in lora_layers(model).items():
        if any(isinstance(d, nn.Dropout) and d.p > 0 for d in layer.lora_dropout.values()):
            raise LoraTargetError(
                f"model.lora.dropout > 0 ({name}) with mode 'exact': the reverse walk recomputes the context's chunks "
                "and would draw other dropout masks than the capture; set dropout 0 or use mode 'detached'"
            )


def trainable_names(model: nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def merged_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every adapter merged into its weight (``W + s·B A``) and the wrappers removed: the
    plain transformers model it computes as. ``model`` itself is unchanged."""
    merged = copy.deepcopy(model)
    layers = lora_layers(merged)
    for layer in layers.values():
        layer.merge()
    for name in sorted(layers, key=lambda n: n.count(".")):  # outermost first: an inner one goes with it
        if name in dict(merged.named_modules()):
            parent, _, child = name.rpartition(".")
            setattr(merged.get_submodule(parent) if parent else merged, child, base_module(layers[name]))
    if hasattr(merged, "peft_config"):
        del merged.peft_config
    merged.requires_grad_(True)
    return merged


def merged_tensors(model: nn.Module, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """``tensors`` (some of ``model``'s parameters and buffers by name, e.g. ``parallel.fsdp.whole_parts``'s, whole
    and on the host) with the adapters merged: each adapted weight as ``W + s·B A`` under its transformers name, the
    adapters' own tensors left out. Computed with PEFT's ``get_delta_weight`` over these tensors (a layer's base
    weight and its adapters are in one part)."""
    layers = lora_layers(model)
    if not layers:
        return tensors
    out = {transformers_name(name): t for name, t in tensors.items() if ".lora_" not in name}
    for name, layer in layers.items():
        prefix = f"{name}."
        own = {k[len(prefix) :]: t for k, t in tensors.items() if k.startswith(prefix)}
        if not any(k.startswith("lora_") for k in own):  # (a nested wrapper's adapters are under its own name)
            continue
        param = getattr(layer, "parameter_name", "weight")
        target = transformers_name(f"{name}.{param}")
        deltas = _deltas(layer, own, param)
        for delta in deltas:
            out[target] = out[target] + delta.to(out[target].dtype)
    return out


def _deltas(layer: Any, own: dict[str, Tensor], param: str) -> list[Tensor]:
    """PEFT's delta weights of ``layer``'s active adapters, computed over the tensors ``own`` (its adapters' by their
    names within the layer) instead of its registered parameters (shards, under FSDP2)."""
    from torch.func import functional_call

    probe = _Delta(layer, _active(layer, param))
    with torch.no_grad():
        return list(functional_call(probe, {f"layer.{k}": t for k, t in own.items()}, (), strict=False))


class _Delta(nn.Module):
    """Calls ``layer.get_delta_weight`` for its adapters as a forward, so that ``functional_call`` can run it over
    other tensors than the layer's own."""

    def __init__(self, layer: Any, adapters: list[str]):
        super().__init__()
        self.layer, self.adapters = layer, adapters

    def forward(self) -> list[Tensor]:
        return [self.layer.get_delta_weight(a) for a in self.adapters]


def transformers_name(name: str) -> str:
    """A parameter's name without PEFT's wrappers (``….q_proj.base_layer.weight`` → ``….q_proj.weight``); an
    adapter's, that of the weight it adapts (``….q_proj.lora_A.default.weight`` → ``….q_proj.weight``)."""
    return re.sub(r"\.lora_(embedding_)?[AB]\.[^.]+(\.weight)?$", ".weight", name.replace(".base_layer", ""))


def adapter_state(model: nn.Module, tensors: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """The adapters' tensors as PEFT saves them (``PeftModel.save_pretrained``'s names: ``base_model.model.`` +
    the module's name + ``.lora_A.weight``), from ``tensors`` (by parameter name; default: the model's own)."""
    from peft.utils import get_peft_model_state_dict

    if tensors is None:
        state = get_peft_model_state_dict(model, adapter_name=ADAPTER)
    else:
        state = get_peft_model_state_dict(model, state_dict=tensors, adapter_name=ADAPTER)
    return {f"{PEFT_PREFIX}{name}": t.detach().to("cpu").contiguous() for name, t in state.items()}


def save_adapter(model: nn.Module, directory: Path, base_model: str | None) -> Path:
    """Write ``model``'s adapter in PEFT's format — ``adapter_config.json`` and ``adapter_model.safetensors`` — that
    ``PeftModel.from_pretrained(base, directory)`` loads (``base_model``: the base's path, recorded in the config)."""
    from safetensors.torch import save_file

    config = copy.deepcopy(_peft_config(model))
    if config is None:
        raise ValueError("the model has no LoRA adapter to save")
    config.base_model_name_or_path = base_model
    config.inference_mode = True
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(directory))
    save_file(adapter_state(model), str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return directory


def adapter_directory(path: Path) -> bool:
    """Whether ``path`` holds a PEFT adapter (``adapter_config.json``)."""
    return (path / ADAPTER_CONFIG).is_file()


def adapter_config(path: Path) -> dict[str, Any]:
    return json.loads((path / ADAPTER_CONFIG).read_text())


def trainable(parameters: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters that train (the adapters of a LoRA policy; all of a fully trained one)."""
    return [p for p in parameters if p.requires_grad]
