"""The online GRPO loop (``longstraw train``): run directory contents, exact resume, refusals and Ctrl-C (the
configuration itself: test_config.py)."""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from tiny_runs import (
    assert_same_weights,
    checkpoint_weights,
    tiny_config,
    tiny_config_dict,
    warm_started_policy,
)

from longstraw_agents.app import training
from longstraw_agents.app.config import ConfigError, TrainConfig
from longstraw_agents.app.replay import ReplayConfig, replay
from longstraw_agents.app.training import train
from longstraw_agents.cli import main
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.store import Store
from longstraw_agents.tokenizer import load_tokenizer
from longstraw_agents.trainer import GRPOTrainer

STEPS, GROUPS, G = 3, 2, 4


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return warm_started_policy(tmp_path_factory.mktemp("policy"))


def run_config(output_dir: Path, policy: Path, **updates) -> TrainConfig:
    model = {"preset": None, "path": str(policy)}
    return tiny_config(output_dir, model=model, steps=STEPS, groups_per_step=GROUPS, **updates)


def grpo_lines(run_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if line["phase"] == "grpo"]


def episode_ids_by_group(run_dir: Path) -> dict[str, list[list[int]]]:
    with Store.open(run_dir / "trajectories.db", create=False) as store:
        return {group: [t.token_ids().tolist() for t in members] for group, members in store.groups().items()}


def assert_store_is_sound(path: Path) -> None:
    """SQLite's own check passes and every stored episode is complete (all its segments, none still running)."""
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert conn.execute("SELECT COUNT(*) FROM episodes WHERE finish_reason = 'running'").fetchone() == (0,)
    with Store.open(path, create=False) as store:
        for trajectory in store.episodes():  # reading checks segment indices and token counts against each row
            assert trajectory.segments[-1].role == "assistant"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, policy: Path) -> Path:
    return train(run_config(tmp_path_factory.mktemp("uninterrupted") / "run", policy))


def test_a_run_writes_config_store_metrics_and_checkpoint(uninterrupted: Path, policy: Path) -> None:
    config = TrainConfig.model_validate_json((uninterrupted / "config.json").read_text())
    assert config == run_config(uninterrupted, policy)

    lines = grpo_lines(uninterrupted)
    assert [line["step"] for line in lines] == [1, 2, 3] and [line["policy_version"] for line in lines] == [1, 2, 3]
    for line in lines:
        assert {"reward_mean", "reward_std", "loss", "grad_norm", "rollout_seconds", "episode_tokens_mean"} <= set(line)
        assert sum(line["finish_reasons"].values()) == GROUPS * G
        assert line["peak_bytes"] is None and line["rss_peak_bytes"] > 0  # memory is logged without track_memory
    assert any(line["grad_norm"] > 0 for line in lines), "no step had mixed rewards: the resume tests prove nothing"

    with Store.open(uninterrupted / "trajectories.db", create=False) as store:
        assert store.count() == STEPS * GROUPS * G and len(store.runs()) == 1
        groups = store.groups()
        assert list(groups) == [f"step{s}-g{g}" for s in range(1, STEPS + 1) for g in range(GROUPS)]
        for group_id, members in groups.items():
            step = int(group_id.removeprefix("step").split("-")[0])  # counted from 1, as the metrics count
            assert len(members) == G and {t.policy_version for t in members} == {step - 1}
            assert len({t.seed for t in members}) == 1
        rewards = [t.reward for t in store.episodes("group_id LIKE 'step1-%'")]
    assert lines[0]["step"] == 1 and lines[0]["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))

    info = GRPOTrainer.checkpoint_info(uninterrupted / "checkpoint")
    assert info["step"] == STEPS and info["policy_version"] == STEPS
    start, trained = load_file(policy / "model.safetensors"), checkpoint_weights(uninterrupted)
    assert start.keys() == trained.keys() and any(not trained[name].equal(start[name]) for name in trained)


def test_resume_gives_the_parameters_of_the_uninterrupted_run(tmp_path: Path, policy: Path, uninterrupted: Path):
    run_dir = tmp_path / "run"
    train(run_config(run_dir, policy).model_copy(update={"steps": 1}))
    assert GRPOTrainer.checkpoint_info(run_dir / "checkpoint")["step"] == 1
    train(run_config(run_dir, policy), resume=True)

    assert_same_weights(checkpoint_weights(run_dir), checkpoint_weights(uninterrupted))
    assert episode_ids_by_group(run_dir) == episode_ids_by_group(uninterrupted)  # the same rollouts, step by step
    resumed, reference = grpo_lines(run_dir), grpo_lines(uninterrupted)
    assert [(r["step"], r["reward_mean"], r["loss"]) for r in resumed] == [
        (r["step"], r["reward_mean"], r["loss"]) for r in reference
    ]
    with Store.open(run_dir / "trajectories.db", create=False) as store:
        assert len(store.runs()) == 1  # the resumed run appends to its own run row


def test_a_resume_the_checkpoint_cannot_hold_is_refused_and_keeps_the_config(
    tmp_path: Path, uninterrupted: Path
) -> None:
    """Another model shape cannot take the checkpoint's weights: the refusal names the checkpoint's settings and the
    new ones, and the run's config.json stays as it was."""
    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted, run_dir)
    before = (run_dir / "config.json").read_text()
    wider = {"preset": "llama", "overrides": {"hidden": 48, "layers": 1}}
    config = tiny_config(run_dir, steps=STEPS + 1, groups_per_step=GROUPS, model=wider)
    refusal = r"written with model .*policy.*does not load with model preset llama .*'hidden': 48.*Size mismatch"
    with pytest.raises(ConfigError, match=refusal):
        train(config, resume=True)
    assert (run_dir / "config.json").read_text() == before


def test_an_existing_run_needs_resume_and_resume_needs_a_checkpoint(tmp_path: Path, uninterrupted: Path, policy):
    before = (uninterrupted / "config.json").read_text()
    with pytest.raises(FileExistsError, match="--resume"):
        train(run_config(uninterrupted, policy))
    assert (uninterrupted / "config.json").read_text() == before
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(run_config(tmp_path / "empty", policy), resume=True)


@pytest.fixture(autouse=True)
def terminal_sigint():
    """What a terminal's Ctrl-C meets: Python's default SIGINT handler, the signal not blocked. (Once, in CI, a
    worker process that had run other files did not raise on ``raise_signal(SIGINT)``; the tests here are about
    the training loop, not about what those files left behind.)"""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    yield
    signal.signal(signal.SIGINT, previous)


def interrupt_on_call(target, number: int, *, after: bool = False, via_signal: bool = False):
    """A wrapper of ``target`` that Ctrl-C's the ``number``-th call: before it runs, or right after it returned;
    with a KeyboardInterrupt raised directly or with a real SIGINT (what a terminal sends)."""
    calls = {"n": 0}

    def interrupt() -> None:
        if via_signal:
            signal.raise_signal(signal.SIGINT)  # Python's default handler raises KeyboardInterrupt right away
        else:
            raise KeyboardInterrupt

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == number and not after:
            interrupt()
        result = target(*args, **kwargs)
        if calls["n"] == number and after:
            interrupt()
        return result

    return wrapper


def interrupted_then_resumed(run_dir: Path, policy: Path) -> None:
    """The interrupted run leaves a sound store and a loadable checkpoint; resuming finishes the run."""
    assert_store_is_sound(run_dir / "trajectories.db")
    vocab_size = load_tokenizer("longstraw-bpe").vocab_size
    fresh = GRPOTrainer(tiny_model("llama", vocab_size=vocab_size, hidden=32, layers=1))
    fresh.load_checkpoint(run_dir / "checkpoint")
    train(run_config(run_dir, policy, checkpoint_every=5), resume=True)
    assert_store_is_sound(run_dir / "trajectories.db")


def test_ctrl_c_inside_a_step_leaves_a_consistent_checkpoint_and_store(
    tmp_path: Path, policy: Path, uninterrupted: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    monkeypatch.setattr(GRPOTrainer, "train_step", interrupt_on_call(GRPOTrainer.train_step, 2))
    with pytest.raises(KeyboardInterrupt):
        train(run_config(run_dir, policy, checkpoint_every=5))  # no periodic checkpoint before the interrupt
    monkeypatch.undo()

    assert GRPOTrainer.checkpoint_info(run_dir / "checkpoint")["step"] == 1
    assert [line["step"] for line in grpo_lines(run_dir)] == [1]
    with Store.open(run_dir / "trajectories.db", create=False) as store:
        assert store.count() == 2 * GROUPS * G  # step 1's rollouts were complete when its update was interrupted
    interrupted_then_resumed(run_dir, policy)
    assert_same_weights(checkpoint_weights(run_dir), checkpoint_weights(uninterrupted))
    assert [line["step"] for line in grpo_lines(run_dir)] == [1, 2, 3]


def test_resuming_an_interrupted_step_does_not_store_its_groups_twice(
    tmp_path: Path, policy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interrupted step is rolled out again on resume; its groups must not end up with 2G members (offline
    replay regroups episodes by group_id)."""
    run_dir = tmp_path / "run"
    monkeypatch.setattr(GRPOTrainer, "train_step", interrupt_on_call(GRPOTrainer.train_step, 2))
    with pytest.raises(KeyboardInterrupt):
        train(run_config(run_dir, policy, checkpoint_every=5))
    monkeypatch.undo()
    train(run_config(run_dir, policy, checkpoint_every=5), resume=True)
    sizes = {group: len(members) for group, members in episode_ids_by_group(run_dir).items()}
    assert sizes == {f"step{s}-g{g}": G for s in range(1, STEPS + 1) for g in range(GROUPS)}


def test_ctrl_c_during_the_optimizer_update_leaves_a_consistent_checkpoint(
    tmp_path: Path, policy: Path, uninterrupted: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGINT arriving while the 2nd update is applied: the checkpoint must describe one state (parameters,
    optimizer and step counter agree), so that resuming reproduces the uninterrupted run."""
    run_dir = tmp_path / "run"
    wrapped = interrupt_on_call(torch.optim.AdamW.step, 2, after=True, via_signal=True)
    monkeypatch.setattr(torch.optim.AdamW, "step", wrapped)
    with pytest.raises(KeyboardInterrupt):
        train(run_config(run_dir, policy, checkpoint_every=5))
    monkeypatch.undo()
    # The 2nd update was applied whole and checkpointed: its metrics line was written too.
    assert GRPOTrainer.checkpoint_info(run_dir / "checkpoint")["step"] == 2
    assert [line["step"] for line in grpo_lines(run_dir)] == [1, 2]
    interrupted_then_resumed(run_dir, policy)
    assert_same_weights(checkpoint_weights(run_dir), checkpoint_weights(uninterrupted))
    assert [line["step"] for line in grpo_lines(run_dir)] == [1, 2, 3]


def test_ctrl_c_after_a_step_before_its_checkpoint_still_leaves_one(tmp_path: Path, policy: Path, uninterrupted):
    """SIGINT while the 2nd step's metrics are written (its update is done, no periodic checkpoint is due)."""
    run_dir = tmp_path / "run"
    on_metrics = interrupt_on_call(lambda record: None, 2, via_signal=True)  # 1st record: step 1, 2nd: step 2
    with pytest.raises(KeyboardInterrupt):
        train(run_config(run_dir, policy, checkpoint_every=5), on_metrics=on_metrics)
    interrupted_then_resumed(run_dir, policy)
    assert_same_weights(checkpoint_weights(run_dir), checkpoint_weights(uninterrupted))


def test_each_evaluation_is_run_once_however_often_the_run_is_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C in the first evaluation leaves a checkpoint of step 0: resuming runs that evaluation, the step and the
    last evaluation; resuming the finished run adds no line (~3 s)."""
    config = tiny_config(tmp_path / "run", steps=1, groups_per_step=1, eval_episodes=1)
    monkeypatch.setattr(training, "evaluate", interrupt_on_call(training.evaluate, 1))
    with pytest.raises(KeyboardInterrupt):
        train(config)
    monkeypatch.undo()
    assert GRPOTrainer.checkpoint_info(tmp_path / "run" / "checkpoint")["step"] == 0
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    run_dir = train(config, resume=True)
    lines = (run_dir / "metrics.jsonl").read_text()
    assert [(r["phase"], r["step"]) for r in map(json.loads, lines.splitlines())] == [
        ("eval", 0),
        ("grpo", 1),
        ("eval", 1),
    ]
    train(config, resume=True)  # finished: nothing to train, and both evaluations are there
    assert (run_dir / "metrics.jsonl").read_text() == lines


def test_the_context_limit_stops_at_a_sliding_window_the_engine_cannot_pass() -> None:
    from transformers import AutoModelForCausalLM, MistralConfig

    from longstraw_agents.app.config import ModelSpec
    from longstraw_agents.app.run import max_context_of

    config = MistralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, sliding_window=48,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    assert max_context_of(model, ModelSpec(preset="llama")) == 48
    assert max_context_of(model, ModelSpec(preset="llama", max_context=32)) == 32
    config.sliding_window = None
    assert max_context_of(AutoModelForCausalLM.from_config(config), ModelSpec(preset="llama")) == 512


def test_a_needle_search_run_with_a_context_budget_smaller_than_its_episodes_trains_on_edited_episodes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``longstraw train`` on NeedleSearch with a summary context policy: the random policy's episodes outgrow the
    budget, ask for summaries and continue from them; the store keeps the edits, each step trains over the physical
    sequences: the metrics' sequence tokens are the stored episodes', and offline replay trains the same ones."""
    context = {"max_context_tokens": 1400, "strategy": {"kind": "summary", "threshold": 900}}
    env = {"id": "LongStraw/NeedleSearch-v0", "kwargs": {"target_tokens": 4096, "max_turns": 10, "context": context}}
    config = tiny_config_dict(tmp_path / "run", env=env, steps=1, groups_per_step=1, checkpoint_every=1)
    (tmp_path / "needle.yaml").write_text(yaml.safe_dump(config))

    assert main(["train", str(tmp_path / "needle.yaml")]) == 0

    run = tmp_path / "run"
    with Store.open(run / "trajectories.db", create=False) as store:
        episodes = list(store.episodes())
    assert len(episodes) == 4 and all(t.is_edited and t.reward is not None for t in episodes)
    assert all(t.num_tokens > 1400 for t in episodes)  # longer than the context holds
    [step] = grpo_lines(run)
    sequences = [s for t in episodes for s in t.physical_sequences()]
    lengths = sum(sum(len(t.segments[k]) for k in s.segments) for t in episodes for s in t.physical_sequences())
    assert step["sequence_tokens"] == lengths > step["unique_tokens"] and len(sequences) > len(episodes)

    main(["inspect", str(run / "trajectories.db"), "--episode", str(1)])
    shown = capsys.readouterr().out
    assert f"{len(episodes[0].edits)} context edit" in shown and "summarize segments" in shown
    # offline replay of the run's group (one reward raised, so that the group trains) goes over the same sequences
    with closing(sqlite3.connect(run / "trajectories.db")) as db, db:
        db.execute("UPDATE episodes SET reward = 1.0 WHERE id = (SELECT MIN(id) FROM episodes)")
    out = replay(run / "trajectories.db", ReplayConfig(), out_dir=tmp_path / "replay")
    [replayed] = grpo_lines(out)
    assert replayed["sequence_tokens"] == lengths and replayed["unique_tokens"] == step["unique_tokens"]
    assert replayed["grad_norm"] > 0
