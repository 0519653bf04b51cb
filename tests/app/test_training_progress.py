"""What a training run shows while it works (app/training.py, trainer/sft.py): progress bars for the warm start,
rollouts, GRPO steps and evaluations (plain lines when not on a terminal), and a warning when a stretch of steps
has no learning signal."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import gymnasium
import pytest
from tiny_runs import ENV_ID, ENV_KWARGS, tiny_config

from longstraw_agents.app.training import NO_SIGNAL_GROUPS, NO_SIGNAL_STEPS, LearningSignalWatch, train
from longstraw_agents.envs import ScriptedPolicy, run_episode
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.trainer.sft import SFTConfig, supervised_warm_start

LOGGER = "longstraw_agents.app.training"


def groups_of(*rewards: tuple[float, ...]) -> list[list[SimpleNamespace]]:
    return [[SimpleNamespace(reward=r) for r in group] for group in rewards]


FAILED_GROUP, SOLVED_GROUP, MIXED_GROUP = (0.0,) * 4, (1.0,) * 4, (0.0, 1.0, 0.0, 0.0)


def watched(caplog: pytest.LogCaptureFixture, steps: list[list[tuple[float, ...]]]) -> list[str]:
    """The warnings a new watch gives over ``steps`` (each a list of groups' rewards), in order."""
    watch = LearningSignalWatch()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for step, groups in enumerate(steps):
            watch.observe(groups_of(*groups), step)  # type: ignore[arg-type]
    return [record.message for record in caplog.records]


def test_a_stretch_of_steps_without_signal_warns_once_saying_what_it_saw(caplog: pytest.LogCaptureFixture) -> None:
    """Four groups a step: steps 1 and 2 with no group of mixed rewards are ordinary; the third completes the stretch
    (3 steps, 12 groups) and warns; the stretch's later steps do not warn again."""
    assert (NO_SIGNAL_STEPS, NO_SIGNAL_GROUPS) == (3, 12)
    [warning] = watched(caplog, [[FAILED_GROUP] * 4] * 5)
    assert warning.startswith("no learning signal in steps 1-3: the 12 groups of these 3 steps all had ")
    assert "uniform rewards (all 0)" in warning and "every advantage was zero" in warning
    assert "solves none of these tasks" in warning and "warm_start.sft.steps" in warning
    assert "every episode failed" not in warning


def test_one_group_with_mixed_rewards_ends_the_stretch(caplog: pytest.LogCaptureFixture) -> None:
    """A step with one group whose members scored differently has a signal: no warning; a new stretch after it
    warns again, naming its own steps."""
    no_signal, signal = [FAILED_GROUP] * 4, [FAILED_GROUP] * 3 + [MIXED_GROUP]
    assert watched(caplog, [no_signal, no_signal, signal, no_signal, no_signal]) == []
    [first, second] = watched(caplog, [no_signal] * 3 + [signal] + [no_signal] * 3)
    assert "steps 1-3" in first and "steps 5-7" in second


def test_the_stretch_must_hold_enough_groups(caplog: pytest.LogCaptureFixture) -> None:
    """One group a step (a group of 4 at a fifth solved is uniform 41 % of the time): 3 uniform steps are not
    enough; the warning waits for 12 groups."""
    steps = [[FAILED_GROUP]] * 12
    assert watched(caplog, steps[:11]) == []
    [warning] = watched(caplog, steps)
    assert "steps 1-12: the 12 groups of these 12 steps" in warning


def test_groups_all_solved_or_all_failed_are_named_and_get_their_hint(caplog: pytest.LogCaptureFixture) -> None:
    [warning] = watched(caplog, [[SOLVED_GROUP, SOLVED_GROUP, FAILED_GROUP, SOLVED_GROUP]] * 3)
    assert "uniform rewards (3 groups all 0, 9 groups all 1)" in warning and "harder tasks" in warning
    assert "solves none" not in warning


def test_a_run_shows_its_bars_as_plain_lines_when_not_on_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written to a captured (not a terminal) standard error, every bar — warm start, eval, rollout, GRPO — is
    plain lines (here one per update: TQDM_MININTERVAL=0), with no carriage return or escape code."""
    monkeypatch.setenv("TQDM_MININTERVAL", "0")
    warm_start = {"episodes": 2, "sft": {"steps": 2, "batch_size": 1}}
    config = tiny_config(tmp_path / "run", steps=1, eval_episodes=2, warm_start=warm_start, progress=True)
    train(config)
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err
    lines = err.splitlines()
    for bar in ("warm start", "eval", "rollout", "GRPO"):
        assert any(line.startswith(f"{bar}: 100%") for line in lines), bar
    assert any(line.startswith("warm start: 100% 2/2") and "loss" in line and "tok/s" in line for line in lines)
    assert any(line.startswith("GRPO: 100% 1/1") and "reward" in line and "tok/s" in line for line in lines)


def test_a_run_that_cannot_learn_warns_after_its_stretch(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A random-init policy without a warm start never solves the task: every group is uniform; with 4 groups a step
    the third step completes the stretch."""
    config = tiny_config(tmp_path / "run", steps=3, groups_per_step=4)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        train(config)
    [warning] = [r.message for r in caplog.records if "no learning signal" in r.message]
    assert "steps 1-3: the 12 groups of these 3 steps all had uniform rewards (all 0)" in warning


def test_the_warm_start_bar_shows_the_loss(capsys: pytest.CaptureFixture[str]) -> None:
    env = gymnasium.make(ENV_ID, **ENV_KWARGS)
    traces = [run_episode(env, ScriptedPolicy(env), seed=k) for k in range(2)]
    model = tiny_model("llama", vocab_size=2048, hidden=32, layers=1)
    losses = supervised_warm_start(model, traces, SFTConfig(steps=2, batch_size=1), progress=True)
    err = capsys.readouterr().err
    assert "warm start" in err and f"loss {losses[-1]:.3f}" in err and "tok/s" in err
    supervised_warm_start(model, traces, SFTConfig(steps=1, batch_size=1), progress=False)
    assert "warm start" not in capsys.readouterr().err
