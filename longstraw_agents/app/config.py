"""What ``longstraw train CONFIG`` reads: the run's configuration, validated before anything is built or written.

YAML (``.yaml``/``.yml``) or TOML (``.toml``), one mapping validated by pydantic (a wrong key or value is an error
naming the field). ``check_env`` makes one environment of the configured id and kwargs, so an unknown id or bad
kwargs fail with a ``ConfigError`` before the model is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from longstraw_agents.app.seeds import TASK_STEP_STRIDE
from longstraw_agents.sampler import SamplingConfig
from longstraw_agents.trainer import GRPOConfig
from longstraw_agents.trainer.sft import SFTConfig


class ConfigError(ValueError):
    """The configuration cannot run (unknown environment, bad env kwargs, a prompt over the model's context...);
    raised before the run directory is written."""


class EnvSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(description="a registered environment id, e.g. LongStraw/Calculator-v0")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="passed to gymnasium.make")


class ModelSpec(BaseModel):
    """A tiny preset built from scratch, or a local transformers checkpoint directory."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    preset: Literal["llama", "qwen3", "qwen3_5", "glm_moe_dsa"] | None = Field("llama", description="tiny preset")
    path: str | None = Field(None, description="local HF model directory (instead of a preset)")
    overrides: dict[str, Any] = Field(default_factory=dict, description="preset arguments, e.g. hidden, layers")
    dtype: Literal["float32", "float64", "bfloat16"] = "float32"
    max_context: int | None = Field(None, ge=16, description="context limit (default: the config's)")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.preset is None) == (self.path is None):
            raise ValueError("give exactly one of model.preset and model.path")
        return self


class WarmStartSpec(BaseModel):
    """Supervised warm start on the environment's scripted policy before GRPO."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    episodes: int = Field(64, ge=1, description="scripted episodes to learn from")
    sft: SFTConfig = Field(default_factory=SFTConfig)


class TrainConfig(BaseModel):
    """``longstraw train CONFIG`` (YAML or TOML, validated here)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    env: EnvSpec
    model: ModelSpec = Field(default_factory=ModelSpec)
    tokenizer: str = Field("longstraw-bpe", description="'longstraw-bpe' or a local HF tokenizer directory")
    groups_per_step: int = Field(4, ge=1, le=TASK_STEP_STRIDE, description="GRPO groups (tasks) per optimizer step")
    steps: int = Field(20, ge=0, description="optimizer steps")
    trainer: GRPOConfig = Field(default_factory=GRPOConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    warm_start: WarmStartSpec | None = None
    output_dir: str = Field("runs/train", description="run directory")
    checkpoint_every: int = Field(5, ge=1, description="steps between checkpoints (and one at the end)")
    eval_episodes: int = Field(0, ge=0, description="held-out episodes scored before GRPO and after the last step")
    seed: int = Field(0, description="the run's seed: every task seed and sampling seed derives from it")
    progress: bool = True

    @property
    def group_size(self) -> int:
        return self.trainer.group_size


def load_config(path: str | Path) -> TrainConfig:
    """Read a YAML (.yaml/.yml) or TOML (.toml) file into a validated TrainConfig."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"config file {path} does not exist")
    if path.suffix not in (".toml", ".yaml", ".yml"):
        raise ValueError(f"config must be .yaml, .yml or .toml, got {path.name}")
    data = _parse_config(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of settings at the top level, got {type(data).__name__}")
    return TrainConfig.model_validate(data)


def _parse_config(path: Path) -> Any:
    """The file's data; a syntax error is a ValueError that names the file (the parsers' own errors do not)."""
    import tomllib

    import yaml

    kind = "TOML" if path.suffix == ".toml" else "YAML"
    try:
        text = path.read_text()
        return tomllib.loads(text) if kind == "TOML" else (yaml.safe_load(text) or {})
    except (yaml.YAMLError, tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid {kind}: {err}") from None


def validation_lines(err: ValidationError, prefix: str = "") -> str:
    """A pydantic ValidationError as indented ``field.path: message`` lines (paths after ``prefix``)."""
    return "\n".join(f"  {prefix}{'.'.join(str(p) for p in e['loc']) or '(config)'}: {e['msg']}" for e in err.errors())


def check_env(spec: EnvSpec) -> None:
    """Make one environment of ``spec``, so that an unknown id or bad kwargs fail now with a ConfigError that names
    the field, not at the first rollout after the model was built."""
    import gymnasium

    from longstraw_agents.envs import registered_env_ids, unwrap_tool_env

    try:
        env = gymnasium.make(spec.id, **spec.kwargs)
    except (gymnasium.error.Error, ImportError) as err:  # NameNotFound, VersionNotFound, "module:Id" not importable
        known = ", ".join(registered_env_ids())
        raise ConfigError(f"env.id: unknown environment {spec.id!r} ({err}); registered: {known}") from None
    except ValidationError as err:  # the env's own config model
        raise ConfigError(f"invalid env.kwargs for {spec.id}:\n" + validation_lines(err, "env.kwargs.")) from None
    except TypeError as err:  # an env class without a config model rejects an argument
        raise ConfigError(f"invalid env.kwargs for {spec.id}: {err}") from None
    try:
        unwrap_tool_env(env)
    except TypeError as err:
        raise ConfigError(f"env.id: {spec.id} is not a LongStraw environment ({err})") from None
    finally:
        env.close()
