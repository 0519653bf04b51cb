"""GRPO trainer configuration: nested by component (loss, optimizer), with TRL-style flat names accepted too.

>>> nested = GRPOConfig(group_size=8, mode="exact", loss=LossConfig(epsilon=0.2), optim=OptimizerConfig(lr=1e-5))
>>> GRPOConfig(G=8, epsilon=0.2, lr=1e-5) == nested        # the same, flat (TRL users write it this way)
True

Flat names follow TRL / HF ``TrainingArguments``: ``epsilon`` is the clip range, ``adam_epsilon`` /
``adam_beta1`` / ``adam_beta2`` / ``learning_rate`` / ``weight_decay`` / ``max_grad_norm`` / ``warmup_steps`` are
AdamW's, ``num_generations`` is G, ``loss_type`` takes TRL's names ("dapo", "bnpo", "grpo", "dr_grpo", with TRL's
batch normalisation), ``num_iterations`` is TRL's μ, ``use_bias_correction_kl`` and ``max_completion_length`` are
the loss's, ``bf16=True`` is ``mixed_precision=MixedPrecision(compute_dtype="bfloat16")``. A flat ``eps`` is refused:
it is ambiguous between AdamW's epsilon and the clip range.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from longstraw_agents.trainer.loss import LossConfig
from longstraw_agents.trainer.modes import ModeName


class OptimizerConfig(BaseModel):
    """AdamW and gradient clipping."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float = Field(1e-5, gt=0.0, description="learning rate")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW decoupled weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon (flat form: adam_epsilon)")
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="clip the global grad norm (None: no clipping)")
    warmup_steps: int = Field(
        0, ge=0, description="linear learning-rate warmup: a fresh Adam's first steps are ~lr per weight"
    )


class MixedPrecision(BaseModel):
    """Mixed precision as FSDP2's policy and accelerate's ``mixed_precision="bf16"`` give it: the model's own
    parameters (in the dtype it was built with, fp32 for a bf16 run) are the master weights AdamW steps, with its
    moments in the same dtype; the engine computes with ``compute_dtype`` copies; gradients are reduced and
    accumulated in the master dtype. A sharded model gets the policy from FSDP2, an unsharded one a compute copy
    (``parallel.mixed_precision.ComputeCopy``): both placed by ``parallel.parallelize``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    compute_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="dtype of the weights the engine computes with (float32: for fp64 masters)"
    )

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.compute_dtype)


_LOSS_KEYS = set(LossConfig.model_fields)
_OPTIM_KEYS = set(OptimizerConfig.model_fields)  # after renaming: a flat "eps" can only come from adam_epsilon
_ALIASES = {
    "G": "group_size",
    "num_generations": "group_size",
    "learning_rate": "lr",
    "adam_epsilon": "eps",
    "loss_type": "aggregation",
}
_ADAM_BETAS = ("adam_beta1", "adam_beta2")


def _rename_aliases(data: dict[str, Any]) -> dict[str, Any]:
    """TRL / HF names → ours. A flat ``eps`` is refused (a TRL user means the clip range, AdamW reads it), and two
    spellings of one setting (``lr`` and ``learning_rate``) are an error rather than one silently winning."""
    if "eps" in data:
        raise ValueError(
            "flat 'eps' is ambiguous: use 'adam_epsilon' (or optim={'eps': ...}) for AdamW's epsilon, "
            "or 'epsilon' for the clip range"
        )
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = _ALIASES.get(key, key)
        if name in out:
            spellings = sorted(k for k in data if _ALIASES.get(k, k) == name)
            raise ValueError(f"{spellings} set the same option {name!r}; give one")
        out[name] = value
    return out


def _section(data: dict[str, Any], name: str) -> dict[str, Any]:
    """The nested section as a dict to merge flat keys into (a malformed one is left for pydantic to report)."""
    nested = data.get(name, {})
    if isinstance(nested, BaseModel):
        return nested.model_dump()
    return dict(nested) if isinstance(nested, dict) else {}


def _adam_betas(data: dict[str, Any], optim: dict[str, Any]) -> dict[str, Any]:
    """Pop ``adam_beta1`` / ``adam_beta2``: each replaces one entry of the betas, the other keeps its value."""
    given = {k: data.pop(k) for k in _ADAM_BETAS if k in data}
    if not given:
        return {}
    betas = list(optim.get("betas", OptimizerConfig.model_fields["betas"].default))
    for index, key in enumerate(_ADAM_BETAS):
        betas[index] = given.get(key, betas[index])
    return {"betas": tuple(betas)}


class GRPOConfig(BaseModel):
    """Everything a GRPO step needs besides the model and the data."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    group_size: int = Field(
        8, ge=1, description="G: completions per prompt; GRPOTrainer.group_from_completions checks it"
    )
    mode: ModeName = Field("exact", description="naive | detached | exact (see longstraw_agents.trainer.modes)")
    chunk_size: int = Field(
        512,
        ge=1,
        description="tokens per prefill chunk (bounds activation memory): the engine's (a run config sets it as "
        "engine.chunk_size, which this follows)",
    )
    loss: LossConfig = Field(default_factory=LossConfig, description="the GRPO objective")
    optim: OptimizerConfig = Field(default_factory=OptimizerConfig, description="AdamW, warmup and clipping")
    track_memory: bool = Field(False, description="record peak live tensor bytes per step (slower)")
    mixed_precision: MixedPrecision | None = Field(
        None,
        description="master weights in the model's dtype, compute in mixed_precision.compute_dtype (None: compute "
        "with the master weights themselves)",
    )
    num_iterations: int = Field(
        1,
        ge=1,
        description="μ (TRL's num_iterations): optimizer steps per train_step on the same groups; the ratio is "
        "against the behaviour logprobs recorded at sampling, so every loss token needs one when μ > 1",
    )
    capture_reuse: bool = Field(
        False,
        description="detached mode: capture the groups' context once per train_step and reuse it in its μ optimizer "
        "steps (exact in the first, approximate after: the context then comes from older weights)",
    )

    @classmethod
    def accepted_keys(cls) -> frozenset[str]:
        """Every key the config takes: its fields, the loss and optimizer settings given flat, TRL's names."""
        flat = _LOSS_KEYS | (_OPTIM_KEYS - {"eps"})  # a flat eps is refused as ambiguous
        return frozenset(cls.model_fields) | flat | set(_ALIASES) | set(_ADAM_BETAS) | {"bf16"}

    @model_validator(mode="after")
    def _capture_reuse_needs_detached_mode(self) -> GRPOConfig:
        if self.capture_reuse and self.mode != "detached":
            raise ValueError(
                f"capture_reuse needs mode='detached', got mode={self.mode!r}: exact and naive modes backpropagate "
                "through the context, so they recompute it with the current weights"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _nest_flat_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = _rename_aliases(data)
        if "bf16" in data:  # TRL / HF TrainingArguments: bf16=True trains in bf16 mixed precision
            if "mixed_precision" in data:
                raise ValueError("give bf16 or mixed_precision, not both")
            data["mixed_precision"] = MixedPrecision() if data.pop("bf16") else None
        for section, keys in (("loss", _LOSS_KEYS), ("optim", _OPTIM_KEYS)):
            nested = _section(data, section)
            flat = {k: data.pop(k) for k in list(data) if k in keys}
            if section == "optim":
                flat.update(_adam_betas(data, {**nested, **flat}))
            if flat and isinstance(data.get(section, {}), dict | BaseModel):
                data[section] = {**nested, **flat}
        return data
