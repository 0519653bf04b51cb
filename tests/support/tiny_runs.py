"""Tiny training runs for the end-to-end tests (training, replay, CLI): configs, a warm-started policy, weights.

A random-init policy never solves a task, so every group has equal rewards, zero advantages and zero gradients;
tests that compare parameters use `warm_started_policy` instead, a tiny llama briefly trained on the scripted
Calculator traces, whose groups have mixed rewards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gymnasium
import torch

from longstraw_agents.app.config import TrainConfig
from longstraw_agents.app.export import load_run_policy
from longstraw_agents.envs import EASY_CALCULATOR_KWARGS, ScriptedPolicy, run_episode
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.tokenizer import load_tokenizer
from longstraw_agents.trainer.sft import SFTConfig, supervised_warm_start

ENV_ID = "LongStraw/Calculator-v0"
ENV_KWARGS: dict[str, Any] = {**EASY_CALCULATOR_KWARGS, "max_turns": 3}
TINY_MODEL: dict[str, Any] = {"preset": "llama", "overrides": {"hidden": 32, "layers": 1}}
# Measured: after this warm start about a third of the groups of 4 have mixed rewards.
WARM_START: dict[str, Any] = {"episodes": 16, "sft": {"steps": 100, "batch_size": 2, "lr": 2e-2}}


def tiny_config_dict(output_dir: str | Path, **updates: Any) -> dict[str, Any]:
    """A TrainConfig as plain data (what a YAML or TOML file holds): 2 groups of 4, 2 steps, 24 tokens a turn."""
    config = {
        "env": {"id": ENV_ID, "kwargs": dict(ENV_KWARGS)},
        "model": dict(TINY_MODEL),
        "groups_per_step": 2,
        "steps": 2,
        "trainer": {"group_size": 4, "lr": 1e-3},
        "sampling": {"max_new_tokens": 24},
        "output_dir": str(output_dir),
        "checkpoint_every": 1,
        "progress": False,
    }
    return {**config, **updates}


def tiny_config(output_dir: str | Path, **updates: Any) -> TrainConfig:
    return TrainConfig.model_validate(tiny_config_dict(output_dir, **updates))


def warm_started_policy(directory: Path) -> Path:
    """Save a tiny llama warm-started on scripted Calculator episodes to ``directory`` (an HF model folder)."""
    env = gymnasium.make(ENV_ID, **ENV_KWARGS)
    traces = [run_episode(env, ScriptedPolicy(env), seed=10_000 + k) for k in range(WARM_START["episodes"])]
    vocab_size = load_tokenizer("longstraw-bpe").vocab_size
    model = tiny_model("llama", vocab_size=vocab_size, **TINY_MODEL["overrides"])
    supervised_warm_start(model, traces, SFTConfig(**WARM_START["sft"]))
    model.save_pretrained(directory)
    return directory


def checkpoint_weights(run_dir: str | Path) -> dict[str, torch.Tensor]:
    """The model weights of a run's checkpoint (read whole, in this process)."""
    model = load_run_policy(run_dir).model
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"parameters differ: {different}"
