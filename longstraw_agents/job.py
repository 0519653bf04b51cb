"""One job, one description: ``JobSpec`` — the model, how it spreads over the processes (``parallel``), the engine
that evaluates its context (``engine``) and the GRPO trainer (``trainer``) — validated once, each rule in one place.

``longstraw train`` runs a ``TrainConfig`` (a ``JobSpec`` with environments, sampling, output and seeds); ``longstraw
plan --config`` and ``train --check`` plan the same job (``plan.PlanRequest.of_job``). The engine the run builds is
``JobSpec.engine`` itself: every ``EngineConfig`` field, validated by ``EngineConfig``. Where one section's setting
follows from another's, it is set here, once: the trainer's ``chunk_size`` is the engine's, and under expert
parallelism every extend is computed replicated (``engine.sharded_extends`` false) unless ``parallel.expert_dispatch``.

Settings that moved into ``engine:`` keep working in configs (and run directories' ``config.json``) written before:
``trainer.chunk_size`` and ``parallel.wavefront_walk`` / ``balanced_captures`` / ``sharded_extend_tokens`` are read
as ``engine.*`` (``MOVED_KEYS``); one given in both places with different values is an error naming both.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from longstraw_agents.engine.config import EngineConfig
from longstraw_agents.layout import ParallelSpec
from longstraw_agents.models.lora import LoraSpec
from longstraw_agents.trainer import GRPOConfig

DEFAULT_PRESET = "llama"
# (section, key) of a setting before ``engine:`` existed -> its key in ``engine:``
MOVED_KEYS: dict[tuple[str, str], str] = {
    ("trainer", "chunk_size"): "chunk_size",
    ("parallel", "wavefront_walk"): "wavefront_walk",
    ("parallel", "balanced_captures"): "balanced_captures",
    ("parallel", "sharded_extend_tokens"): "sharded_extend_tokens",
}


class ModelSpec(BaseModel):
    """A tiny preset built from scratch, or a local transformers checkpoint directory."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    preset: Literal["llama", "qwen3", "qwen3_5", "glm_moe_dsa"] | None = Field(
        None, description=f"tiny preset ({DEFAULT_PRESET} when neither preset nor path is given)"
    )
    path: str | None = Field(None, description="local HF model directory (instead of a preset)")
    overrides: dict[str, Any] = Field(default_factory=dict, description="preset arguments, e.g. hidden, layers")
    dtype: Literal["float32", "float64", "bfloat16"] = "float32"
    max_context: int | None = Field(None, ge=16, description="context limit (default: the config's)")
    lora: LoraSpec | None = Field(
        None,
        description="train LoRA adapters (PEFT) on the frozen model instead of its weights: {r, alpha, "
        "target_modules, dropout}",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_preset(cls, data: Any) -> Any:
        # The default source is the preset only when no path is given: `model: {path: DIR}` alone is complete.
        if isinstance(data, dict) and "preset" not in data and data.get("path") is None:
            return {**data, "preset": DEFAULT_PRESET}
        return data

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.preset is None) == (self.path is None):
            raise ValueError("give exactly one of model.preset and model.path")
        if self.path is not None and self.overrides:
            raise ValueError("model.overrides are preset arguments; a model.path is used as saved")
        return self


def extends_may_shard(expert_parallel: bool, expert_dispatch: bool) -> bool:
    """The layout's rule for long extends: under expert parallelism every extend is computed replicated (each rank
    runs its own experts on every token) unless its tokens are dispatched to their experts' ranks. ``JobSpec``
    makes ``engine.sharded_extends`` follow it, ``plan.PlanRequest`` plans by it, and the CLI's plan flags build
    their engine from it."""
    return expert_dispatch or not expert_parallel


def engine_problem(expert_parallel: bool, expert_dispatch: bool, engine: EngineConfig) -> str | None:
    """What keeps ``engine`` from running under the layout's expert parallelism, in one line, or None (the rules
    ``JobSpec`` and ``plan.PlanRequest`` share)."""
    if expert_dispatch and not engine.sharded_extends:
        return "parallel.expert_dispatch shards long extends: it needs engine.sharded_extends"
    if expert_parallel and not expert_dispatch and engine.sharded_extend_tokens is not None:
        return (
            "parallel.expert_parallel computes every extend replicated: engine.sharded_extend_tokens would shard "
            "none; leave it out, or dispatch tokens to their experts (parallel.expert_dispatch: true)"
        )
    return None


class JobSpec(BaseModel):
    """What a GRPO job runs: the model, its layout over the processes, the engine and the trainer.

    Every section refuses unknown keys. ``engine`` is ``EngineConfig`` (chunking, the attention backend, exact mode's
    walk and checkpoints, activation checkpointing...): the engine ``longstraw train`` builds, and the one
    ``longstraw plan --config`` plans."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    model: ModelSpec = Field(default_factory=ModelSpec)
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    engine: EngineConfig = Field(
        default_factory=EngineConfig,
        description="how the engine evaluates context: every EngineConfig field (`longstraw train --help` lists them)",
    )
    trainer: GRPOConfig = Field(default_factory=GRPOConfig)

    @model_validator(mode="before")
    @classmethod
    def _each_setting_in_its_place(cls, data: Any) -> Any:
        """Moved keys read from their old places, and the settings that follow from another section's set."""
        if not isinstance(data, dict):
            return data
        engine = _given(data.get("engine", {}))
        if engine is None:  # not a mapping: pydantic names the problem
            return data
        data = dict(data)
        for (section, key), moved in MOVED_KEYS.items():
            _move(data, section, key, engine, moved)
        _follow_expert_parallelism(data.get("parallel", {}), engine)
        data["engine"] = engine
        data["trainer"] = _with_chunk(data.get("trainer", {}), engine.get("chunk_size", _default("chunk_size")))
        return data

    @model_serializer(mode="wrap")
    def _without_the_trainers_chunk(self, handler: SerializerFunctionWrapHandler) -> Any:
        """A saved config names the chunk once, as ``engine.chunk_size`` (the trainer's follows it)."""
        data = handler(self)
        if isinstance(data, dict) and isinstance(data.get("trainer"), dict):
            data["trainer"].pop("chunk_size", None)
        return data

    @model_validator(mode="after")
    def _sections_agree(self) -> JobSpec:
        problem = engine_problem(self.parallel.expert_parallel, self.parallel.expert_dispatch, self.engine)
        if problem is not None:
            raise ValueError(problem)
        if self.engine.sharded_extends and not extends_may_shard(
            self.parallel.expert_parallel, self.parallel.expert_dispatch
        ):
            raise ValueError(
                "parallel.expert_parallel computes every extend replicated: engine.sharded_extends must be false "
                "(leave it out: it follows), or dispatch tokens to their experts (parallel.expert_dispatch: true)"
            )
        precision = self.trainer.mixed_precision
        if precision is None:
            return self
        if precision.compute_dtype == self.model.dtype:
            raise ValueError(
                f"trainer.mixed_precision computes in {precision.compute_dtype}, model.dtype's own: the model's dtype "
                "is the master weights' (float32 for a bfloat16 run)"
            )
        if self.parallel.cp > 1 and not self.parallel.fsdp:
            raise ValueError("trainer.mixed_precision with parallel.cp > 1 needs parallel.fsdp: true")
        return self


def _default(name: str) -> Any:
    return EngineConfig.model_fields[name].default


def _given(section: Any) -> dict[str, Any] | None:
    """The settings a section was given: a mapping's keys, or a model's fields set at construction (None for
    anything else)."""
    if isinstance(section, BaseModel):
        return {name: getattr(section, name) for name in section.model_fields_set}
    return dict(section) if isinstance(section, dict) else None


def _move(data: dict[str, Any], section: str, key: str, engine: dict[str, Any], moved: str) -> None:
    """Read ``section.key`` (its place before ``engine:``) as ``engine.moved``, refusing two different values."""
    old = data.get(section)
    if isinstance(old, dict) and key in old:
        value = old[key]
        data[section] = {name: v for name, v in old.items() if name != key}
    elif isinstance(old, BaseModel) and key in old.model_fields_set:  # (GRPOConfig(chunk_size=...) in Python)
        value = getattr(old, key)
    else:
        return
    if moved in engine and engine[moved] != value:
        raise ValueError(
            f"{section}.{key} ({value!r}) and engine.{moved} ({engine[moved]!r}) are one setting, "
            f"engine.{moved} ({section}.{key} is its place before engine:); give it once"
        )
    engine[moved] = value


def _follow_expert_parallelism(parallel: Any, engine: dict[str, Any]) -> None:
    """Under expert parallelism every extend is replicated unless its tokens are dispatched: ``sharded_extends``
    follows ``parallel.expert_dispatch`` where the engine does not set it (a contrary setting is refused after)."""
    given = _given(parallel) or {}
    if given.get("expert_parallel") is True and "sharded_extends" not in engine:
        engine["sharded_extends"] = extends_may_shard(True, given.get("expert_dispatch") is True)


def _with_chunk(trainer: Any, chunk: Any) -> Any:
    """The trainer's section with the engine's chunk (``GRPOTrainer`` checks that its engine's is its own)."""
    if isinstance(trainer, dict):
        return {**trainer, "chunk_size": chunk}
    if isinstance(trainer, GRPOConfig) and isinstance(chunk, int) and trainer.chunk_size != chunk:
        return trainer.model_copy(update={"chunk_size": chunk})
    return trainer
