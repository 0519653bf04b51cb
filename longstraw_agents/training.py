"""The online GRPO loop behind ``longstraw train``: rollout → store → GRPO step → metrics (JSONL) → checkpoint.

A run directory holds ``config.json``, ``trajectories.db`` (every episode, token-exact), ``metrics.jsonl`` (one
line per step), ``checkpoint/`` (model, optimizer, RNG states, step counters; written atomically) and plots.
``--resume`` continues from the checkpoint; a run resumed after a kill reproduces the uninterrupted run, because
each step's task seeds and sampling generator are derived from (seed, step). Ctrl-C stops after the current
operation, writes the metrics line of an update it let finish and saves a checkpoint of the last completed step;
the store holds whole groups only (one transaction per group). Configuration errors (unknown env, bad env kwargs, a
prompt over the model's context) are raised before anything is written.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from longstraw_agents.envs import ScriptedPolicy, run_episode, unwrap_tool_env
from longstraw_agents.models.dense import DenseAdapter, sliding_windows
from longstraw_agents.models.presets import TINY_PRESETS, build_model
from longstraw_agents.rollout import RolloutLimits, make_env_factory, reset_prompt, rollout_groups
from longstraw_agents.sampler import SamplingConfig, TorchSampler
from longstraw_agents.store import Store
from longstraw_agents.tokenizer import load_tokenizer
from longstraw_agents.trainer import GRPOConfig, GRPOTrainer
from longstraw_agents.trainer.sft import SFTConfig, supervised_warm_start
from longstraw_agents.trajectory import Trajectory

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint"
METRICS = "metrics.jsonl"
STORE = "trajectories.db"


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
    groups_per_step: int = Field(4, ge=1, description="GRPO groups (tasks) per optimizer step")
    steps: int = Field(20, ge=0, description="optimizer steps")
    trainer: GRPOConfig = Field(default_factory=GRPOConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    warm_start: WarmStartSpec | None = None
    output_dir: str = Field("runs/train", description="run directory")
    checkpoint_every: int = Field(5, ge=1, description="steps between checkpoints (and one at the end)")
    eval_episodes: int = Field(0, ge=0, description="held-out episodes scored before GRPO and after the last step")
    seed: int = 0
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


def validation_lines(err: Any, prefix: str = "") -> str:
    """A pydantic ValidationError as indented ``field.path: message`` lines (paths after ``prefix``)."""
    return "\n".join(f"  {prefix}{'.'.join(str(p) for p in e['loc']) or '(config)'}: {e['msg']}" for e in err.errors())


def check_env(spec: EnvSpec) -> None:
    """Make one environment of ``spec``, so that an unknown id or bad kwargs fail now with a ConfigError that names
    the field, not at the first rollout after the model was built."""
    import gymnasium
    from pydantic import ValidationError

    from longstraw_agents.envs import registered_env_ids

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


def build_policy(spec: ModelSpec, vocab_size: int, seed: int) -> torch.nn.Module:
    dtype = getattr(torch, spec.dtype)
    if spec.path is not None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(spec.path, dtype=dtype, local_files_only=True)
        return model.eval()
    config = TINY_PRESETS[spec.preset](**{"vocab_size": vocab_size, **spec.overrides})
    return build_model(config, dtype=dtype, seed=seed)


def max_context_of(model: torch.nn.Module, spec: ModelSpec) -> int | None:
    """The longest episode the policy may see: the config's limit, or a sliding window the engine stops at."""
    limits = [spec.max_context or getattr(model.config, "max_position_embeddings", None)]
    if model.config.model_type in DenseAdapter.model_types:
        limits += sliding_windows(model.config)
    limits = [limit for limit in limits if limit is not None]
    return min(limits) if limits else None


class Run:
    """One run directory and everything a step needs."""

    def __init__(self, config: TrainConfig, resume: bool = False):
        self.config = config
        self.dir = Path(config.output_dir)
        existing = has_checkpoint(self.dir)
        if not resume and existing:
            raise FileExistsError(f"{self.dir} already holds a run; pass --resume or choose another output_dir")
        if resume and not existing:
            raise FileNotFoundError(f"--resume: no checkpoint in {self.dir}")
        check_env(config.env)  # cheap, and before the model is built
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.model = build_policy(config.model, self.tokenizer.vocab_size, config.seed)
        self.max_context = max_context_of(self.model, config.model)
        self.env_factory = make_env_factory(config.env.id, config.env.kwargs, self.max_context)
        self._check_prompt_fits()
        # Nothing is written before the configuration is known to run: a config error leaves no run directory.
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.json").write_text(config.model_dump_json(indent=2))
        self.store = Store.open(self.dir / STORE)
        self.run_id = self._run_row(resume)
        self.trainer: GRPOTrainer | None = None
        self.stop_ids = sorted({self.tokenizer.eos_token_id})

    def _check_prompt_fits(self) -> None:
        """The first task's prompt fits the env's budget and the model's context (else every rollout fails)."""
        env = unwrap_tool_env(self.env_factory())
        try:
            reset_prompt(env, self.task_seeds(0)[0], max_context=self.max_context)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        finally:
            env.close()

    def _run_row(self, resume: bool) -> str:
        runs = self.store.runs()
        if resume and runs:
            return runs[-1].id
        model_id = self.config.model.path or f"preset:{self.config.model.preset}"
        return self.store.add_run(
            config=self.config.model_dump(mode="json"), model=model_id, tokenizer=self.tokenizer.name
        )

    def warm_start(self, emit: Callable[[dict[str, Any]], None]) -> None:
        spec = self.config.warm_start
        if spec is None:
            return
        env = self.env_factory()
        policy = ScriptedPolicy(env)
        traces = [run_episode(env, policy, seed=10_000_000 + k) for k in range(spec.episodes)]
        start = time.perf_counter()
        losses = supervised_warm_start(self.model, traces, spec.sft)
        emit(
            {
                "phase": "warm_start",
                "episodes": len(traces),
                "steps": len(losses),
                "loss_first": losses[0] if losses else None,
                "loss_last": losses[-1] if losses else None,
                "seconds": time.perf_counter() - start,
            }
        )

    def task_seeds(self, step: int) -> list[int]:
        base = (self.config.seed + 1) * 1_000_003 + step * 1_009
        return [base + g for g in range(self.config.groups_per_step)]

    def sampler(self, step: int) -> TorchSampler:
        sampling = self.config.sampling.model_copy(update={"seed": self.config.seed * 100_003 + step})
        return TorchSampler(self.trainer.engine, self.stop_ids, sampling, policy_version=self.trainer.policy_version)

    def step(self, step: int) -> dict[str, Any]:
        config = self.config
        limits = RolloutLimits(config.sampling.max_new_tokens, self.max_context)
        start = time.perf_counter()
        groups = rollout_groups(
            self.env_factory,
            self.sampler(step),
            self.task_seeds(step),
            config.group_size,
            limits,
            group_prefix=f"step{step}-g",
            store=_SkipStored(self.store, self.run_id, step),
            run_id=self.run_id,
            progress=config.progress,
        )
        rollout_s = time.perf_counter() - start
        try:
            with _sigint_deferred():  # an update is applied whole or not at all
                metrics = self.trainer.train_step([self.trainer.group_from_trajectories(g) for g in groups])
        except _DeferredInterrupt as interrupt:
            # The update was applied and the checkpoint will record it: its metrics line must not be lost.
            interrupt.record = _step_record(metrics, groups, rollout_s)
            raise
        return _step_record(metrics, groups, rollout_s)


def _step_record(metrics: dict[str, Any], groups: list[list[Trajectory]], rollout_s: float) -> dict[str, Any]:
    """The step's metrics line: the trainer's figures, rollout statistics and memory."""
    episodes = [t for g in groups for t in g]
    return {
        "phase": "grpo",
        **metrics,
        "rollout_seconds": rollout_s,
        "episode_tokens_mean": sum(t.num_tokens for t in episodes) / len(episodes),
        "solved_fraction": sum(1 for t in episodes if (t.reward or 0) >= 1.0) / len(episodes),
        "finish_reasons": _count(t.finish_reason for t in episodes),
        **memory_metrics(),
    }


def memory_metrics() -> dict[str, int]:
    """Memory figures cheap enough for every step (``peak_bytes`` needs ``trainer.track_memory``): the process's
    peak resident set size and, when CUDA is in use, its peak allocation since the last call."""
    out: dict[str, int] = {}
    try:
        import resource
    except ImportError:  # not on Windows
        pass
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out["rss_peak_bytes"] = peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    return out


class _DeferredInterrupt(KeyboardInterrupt):
    """Ctrl-C held until a block was done; ``record`` is the metrics line of the step it completed, if any."""

    record: dict[str, Any] | None = None


@contextlib.contextmanager
def _sigint_deferred():
    """Hold Ctrl-C until the block is done, then raise KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise _DeferredInterrupt


class _SkipStored:
    """On resume, the interrupted step is rolled out again and reproduces the episodes already stored: write only
    the ones that are not (per group, in finishing order)."""

    def __init__(self, store: Store, run_id: str, step: int):
        self.store, self.run_id = store, run_id
        rows = store.db.query(
            "SELECT group_id, COUNT(*) AS n FROM episodes WHERE run_id = ? AND group_id LIKE ? GROUP BY group_id",
            [run_id, f"step{step}-g%"],
        )
        self.stored = {row["group_id"]: row["n"] for row in rows}

    def add_episodes(self, trajectories: list[Trajectory], run_id: str | None = None) -> list[int]:
        fresh = []
        for trajectory in trajectories:
            if self.stored.get(trajectory.group_id, 0) > 0:
                self.stored[trajectory.group_id] -= 1
            else:
                fresh.append(trajectory)
        return self.store.add_episodes(fresh, run_id=run_id) if fresh else []


EVAL_SEED_BASE = 900_000_000  # held-out task seeds, disjoint from the training seeds


def evaluate(run: Run, num_episodes: int) -> dict[str, float]:
    """Mean reward of one episode per held-out task with the current policy (not stored, not trained on)."""
    sampling = run.config.sampling.model_copy(update={"seed": EVAL_SEED_BASE})
    seeds = [EVAL_SEED_BASE + k for k in range(num_episodes)]
    version = run.trainer.policy_version
    sampler = TorchSampler(run.trainer.engine, run.stop_ids, sampling, policy_version=version)
    limits = RolloutLimits(sampling.max_new_tokens, run.max_context)
    groups = rollout_groups(run.env_factory, sampler, seeds, 1, limits, group_prefix="eval-", progress=False)
    rewards = [t.reward or 0.0 for g in groups for t in g]
    return {"reward_mean": sum(rewards) / len(rewards), "episodes": len(rewards), "policy_version": version}


REFERENCE = "reference.safetensors"


def reference_policy(run: Run, resume: bool) -> torch.nn.Module | None:
    """The frozen KL reference (beta > 0): the policy as GRPO starts (after the warm start), kept in the run
    directory so that a resumed run uses the same one."""
    if run.config.trainer.loss.beta == 0.0:
        return None
    from safetensors.torch import load_model, save_model

    reference = copy.deepcopy(run.model).eval().requires_grad_(False)
    path = run.dir / REFERENCE
    if resume:
        load_model(reference, str(path))
    else:
        save_model(reference, str(path))
    return reference


def has_checkpoint(run_dir: Path) -> bool:
    """True when ``run_dir`` holds a loadable checkpoint (also one whose last save was cut short)."""
    try:
        GRPOTrainer.resolve_checkpoint(run_dir / CHECKPOINT)
    except FileNotFoundError:
        return False
    return True


def _count(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def train(
    config: TrainConfig, resume: bool = False, on_metrics: Callable[[dict[str, Any]], None] | None = None
) -> Path:
    """Run (or resume) a training run; returns the run directory."""
    run = Run(config, resume)
    metrics_path = run.dir / METRICS

    def emit(record: dict[str, Any]) -> None:
        with metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if on_metrics is not None:
            on_metrics(record)

    if not resume:
        run.warm_start(emit)
    run.trainer = GRPOTrainer(run.model, config.trainer, ref_model=reference_policy(run, resume))
    if resume:
        run.trainer.load_checkpoint(run.dir / CHECKPOINT)
    completed = run.trainer.step_count
    if config.eval_episodes and not resume:
        emit({"phase": "eval", "step": completed, **evaluate(run, config.eval_episodes)})
    try:
        for step in range(run.trainer.step_count, config.steps):
            emit(run.step(step))
            completed = step + 1
            if completed % config.checkpoint_every == 0 or completed == config.steps:
                run.trainer.save_checkpoint(run.dir / CHECKPOINT)
    except KeyboardInterrupt as interrupt:
        with _sigint_deferred():  # a second Ctrl-C must not cut the metrics line or the checkpoint short
            if isinstance(interrupt, _DeferredInterrupt) and interrupt.record is not None:
                emit(interrupt.record)  # the step the interrupt waited for was applied: report it
            log.warning("interrupted: saving the checkpoint of step %d", run.trainer.step_count)
            run.trainer.save_checkpoint(run.dir / CHECKPOINT)
        raise
    finally:
        run.store.close()
    if config.eval_episodes:
        emit({"phase": "eval", "step": completed, **evaluate(run, config.eval_episodes)})
    return run.dir
