"""``longstraw train --check CONFIG``: whether a configuration would run, found without a GPU, without loading any
weights and without writing anything.

The file itself is validated first (``load_config``: schema, types, field names). Then each check below runs and
every failure is reported, as a line that names the setting, not only the first:

- ``tokenizer``: loads it (the shipped BPE, or a local directory's files) and checks the chat tokens;
- ``env``: makes one environment of ``env.id`` (a registered id, or ``module:Id``) and ``env.kwargs``;
- ``model``: reads ``model.path``'s ``config.json`` (or builds the preset's config): a supported family, a
  vocabulary that covers the tokenizer's ids, a weights file beside it (not read), ``model.lora``'s adapters on the
  model (injected on the meta device: a target that matches nothing, or that the engine cannot train); the first
  task's prompt fits the context;
- ``output_dir``: a new run must not find a run there, ``--resume`` must find one;
- ``parallel``: ``dp * cp`` is the number of processes this one was launched with (1 without a launcher: run the
  check under the run's ``torchrun`` command to check a distributed layout) and the in-node groups fit its nodes, as
  ``train`` checks before joining; the mesh is shown;
- ``report_to``: each tracker's package is installed (a missing one names the extra that installs it);
- ``policy.served``: the server answers ``GET /v1/models`` within ``timeout_s`` and lists ``policy.served.model``,
  has the ``/update_weights_from_disk`` route (a GET of it: 405 where the POST route exists, 404 where it does not;
  nothing is loaded), and reports its weight version if it keeps one (one training process only: the schema refuses
  ``parallel`` with it).

What would run (model size from the config on the meta device, the server's version, steps and episodes) is listed
when the checks pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from longstraw_agents.app.config import (
    ConfigError,
    ModelSpec,
    ServedPolicySpec,
    TrainConfig,
    WarmStartSpec,
    check_env,
    check_model,
    check_report_to,
    check_tokenizer,
    check_warm_start,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from longstraw_agents.tokenizer import Tokenizer

SERVER_TIMEOUT_S = 5.0
"""How long ``--check`` waits for the served policy's server: a dry run should answer in seconds."""
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


@dataclass
class CheckReport:
    """The outcome of ``check_config``: ``errors`` (each naming its setting) and what would run (``facts``)."""

    errors: list[str] = field(default_factory=list)
    facts: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def fact(self, name: str, text: str) -> None:
        self.facts.append((name, text))

    def summary(self) -> str:
        """What would run, one setting a line."""
        width = max((len(name) for name, _ in self.facts), default=0)
        return "\n".join(f"  {name:<{width}}  {text}" for name, text in self.facts)


def check_config(config: TrainConfig, *, resume: bool = False, timeout_s: float = SERVER_TIMEOUT_S) -> CheckReport:
    """Every check of a validated ``config`` (see the module docstring); nothing is written, no weights are read."""
    report = CheckReport()
    loaded = _attempt(report, lambda: check_tokenizer(config.tokenizer))
    tokenizer = loaded if loaded is not False else None
    if tokenizer is not None:
        report.fact("tokenizer", f"{config.tokenizer} ({tokenizer.vocab_size:,} tokens)")
    env_ok = _attempt(report, lambda: check_env(config.env, tokenizer)) is not False
    if env_ok:
        kwargs = ", ".join(f"{k}={v!r}" for k, v in config.env.kwargs.items())
        report.fact("env", f"{config.env.id}" + (f" ({kwargs})" if kwargs else ""))
    model_config = _check_model_source(report, config, tokenizer)
    if env_ok and config.warm_start is not None and not resume:  # (a resumed run has no warm start)
        _check_warm_start(report, config, config.warm_start, tokenizer, model_config)
    if model_config is not None and tokenizer is not None and env_ok:  # the prompt needs an env that can be made
        _attempt(report, lambda: check_prompt_fits(config, model_config, tokenizer))
    steps_done = _check_output_dir(report, config, resume)
    _check_parallel(report, config)
    if config.report_to and _attempt(report, lambda: check_report_to(config.report_to)) is not False:
        report.fact("report_to", f"{', '.join(config.report_to)} (logs under {config.output_dir})")
    if config.policy.served is not None:
        _check_served(report, config, config.policy.served, timeout_s)
    else:
        report.fact("policy", "sampled in this process (TorchSampler over the trainer's model)")
    report.fact("training", _training_text(config, steps_done))
    return report


def _attempt(report: CheckReport, check: Callable[[], Any]) -> Any:
    """``check()``'s result, or False after recording its ``ConfigError`` (checks return None when all is well)."""
    try:
        return check()
    except ConfigError as err:
        report.errors.append(str(err))
        return False


def _check_model_source(
    report: CheckReport, config: TrainConfig, tokenizer: Tokenizer | None
) -> PretrainedConfig | None:
    """The model's transformers config, checked against the tokenizer's vocabulary (without one: the family only;
    a preset, whose vocabulary is the tokenizer's, is then not built)."""
    spec = config.model
    if tokenizer is None and spec.path is None:
        return None
    model_config = _attempt(report, lambda: check_model(spec, tokenizer.vocab_size if tokenizer else 0))
    if model_config is False:
        return None
    if spec.path is not None and not any((Path(spec.path) / name).is_file() for name in WEIGHT_FILES):
        report.errors.append(
            f"model.path: {spec.path} has a config.json but no weights ({' or '.join(WEIGHT_FILES[:2])})"
        )
    report.fact("model", _model_text(config, model_config))
    if spec.lora is not None:
        trained = _attempt(report, lambda: lora_parameters(spec, model_config))
        if trained is not False:
            report.fact("lora", f"r={spec.lora.r}, alpha {spec.lora.alpha:g}: {trained:,} parameters train")
    return model_config


def lora_parameters(spec: ModelSpec, model_config: PretrainedConfig) -> int:
    """The parameters ``spec.lora``'s adapters add to the model (built on the meta device: no weights), which are
    those that train; ``ConfigError`` for targets the engine cannot train."""
    import torch
    from transformers import AutoModelForCausalLM

    from longstraw_agents.models.lora import LoraTargetError, apply_lora

    assert spec.lora is not None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    try:
        apply_lora(model, spec.lora)
    except LoraTargetError as err:
        raise ConfigError(str(err)) from None
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def check_prompt_fits(config: TrainConfig, model_config: PretrainedConfig, tokenizer: Tokenizer) -> None:
    """The first task's prompt fits the env's budget and the model's context (``Run`` checks the same)."""
    from longstraw_agents.app.seeds import task_seed
    from longstraw_agents.envs import unwrap_tool_env
    from longstraw_agents.models import context_limit
    from longstraw_agents.rollout import RolloutLimits, make_env_factory, reset_prompt

    limits = RolloutLimits(config.sampling.max_new_tokens, context_limit(model_config, config.model.max_context))
    kwargs = {**config.env.kwargs, "tokenizer": tokenizer}
    try:  # the model's context caps the env's budget: a summary threshold above it cannot be kept
        env = unwrap_tool_env(make_env_factory(config.env.id, kwargs, limits)())
    except ValueError as err:
        raise ConfigError(f"env: {err}") from None
    try:
        reset_prompt(env, task_seed(config.seed, 0, 0), limits=limits)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    finally:
        env.close()


def _check_output_dir(report: CheckReport, config: TrainConfig, resume: bool) -> int:
    """Whether the run can start (or resume) in ``output_dir``; returns the steps its checkpoint has done."""
    from longstraw_agents.app.run import CHECKPOINT, has_checkpoint
    from longstraw_agents.trainer import GRPOTrainer

    directory = Path(config.output_dir)
    held = has_checkpoint(directory)
    if held and not resume:
        report.errors.append(f"output_dir: {directory} already holds a run; pass --resume or choose another output_dir")
    elif resume and not held:
        report.errors.append(f"output_dir: --resume, but {directory} holds no checkpoint")
    elif directory.exists() and not directory.is_dir():
        report.errors.append(f"output_dir: {directory} is a file")
    elif resume:
        done = int(GRPOTrainer.checkpoint_info(directory / CHECKPOINT)["step"])
        report.fact("output_dir", f"{directory} (resumed from its checkpoint at step {done})")
        return done
    else:
        report.fact("output_dir", f"{directory} (a new run)")
    return 0


def _check_parallel(report: CheckReport, config: TrainConfig) -> None:
    """The layout against this process's launcher (``train``'s own check), and the mesh it makes."""
    from longstraw_agents.app.distributed import check_layout, describe_layout

    try:
        check_layout(config.parallel)
    except ConfigError as err:
        report.errors.append(f"parallel: {err}")
        return
    report.fact("parallel", describe_layout(config.parallel))


def _check_served(report: CheckReport, config: TrainConfig, spec: ServedPolicySpec, timeout_s: float) -> None:
    """The server of ``policy.served``: reachable, serving ``spec.model``, able to load weights from disk."""
    import httpx

    from longstraw_agents.app.served import weights_directory
    from longstraw_agents.sampler import served_weight_version

    directory = weights_directory(spec, Path(config.output_dir))
    if directory.exists() and not directory.is_dir():
        report.errors.append(f"policy.served.weight_sync.directory: {directory} is a file")
    url = spec.base_url.rstrip("/")
    try:
        with httpx.Client(timeout=timeout_s) as client:
            listed = client.get(url + "/v1/models")
            update = client.get(url + "/update_weights_from_disk")  # a POST route: 405 where it exists, else 404
            version = served_weight_version(client, url)
    except httpx.TransportError as err:
        report.errors.append(
            f"policy.served.base_url: no server answers at {url} within {timeout_s:g}s ({type(err).__name__}: {err}); "
            "start it first (README: 'From the demo to a served model')"
        )
        return
    problems = _served_problems(spec, url, listed, update)
    report.errors += problems
    if not problems:
        served = "not a number: the weights are pushed before the first rollout" if version is None else version
        report.fact("policy", f"served by {url} as {spec.model!r}, weight version {served}")
        report.fact(
            "weight sync",
            f"after every step: written to {directory}/vNNNNNN, loaded by the server (POST /update_weights_from_disk)",
        )


def _served_problems(spec: ServedPolicySpec, url: str, listed: Any, update: Any) -> list[str]:
    """What the server's answers to ``GET /v1/models`` and ``GET /update_weights_from_disk`` say is wrong."""
    if listed.status_code != 200:
        return [f"policy.served.base_url: GET {url}/v1/models answered HTTP {listed.status_code}, not a model list"]
    try:
        names = [entry.get("id") for entry in listed.json().get("data", [])]
    except (ValueError, AttributeError):
        return [f"policy.served.base_url: GET {url}/v1/models did not answer with an OpenAI model list"]
    problems = []
    if spec.model not in names:
        problems.append(f"policy.served.model: the server at {url} serves {names}, not {spec.model!r}")
    if update.status_code == 404:
        problems.append(
            f"policy.served.weight_sync: {url} has no POST /update_weights_from_disk (HTTP 404); "
            "supported servers: SGLang, CompletionServer (vLLM is not supported yet)"
        )
    return problems


def _model_text(config: TrainConfig, model_config: PretrainedConfig) -> str:
    spec = config.model
    text = model_config.get_text_config()
    source = spec.path if spec.path is not None else f"preset {spec.preset}"
    count = parameter_count(model_config)
    size = f", {count / 1e9:.2f}B parameters" if count >= 1e8 else f", {count:,} parameters" if count else ""
    return f"{source}: {model_config.model_type}{size}, vocabulary {text.vocab_size:,}, {spec.dtype}"


def parameter_count(model_config: PretrainedConfig) -> int:
    """The model's parameter count, from its config on the meta device (no memory, no weights); 0 if that fails."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_config)
    except (ValueError, TypeError, KeyError, RuntimeError):
        return 0
    return sum(p.numel() for p in model.parameters())


def _check_warm_start(
    report: CheckReport,
    config: TrainConfig,
    spec: WarmStartSpec,
    tokenizer: Tokenizer | None,
    model_config: PretrainedConfig | None,
) -> None:
    from longstraw_agents.models import context_limit

    limit = None if model_config is None else context_limit(model_config, config.model.max_context)
    if _attempt(report, lambda: check_warm_start(spec, config.env, tokenizer, limit)) is not False:
        report.fact("warm start", _warm_start_text(spec))


def _warm_start_text(spec: WarmStartSpec) -> str:
    """Each stage: its documents and steps."""
    stages = [
        f"drill {n}: {d.sft.steps:,} steps x {d.sft.batch_size} documents of {d.tokens[0]:,}-{d.tokens[1]:,} tokens"
        for n, d in enumerate(spec.drill, 1)
    ]
    changed = ", ".join(f"{k}={v!r}" for k, v in spec.env_kwargs.items())
    drills = spec.rehearsed_drills
    stages.append(
        f"{spec.episodes:,} scripted episodes{f' ({changed})' if changed else ''}"
        + (f" + {drills:,} drill documents" if drills else "")
        + f": {spec.sft.steps:,} steps x {spec.sft.batch_size}"
    )
    return "; ".join(stages)


def _training_text(config: TrainConfig, steps_done: int = 0) -> str:
    """The steps still to run: all of them for a new run, those after the checkpoint's for a resumed one."""
    trainer = config.trainer
    steps = max(config.steps - steps_done, 0)
    episodes = steps * config.groups_per_step * config.group_size
    if not steps_done:
        left = ""
    elif steps:
        left = f" (steps {steps_done + 1}..{config.steps} of {config.steps})"
    else:
        left = f" (the checkpoint has done all {config.steps}; raise steps to train further)"
    return (
        f"{steps} step{'' if steps == 1 else 's'}{left} of {config.groups_per_step} groups x {config.group_size} "
        f"episodes ({episodes:,} episodes), {trainer.mode} mode, lr {trainer.optim.lr:g}, sampling temperature "
        f"{config.sampling.temperature:g}"
    )
