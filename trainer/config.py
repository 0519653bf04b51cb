"""GRPO trainer configuration: nested by component (loss, optimizer), with TRL-style flat names accepted too.

>>> GRPOConfig(group_size=8, mode="exact", loss=LossConfig(epsilon=0.2), optim=OptimizerConfig(lr=1e-5))
>>> GRPOConfig(G=8, epsilon=0.2, lr=1e-5)        # the same, flat (TRL users write it this way)
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from longstraw_agents.trainer.loss import LossConfig

ModeName = Literal["naive", "detached", "exact"]


class OptimizerConfig(BaseModel):
    """AdamW and gradient clipping."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float = Field(1e-5, gt=0.0, description="learning rate")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW decoupled weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon")
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="clip the global grad norm (None: no clipping)")
    warmup_steps: int = Field(
        0, ge=0, description="linear learning-rate warmup: a fresh Adam's first steps are ~lr per weight"
    )


_LOSS_KEYS = set(LossConfig.model_fields)
_OPTIM_KEYS = set(OptimizerConfig.model_fields)
_ALIASES = {"G": "group_size", "num_generations": "group_size", "learning_rate": "lr", "loss_type": "aggregation"}


class GRPOConfig(BaseModel):
    """Everything a GRPO step needs besides the model and the data."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    group_size: int = Field(8, ge=1, description="G: completions per prompt / rollouts per group")
    mode: ModeName = Field("exact", description="naive | detached | exact (see longstraw_agents.trainer.grpo)")
    chunk_size: int = Field(512, ge=1, description="tokens per prefill chunk (bounds activation memory)")
    loss: LossConfig = Field(default_factory=LossConfig)
    optim: OptimizerConfig = Field(default_factory=OptimizerConfig)
    seed: int = Field(0, description="seed for torch / numpy / python RNGs at trainer start")
    track_memory: bool = Field(False, description="record peak live tensor bytes per step (slower)")

    @model_validator(mode="before")
    @classmethod
    def _nest_flat_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = {_ALIASES.get(k, k): v for k, v in data.items()}
        for section, keys in (("loss", _LOSS_KEYS), ("optim", _OPTIM_KEYS)):
            flat = {k: data.pop(k) for k in list(data) if k in keys}
            if flat:
                nested = data.get(section, {})
                if isinstance(nested, BaseModel):
                    nested = nested.model_dump()
                data[section] = {**nested, **flat}
        return data
