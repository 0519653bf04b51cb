"""What ``longstraw train CONFIG`` reads: the run's configuration, validated before anything is built or written.

YAML (``.yaml``/``.yml``) or TOML (``.toml``), one mapping validated by pydantic (a wrong key or value is an error
naming the field). Numbers must be numbers: ``steps: "3"`` (anywhere in the file, nested parts included) is refused
rather than coerced, as pydantic's strict mode has it (YAML's ``1e-3``, a string to PyYAML, is read as the float it
means).

The checks that need more than the file run before anything is built or written, each raising a ``ConfigError``
that names the setting: ``check_env`` makes one environment of the configured id and kwargs (unknown id, bad
kwargs), ``check_tokenizer`` loads the tokenizer, ``check_model`` reads the model's transformers config (a
preset's arguments, a missing or unreadable ``model.path``, an unsupported family, a vocabulary smaller than the
tokenizer's) without building any weights, and ``check_report_to`` finds the package of each tracker in
``report_to`` (naming the extra that installs a missing one).
"""

from __future__ import annotations

import difflib
import inspect
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails

from longstraw_agents.app.reporting import TrackerName, install_command, missing_trackers
from longstraw_agents.app.seeds import TASK_STEP_STRIDE
from longstraw_agents.job import JobSpec
from longstraw_agents.job import ModelSpec as ModelSpec  # (the run config's sections, where they were)
from longstraw_agents.layout import ParallelSpec as ParallelSpec
from longstraw_agents.sampler import SamplingConfig
from longstraw_agents.trainer.sft import SFTConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from longstraw_agents.tokenizer import Tokenizer


class ConfigError(ValueError):
    """The configuration cannot run (unknown environment, bad env kwargs, a tokenizer or model that cannot serve the
    run, a prompt over the model's context...); raised before the run directory is written."""


class EnvSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    id: str = Field(description="a registered environment id, e.g. LongStraw/Calculator-v0")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="passed to gymnasium.make")


class WeightSyncSpec(BaseModel):
    """How the trainer hands the weights of each optimizer step to the server (``longstraw_agents.weight_sync``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    protocol: Literal["sglang-disk"] = Field(
        "sglang-disk",
        description="SGLang's POST /update_weights_from_disk (CompletionServer speaks it too); vLLM: not supported yet",
    )
    directory: str | None = Field(
        None,
        description="where each version is written for the server to read (same machine, or a shared mount at the "
        "same path); default: OUTPUT_DIR/served_weights",
    )
    keep: int = Field(1, ge=1, description="version directories kept; older ones go once the server serves a newer")
    timeout_s: float = Field(1800.0, gt=0, description="seconds the server may take to load one version")


class ServedPolicySpec(BaseModel):
    """Rollouts sampled by an OpenAI-compatible completions server (token ids in, token ids and logprobs out) while
    this process trains; the server's weights follow the trainer's after every optimizer step."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    base_url: str = Field(description="the server without /v1, e.g. http://127.0.0.1:30000")
    model: str = Field("default", description="the name the server lists the model under (GET /v1/models)")
    timeout_s: float = Field(600.0, gt=0, description="seconds one completion request may take")
    max_retries: int = Field(4, ge=0, description="retries of a failed completion request (with backoff)")
    max_concurrency: int = Field(64, ge=1, description="completion requests in flight at once")
    weight_sync: WeightSyncSpec = Field(default_factory=WeightSyncSpec)

    @model_validator(mode="after")
    def _http_url(self) -> ServedPolicySpec:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"policy.served.base_url must start with http:// or https://, got {self.base_url!r}")
        if self.base_url.rstrip("/").endswith("/v1"):
            raise ValueError("policy.served.base_url is the server's root: leave out the /v1")
        return self


class PolicySpec(BaseModel):
    """Who samples the rollouts: the trainer's model in this process (the default), or a server (``served``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    served: ServedPolicySpec | None = Field(None, description="sample from a server instead of in-process")


class DrillStage(BaseModel):
    """One stage of the warm start's drill: ``sft.steps * sft.batch_size`` new drill documents of the environment
    (``ToolEnv.drill_document``), each of a length drawn uniformly from ``tokens``, batches drawn from them as
    ``supervised_warm_start`` draws (at random, with replacement: about 63 % of them are seen)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    tokens: list[int] = Field(min_length=2, max_length=2, description="[shortest, longest] document, in tokens")
    sft: SFTConfig = Field(default_factory=SFTConfig)

    @field_validator("sft")
    @classmethod
    def _some_steps(cls, sft: SFTConfig) -> SFTConfig:
        if sft.steps < 1:
            raise ValueError("a drill stage learns sft.steps * sft.batch_size documents: give it at least 1 step")
        return sft

    @field_validator("tokens")
    @classmethod
    def _a_range(cls, tokens: list[int]) -> list[int]:
        if not 1 <= tokens[0] <= tokens[1]:
            raise ValueError(f"tokens is [shortest, longest] with 1 <= shortest <= longest; got {list(tokens)}")
        return tokens


class WarmStartSpec(BaseModel):
    """Supervised warm start before GRPO: first the ``drill`` stages in turn, then the environment's scripted
    episodes (``env_kwargs`` over the run's), with a ``rehearsal`` share of drill documents mixed in so that the
    episodes' layout is learned while the drilled skill stays in use (``bench.ablation_learning``'s ``Mixture``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    episodes: int = Field(64, ge=1, description="scripted episodes to learn from")
    sft: SFTConfig = Field(default_factory=SFTConfig)
    env_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="over env.kwargs for the warm start's episodes alone (merged key by key, nested mappings too): "
        "e.g. shorter pages, to learn the layout at a fraction of the tokens",
    )
    drill: list[DrillStage] = Field(default_factory=list, description="drill stages before the episodes")
    rehearsal: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="share of the episodes' stage documents that are drill documents (of the last drill stage's "
        "lengths)",
    )

    @model_validator(mode="after")
    def _rehearsal_needs_a_drill(self) -> WarmStartSpec:
        if self.rehearsal > 0.0 and not self.drill:
            raise ValueError("warm_start.rehearsal mixes in drill documents: give warm_start.drill stages")
        return self

    @property
    def rehearsed_drills(self) -> int:
        """How many drill documents join the episodes, so that they are ``rehearsal`` of the stage's documents."""
        return round(self.rehearsal * self.episodes / (1.0 - self.rehearsal))

    def episode_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``kwargs`` (the run's env.kwargs) with ``env_kwargs`` merged over them."""
        return merged(kwargs, self.env_kwargs)


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged into ``base`` key by key, nested mappings merged the same way."""
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merged(out[key], value) if both else value
    return out


class TrainConfig(JobSpec):
    """``longstraw train CONFIG`` (YAML or TOML, validated here): the job (``JobSpec``: ``model``, ``parallel``,
    ``engine``, ``trainer``) with its environments, sampling, output and seeds.

    Its own fields are strict (``steps: "3"`` is an error, not 3); ``load_config`` refuses strings for numbers in
    the nested parts (engine, trainer, sampling, warm start) as well."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    env: EnvSpec
    tokenizer: str = Field("longstraw-bpe", description="'longstraw-bpe' or a local HF tokenizer directory")
    policy: PolicySpec = Field(default_factory=PolicySpec)
    groups_per_step: int = Field(4, ge=1, le=TASK_STEP_STRIDE, description="GRPO groups (tasks) per optimizer step")
    max_staleness: int | None = Field(
        None,
        description="asynchronous GRPO (app/async_rollouts.py): the next steps' rollouts overlap training, no token "
        "trained on more than this many policy versions after the weights that sampled it (0: each step sampled by "
        "its own weights, the synchronous loop's run); None: the synchronous loop",
    )
    steps: int = Field(20, ge=0, description="optimizer steps")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    warm_start: WarmStartSpec | None = None
    output_dir: str = Field("runs/train", description="run directory")
    checkpoint_every: int = Field(5, ge=1, description="steps between checkpoints (and one at the end)")
    eval_episodes: int = Field(0, ge=0, description="held-out episodes scored before GRPO and after the last step")
    seed: int = Field(0, description="the run's seed: every task seed and sampling seed derives from it")
    progress: bool = True
    report_to: list[TrackerName] = Field(
        default_factory=list,
        description="experiment trackers that also get the metrics.jsonl records (accelerate's): tensorboard, wandb, "
        "mlflow; each writes under output_dir unless configured otherwise (app/reporting.py)",
    )

    @property
    def group_size(self) -> int:
        return self.trainer.group_size

    @field_validator("max_staleness")
    @classmethod
    def _staleness_counts_versions(cls, value: int | None) -> int | None:
        if value is not None and value < 0:
            raise ValueError(
                f"max_staleness counts policy versions between the weights that sample a token and those that train "
                f"on it: 0 or more, not {value} (leave it out for the synchronous loop)"
            )
        return value

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_tracker_as_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value  # `report_to: wandb`, as TRL's report_to takes it

    @field_validator("report_to")
    @classmethod
    def _each_tracker_once(cls, value: list[TrackerName]) -> list[TrackerName]:
        repeated = sorted({name for name in value if value.count(name) > 1})
        if repeated:
            raise ValueError(f"report_to names {', '.join(repeated)} more than once")
        return value

    @model_validator(mode="after")
    def _a_group_for_every_dp_rank(self) -> TrainConfig:
        if self.parallel.dp > self.groups_per_step:
            raise ValueError(
                f"parallel.dp ({self.parallel.dp}) data-parallel ranks split groups_per_step ({self.groups_per_step}) "
                "groups: each rank needs at least one; raise groups_per_step or lower parallel.dp"
            )
        return self


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
    try:
        text = json.dumps(data)
    except (TypeError, ValueError) as err:  # a TOML/YAML date or time: no setting takes one
        raise ValueError(f"{path}: holds a value that is not a number, string, list or mapping ({err})") from None
    config = TrainConfig.model_validate_json(text)
    _refuse_coerced(text)
    return config


# Strict-mode errors that mean "lax mode would have coerced this string (or bool) into a number or a bool".
_COERCED = frozenset({"int_type", "float_type", "bool_type"})


def _refuse_coerced(text: str) -> None:
    """Raise the strict errors of a config that lax validation accepted by coercing a string (``"3"``) or a bool
    into a number, or a string (``"no"``) into a bool, in the nested parts too (trainer, sampling, warm start).

    Strict mode's other complaints are left out: a JSON list filling a tuple (AdamW's betas) loses nothing."""
    try:
        TrainConfig.model_validate_json(text, strict=True)
    except ValidationError as err:
        coerced = [e for e in err.errors() if e["type"] in _COERCED and isinstance(e["input"], str | bool)]
        if coerced:
            details = [InitErrorDetails(type=e["type"], loc=e["loc"], input=e["input"]) for e in coerced]
            raise ValidationError.from_exception_data(TrainConfig.__name__, details) from None


def _parse_config(path: Path) -> Any:
    """The file's data; a syntax error is a ValueError that names the file (the parsers' own errors do not)."""
    import tomllib

    import yaml

    kind = "TOML" if path.suffix == ".toml" else "YAML"
    try:
        text = path.read_text()
        return tomllib.loads(text) if kind == "TOML" else (yaml.load(text, Loader=_yaml_loader()) or {})
    except (yaml.YAMLError, tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid {kind}: {err}") from None


# YAML 1.2 floats: PyYAML (YAML 1.1) reads `1e-3` and `2E5` (no dot) as strings, which strict validation refuses.
_YAML_FLOAT = re.compile(
    r"""^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9_]+(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+)$"""
)


def _yaml_loader() -> type:
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML_FLOAT, list("-+0123456789."))
    return Loader


def validation_lines(err: ValidationError, prefix: str = "", schema: type[BaseModel] | None = None) -> str:
    """A pydantic ValidationError as indented ``field.path: message`` lines (paths after ``prefix``). Given the
    ``schema`` that was validated, an unknown key also gets where it belongs ("did you mean"): the section of
    ``schema`` that takes it (``trainer.activation_checkpointing`` -> ``engine.activation_checkpointing``), else the
    closest key its own section takes."""
    return "\n".join(_error_line(error, prefix, schema) for error in err.errors())


def _error_line(error: Any, prefix: str, schema: type[BaseModel] | None) -> str:
    location = error["loc"]
    line = f"  {prefix}{'.'.join(str(p) for p in location) or '(config)'}: {error['msg']}"
    if error["type"] != "extra_forbidden" or not location:
        return line
    meant = _other_section(schema, location)
    section = _section_schema(schema, location[:-1])
    if meant is None and section is not None:
        close = difflib.get_close_matches(str(location[-1]), sorted(_accepted_keys(section)), n=1)
        meant = close[0] if close else None
    return line + (f"; did you mean {meant!r}?" if meant else "")


def _other_section(schema: type[BaseModel] | None, location: tuple[Any, ...]) -> str | None:
    """``section.key`` where another top-level section of ``schema`` takes the unknown key at ``location`` (the
    first in the schema's order: ``engine`` before ``trainer``, whose ``chunk_size`` is the engine's old place)."""
    if schema is None:
        return None
    key, here = str(location[-1]), location[0] if len(location) > 1 else None
    for name, field in schema.model_fields.items():
        section = _model_in(field.annotation)
        if section is not None and name != here and key in _accepted_keys(section):
            return f"{name}.{key}"
    return None


def _section_schema(schema: type[BaseModel] | None, path: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model that validates the section at ``path`` of ``schema`` (None inside lists and dicts)."""
    for name in path:
        field = schema.model_fields.get(name) if schema is not None and isinstance(name, str) else None
        if field is None:
            return None
        schema = _model_in(field.annotation)
    return schema


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (``X``, ``X | None``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((model for arg in get_args(annotation) if (model := _model_in(arg)) is not None), None)


def _accepted_keys(schema: type[BaseModel]) -> set[str]:
    """The keys a section takes: its fields' names and aliases, or what its ``accepted_keys()`` lists (a model whose
    validator also reads other spellings, as GRPOConfig reads TRL's names and flat loss / optimizer settings)."""
    accepted = getattr(schema, "accepted_keys", None)
    if callable(accepted):
        return set(accepted())
    return {name for field_name, field in schema.model_fields.items() for name in (field_name, field.alias) if name}


def check_env(spec: EnvSpec, tokenizer: Tokenizer | None = None) -> None:
    """Make one environment of ``spec`` (with the run's ``tokenizer``, when given), so that an unknown id or bad
    kwargs fail now with a ConfigError that names the field, not at the first rollout after the model was built.
    The kwargs the env's config model declares are checked strictly, as the config file is (no "3" for 3)."""
    import gymnasium

    from longstraw_agents.envs import registered_env_ids, unwrap_tool_env

    if "tokenizer" in spec.kwargs:
        raise ConfigError(
            "env.kwargs.tokenizer: the run's environments use the top-level `tokenizer` setting (the policy and its "
            "environments must share one tokenizer)"
        )
    extra: dict[str, Any] = {} if tokenizer is None else {"tokenizer": tokenizer}
    try:
        env = gymnasium.make(spec.id, **spec.kwargs, **extra)
    except (gymnasium.error.Error, ImportError) as err:  # NameNotFound, VersionNotFound, "module:Id" not importable
        known = ", ".join(registered_env_ids())
        raise ConfigError(f"env.id: unknown environment {spec.id!r} ({err}); registered: {known}") from None
    except ValidationError as err:  # the env's own config model
        lines = validation_lines(err, "env.kwargs.", _env_config_class(spec.id))
        raise ConfigError(f"invalid env.kwargs for {spec.id}:\n{lines}") from None
    except TypeError as err:  # an env class without a config model rejects an argument
        raise ConfigError(f"invalid env.kwargs for {spec.id}: {err}") from None
    try:
        _check_env_kwarg_types(spec, unwrap_tool_env(env).config_class)
    except TypeError as err:
        raise ConfigError(f"env.id: {spec.id} is not a LongStraw environment ({err})") from None
    finally:
        env.close()


def check_warm_start(
    spec: WarmStartSpec | None, env: EnvSpec, tokenizer: Tokenizer | None = None, max_context: int | None = None
) -> None:
    """The warm start's episodes can be made (``env_kwargs`` merged over the run's); given ``drill`` stages, the
    environment has a drill document, and each stage's longest fits ``max_context`` (the model's, when known). A
    ConfigError naming the setting otherwise."""
    import gymnasium
    import numpy as np

    from longstraw_agents.envs import unwrap_tool_env

    if spec is None:
        return
    episodes = EnvSpec(id=env.id, kwargs=spec.episode_kwargs(env.kwargs))
    if spec.env_kwargs:
        try:
            check_env(episodes, tokenizer)
        except ConfigError as err:
            raise ConfigError(f"warm_start.env_kwargs: {err}") from None
    if not spec.drill:
        return
    extra: dict[str, Any] = {} if tokenizer is None else {"tokenizer": tokenizer}
    made = gymnasium.make(episodes.id, **episodes.kwargs, **extra)
    try:
        tool_env = unwrap_tool_env(made)
        if not tool_env.has_drill():
            name = type(tool_env).__name__
            raise ConfigError(f"warm_start.drill: {name} has no drill document (ToolEnv.drill_document)")
        for number, stage in enumerate(spec.drill):
            longest = tool_env.drill_document(np.random.default_rng(0), stage.tokens[1]).num_tokens
            if max_context is not None and longest > max_context:
                raise ConfigError(
                    f"warm_start.drill[{number}].tokens: a drill document of {stage.tokens[1]:,} tokens takes "
                    f"{longest:,} with its framing, over the model's context limit of {max_context:,} tokens"
                )
    finally:
        made.close()


def _env_config_class(env_id: str) -> type[BaseModel] | None:
    """The config model of a registered LongStraw environment's class, found without making one."""
    import gymnasium
    from gymnasium.envs.registration import load_env_creator

    try:
        entry_point = gymnasium.spec(env_id).entry_point
        creator = load_env_creator(entry_point) if isinstance(entry_point, str) else entry_point
    except (gymnasium.error.Error, ImportError, AttributeError):
        return None
    return _model_in(getattr(creator, "config_class", None))


def _check_env_kwarg_types(spec: EnvSpec, config_class: type[BaseModel]) -> None:
    declared = {name: value for name, value in spec.kwargs.items() if name in config_class.model_fields}
    try:
        text = json.dumps(declared)
    except (TypeError, ValueError):  # Python objects given through the API, not a file: the env has checked them
        return
    try:
        config_class.model_validate_json(text, strict=True)
    except ValidationError as err:
        raise ConfigError(f"invalid env.kwargs for {spec.id}:\n" + validation_lines(err, "env.kwargs.")) from None


def check_report_to(names: list[TrackerName]) -> None:
    """Every tracker of ``report_to`` has its package installed (else a ConfigError naming the extra to install),
    checked before a model is built or a step runs."""
    missing = missing_trackers(names)
    if missing:
        are = "is" if len(missing) == 1 else "are"
        raise ConfigError(f"report_to: {' and '.join(missing)} {are} not installed: {install_command(missing)}")


def check_tokenizer(spec: str) -> Tokenizer:
    """The run's tokenizer, loaded and checked for what the environments' chat format needs (``<|im_start|>`` and
    ``<|im_end|>`` as special tokens, ``<|im_end|>`` as eos)."""
    from longstraw_agents.chat import ChatFormatter
    from longstraw_agents.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(spec)
        ChatFormatter(tokenizer)
    except KeyError as err:  # a special token the chat format needs is missing (the message names the known ones)
        raise ConfigError(f"tokenizer: {err.args[0]}") from None
    except (OSError, ValueError, TypeError) as err:
        named = "" if spec in str(err) else f"{spec}: "
        raise ConfigError(f"tokenizer: {named}{err}") from None
    return tokenizer


def check_model(spec: ModelSpec, vocab_size: int) -> PretrainedConfig:
    """The policy's transformers config, read from ``model.path`` or built from the preset without any weights, and
    checked: the family is one the engine supports and the vocabulary covers every id of the tokenizer's
    ``vocab_size`` (a smaller one would fail at the first rollout, after the run directory was written)."""
    from longstraw_agents.models import adapter_class
    from longstraw_agents.models.base import UnsupportedModelError

    if spec.path is not None:
        config, where = _saved_config(spec.path), "model.path"
    else:
        config, where = _preset_config(spec, vocab_size), f"model.preset {spec.preset}"
    try:
        adapter_class(config)
    except UnsupportedModelError as err:
        raise ConfigError(f"{where}: {err}") from None
    model_vocab = getattr(config.get_text_config(), "vocab_size", None)
    if isinstance(model_vocab, int) and model_vocab < vocab_size:
        if "vocab_size" in spec.overrides:
            where = "model.overrides.vocab_size"
        raise ConfigError(
            f"{where}: the model's vocabulary has {model_vocab} tokens, fewer than the tokenizer's {vocab_size} "
            "(ids past the embedding would fail at the first rollout); use the tokenizer the model was trained with"
        )
    return config


def _saved_config(path: str) -> PretrainedConfig:
    from transformers import AutoConfig

    directory = Path(path)
    if not directory.exists():
        raise ConfigError(f"model.path: no model directory at {path} (a local directory; nothing is downloaded)")
    if not directory.is_dir():
        raise ConfigError(f"model.path: {path} is a file, not a model directory")
    if not (directory / "config.json").is_file():
        raise ConfigError(
            f"model.path: {path} has no config.json; it is not a transformers model directory (save_pretrained)"
        )
    try:
        return AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as err:
        raise ConfigError(f"model.path: cannot read {directory / 'config.json'}: {err}") from None


def _preset_config(spec: ModelSpec, vocab_size: int) -> PretrainedConfig:
    """The preset's config with ``model.overrides`` (which must be arguments of the preset, of its types, >= 1)."""
    import pydantic
    from huggingface_hub.errors import StrictDataclassError

    from longstraw_agents.models.presets import TINY_PRESETS

    assert spec.preset is not None  # ModelSpec holds exactly one of path and preset
    factory = TINY_PRESETS[spec.preset]
    arguments = list(inspect.signature(factory).parameters)
    unknown = [name for name in spec.overrides if name not in arguments]
    if unknown:
        named = ", ".join(f"model.overrides.{name}" for name in unknown)
        raise ConfigError(f"{named}: not an argument of the {spec.preset} preset; valid: {', '.join(arguments)}")
    small = [name for name, value in spec.overrides.items() if isinstance(value, int | float) and value < 1]
    if small:
        raise ConfigError(f"model.overrides.{small[0]}: must be at least 1, got {spec.overrides[small[0]]}")
    checked = pydantic.validate_call(config=ConfigDict(strict=True))(factory)
    try:
        return checked(**{"vocab_size": vocab_size, **spec.overrides})
    except ValidationError as err:
        raise ConfigError("invalid model.overrides:\n" + validation_lines(err, "model.overrides.")) from None
    except (TypeError, ValueError, StrictDataclassError) as err:  # the transformers config refuses the combination
        reason = err.__cause__ or err  # transformers' validators wrap the ValueError that says what is wrong
        raise ConfigError(f"model.overrides: the {spec.preset} preset refuses them: {reason}") from None
