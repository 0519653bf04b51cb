"""What a training run shows while it works (app/training.py, trainer/sft.py): progress bars for the warm start,
rollouts, GRPO steps and evaluations, and a warning when a step has no learning signal."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import gymnasium
import pytest
from tiny_runs import ENV_ID, ENV_KWARGS, tiny_config

from longstraw_agents.app.training import train, warn_without_learning_signal
from longstraw_agents.envs import ScriptedPolicy, run_episode
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.trainer.sft import SFTConfig, supervised_warm_start

LOGGER = "longstraw_agents.app.training"


def groups_of(*rewards: tuple[float, ...]) -> list[list[SimpleNamespace]]:
    return [[SimpleNamespace(reward=r) for r in group] for group in rewards]


def test_uniform_rewards_in_every_group_warn_and_say_what_to_check(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        warn_without_learning_signal(groups_of((0.0, 0.0), (0.0, 0.0)), step=4)  # type: ignore[arg-type]
    [record] = caplog.records
    assert "no learning signal at step 5" in record.message and "every episode failed" in record.message
    assert "warm start" in record.message
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        warn_without_learning_signal(groups_of((1.0, 1.0), (0.0, 0.0)), step=0)  # type: ignore[arg-type]
    [record] = caplog.records
    assert "rewards seen: 0, 1)" in record.message and "harder tasks" in record.message
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        warn_without_learning_signal(groups_of((0.0, 0.0), (0.0, 1.0)), step=0)  # type: ignore[arg-type]
    assert not caplog.records  # one group with different rewards is a signal


def test_a_run_shows_its_bars_and_warns_when_nothing_can_be_learned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A random-init policy without a warm start never solves the task: every group is uniform."""
    config = tiny_config(tmp_path / "run", steps=1, eval_episodes=2, progress=True)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        train(config)
    err = capsys.readouterr().err
    for bar in ("eval", "rollout", "GRPO"):
        assert f"{bar}:" in err, bar
    assert "tok/s" in err and "reward" in err
    assert any("no learning signal at step 1" in r.message for r in caplog.records)


def test_the_warm_start_bar_shows_the_loss(capsys: pytest.CaptureFixture[str]) -> None:
    env = gymnasium.make(ENV_ID, **ENV_KWARGS)
    traces = [run_episode(env, ScriptedPolicy(env), seed=k) for k in range(2)]
    model = tiny_model("llama", vocab_size=2048, hidden=32, layers=1)
    losses = supervised_warm_start(model, traces, SFTConfig(steps=2, batch_size=1), progress=True)
    err = capsys.readouterr().err
    assert "warm start" in err and f"loss {losses[-1]:.3f}" in err and "tok/s" in err
    supervised_warm_start(model, traces, SFTConfig(steps=1, batch_size=1), progress=False)
    assert "warm start" not in capsys.readouterr().err
