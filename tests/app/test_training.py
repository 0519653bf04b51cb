"""The online GRPO loop (``longstraw train``): run directory contents, exact resume, refusals and Ctrl-C."""

from __future__ import annotations

import json
import signal
import sqlite3
from contextlib import closing
from pathlib import Path

import pydantic
import pytest
import yaml
from accelerate.optimizer import AcceleratedOptimizer
from paths import REPO
from safetensors.torch import load_file
from tiny_runs import (
    ENV_ID,
    assert_same_weights,
    checkpoint_weights,
    tiny_config,
    tiny_config_dict,
    warm_started_policy,
)

from longstraw_agents.app.config import ConfigError, TrainConfig, check_env, load_config
from longstraw_agents.app.training import train
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
        assert list(groups) == [f"step{s}-g{g}" for s in range(STEPS) for g in range(GROUPS)]
        for group_id, members in groups.items():
            step = int(group_id.removeprefix("step").split("-")[0])
            assert len(members) == G and {t.policy_version for t in members} == {step}
            assert len({t.seed for t in members}) == 1
        rewards = [t.reward for t in store.episodes("group_id LIKE 'step0-%'")]
    assert lines[0]["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))

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


def test_an_existing_run_needs_resume_and_resume_needs_a_checkpoint(tmp_path: Path, uninterrupted: Path, policy):
    before = (uninterrupted / "config.json").read_text()
    with pytest.raises(FileExistsError, match="--resume"):
        train(run_config(uninterrupted, policy))
    assert (uninterrupted / "config.json").read_text() == before
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(run_config(tmp_path / "empty", policy), resume=True)


def test_invalid_configs_name_the_field() -> None:
    cases = {
        ("groups_per_step",): {"groups_per_step": 0},
        ("trainer", "group_size"): {"trainer": {"group_size": 0}},
        ("sampling", "temperature"): {"sampling": {"temperature": -1.0}},
        ("stepz",): {"stepz": 3},
        ("env", "id"): {"env": {"kwargs": {}}},
    }
    for location, update in cases.items():
        with pytest.raises(pydantic.ValidationError) as err:
            TrainConfig.model_validate(tiny_config_dict("runs/x", **update))
        assert [e["loc"] for e in err.value.errors()] == [location]
    with pytest.raises(pydantic.ValidationError, match="exactly one of model.preset and model.path"):
        TrainConfig.model_validate(tiny_config_dict("runs/x", model={"preset": "llama", "path": "/models/x"}))


TOML = """
groups_per_step = 2
steps = 2
output_dir = "{out}"
checkpoint_every = 1
progress = false

[env]
id = "{env_id}"
kwargs = {{ num_operations = 1, min_operand = 1, max_operand = 9, word_problems = false, max_turns = 3 }}

[model]
preset = "llama"
overrides = {{ hidden = 32, layers = 1 }}

[trainer]
group_size = 4
lr = 1e-3

[sampling]
max_new_tokens = 24
"""


def test_load_config_reads_yaml_and_toml_alike(tmp_path: Path) -> None:
    expected = tiny_config(tmp_path / "run")
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(tiny_config_dict(tmp_path / "run")))
    (tmp_path / "train.toml").write_text(TOML.format(out=tmp_path / "run", env_id=ENV_ID))
    assert load_config(tmp_path / "train.yaml") == expected
    assert load_config(tmp_path / "train.toml") == expected
    (tmp_path / "train.json").write_text("{}")
    with pytest.raises(ValueError, match=r"\.yaml, \.yml or \.toml"):
        load_config(tmp_path / "train.json")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("env: {id: LongStraw/Calculator-v0}\nsteps: -1\n")
    with pytest.raises(pydantic.ValidationError, match="steps"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "broken.yaml").write_text("env: {id: [unclosed\n")
    with pytest.raises(ValueError, match=r"broken\.yaml: not valid YAML"):
        load_config(tmp_path / "broken.yaml")
    (tmp_path / "broken.toml").write_text("[env\n")
    with pytest.raises(ValueError, match=r"broken\.toml: not valid TOML"):
        load_config(tmp_path / "broken.toml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        load_config(tmp_path / "list.yaml")


def test_the_example_config_is_valid_and_runnable() -> None:
    """examples/train_calculator.yaml (shown in README) validates and names a registered env with valid kwargs."""
    config = load_config(REPO / "examples" / "train_calculator.yaml")
    check_env(config.env)
    assert (config.trainer.mode, config.group_size, config.trainer.loss.beta) == ("exact", 8, 0.02)


def test_configs_that_cannot_run_fail_before_the_run_directory_is_written(tmp_path: Path) -> None:
    """An unknown env, bad env kwargs or a prompt over the model's context: a ConfigError before the model is
    trained or anything is written (it used to surface at the first rollout)."""
    cases = {
        "env.id: unknown environment": {"env": {"id": "LongStraw/Nope-v0"}},
        r"env\.kwargs\.max_turns": {"env": {"id": ENV_ID, "kwargs": {"max_turns": 0}}},
        "context limit of 16 tokens": {"model": {"preset": "llama", "overrides": {"hidden": 32}, "max_context": 16}},
    }
    for message, update in cases.items():
        with pytest.raises(ConfigError, match=message):
            train(tiny_config(tmp_path / "run", **update))
        assert not (tmp_path / "run").exists()


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
    assert sizes == {f"step{s}-g{g}": G for s in range(STEPS) for g in range(GROUPS)}


def test_ctrl_c_during_the_optimizer_update_leaves_a_consistent_checkpoint(
    tmp_path: Path, policy: Path, uninterrupted: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGINT arriving while the 2nd update is applied: the checkpoint must describe one state (parameters,
    optimizer and step counter agree), so that resuming reproduces the uninterrupted run."""
    run_dir = tmp_path / "run"
    wrapped = interrupt_on_call(AcceleratedOptimizer.step, 2, after=True, via_signal=True)
    monkeypatch.setattr(AcceleratedOptimizer, "step", wrapped)
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
