"""Offline GRPO from a store (``longstraw replay``): selection, staleness, truncated importance weights, forking
from a logged turn with re-executed tools, tamper detection and bad input."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import gymnasium
import numpy as np
import pytest
import sqlite_utils
import torch
from tiny_runs import ENV_ID, ENV_KWARGS, checkpoint_weights, tiny_config, warm_started_policy
from tracker_logs import as_float32, expected_scalars, tensorboard_scalars

from longstraw_agents.app.export import load_run_policy
from longstraw_agents.app.records import MetricsRecord, ReplaySelectRecord
from longstraw_agents.app.replay import (
    ReplayConfig,
    Replayer,
    ReplayMismatch,
    as_context,
    replay,
    replay_prefix,
    select_logged_groups,
)
from longstraw_agents.app.training import train
from longstraw_agents.envs import unwrap_tool_env
from longstraw_agents.store import Store, StoreError
from longstraw_agents.tools import ToolRegistry, ToolResult
from longstraw_agents.trainer import GRPOTrainer, LossConfig, grpo_backward_trajectories
from longstraw_agents.trainer.loss import GRPOLoss
from longstraw_agents.trajectory import Segment, Trajectory

SOURCE_STEPS, G = 2, 4


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run (policy version 2) whose store holds episodes of policy versions 0 and 1."""
    policy = warm_started_policy(tmp_path_factory.mktemp("policy"))
    model = {"preset": None, "path": str(policy)}
    return train(tiny_config(tmp_path_factory.mktemp("source") / "run", model=model, steps=SOURCE_STEPS))


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def logged(source: Path, where: str) -> list:
    with Store.open(source / "trajectories.db", create=False) as store:
        return list(store.episodes(where))


def select(source: Path, out: Path, **config) -> tuple[list[list], dict[str, int]]:
    replayer = Replayer(source / "trajectories.db", None, out, ReplayConfig(**config))
    try:
        return replayer.logged_groups()
    finally:
        replayer.close()


def mixed_groups(source: Path) -> list[str]:
    db = sqlite_utils.Database(source / "trajectories.db")  # any SQLite reader can read the store
    rows = db.query("SELECT group_id FROM episodes GROUP BY group_id HAVING MIN(reward) < MAX(reward)")
    return [row["group_id"] for row in rows]


def test_replay_trains_on_the_selected_groups(source: Path, tmp_path: Path) -> None:
    groups = mixed_groups(source)
    assert groups, "no logged group has mixed rewards: replay would see zero gradients"
    where = "group_id IN ({})".format(", ".join(f"'{g}'" for g in groups))
    out = replay(source / "trajectories.db", ReplayConfig(where=where, tis_cap=1.5), out_dir=tmp_path / "replay")

    assert out == tmp_path / "replay"
    selected, step = metrics(out)
    assert selected["phase"] == "replay_select" and selected["policy_version"] == SOURCE_STEPS
    assert selected["episodes"] == G * len(groups) and selected["groups"] == selected["groups_trained"] == len(groups)
    assert selected["policy_source"] == "checkpoint" and selected["skipped_ungrouped"] == 0
    assert step["phase"] == "grpo" and step["step"] == step["policy_version"] == SOURCE_STEPS + 1
    assert step["grad_norm"] > 0
    tokens = [t.num_tokens for t in logged(source, where)]
    assert step["episode_tokens_mean"] == pytest.approx(sum(tokens) / len(tokens))  # printed as "tokens N"
    assert GRPOTrainer.checkpoint_info(out / "checkpoint")["policy_version"] == SOURCE_STEPS + 1
    before, after = checkpoint_weights(source), checkpoint_weights(out)
    assert any(not after[name].equal(before[name]) for name in before)
    trainer_config = json.loads((out / "config.json").read_text())["trainer"]
    assert trainer_config["loss"]["importance"] == "tis" and trainer_config["loss"]["tis_cap"] == 1.5
    with Store.open(source / "trajectories.db", create=False) as store:
        assert store.count() == SOURCE_STEPS * 2 * G  # the source store is only read


def test_replay_reports_to_the_trackers_of_its_source_run(source: Path, tmp_path: Path) -> None:
    """A replay run takes its config, report_to included, from the source run: its TensorBoard logs under the replay
    directory hold its metrics.jsonl numbers (the selection at the loaded checkpoint's step, then its steps)."""
    reporting = tmp_path / "source"
    shutil.copytree(source, reporting)
    config = json.loads((reporting / "config.json").read_text())
    (reporting / "config.json").write_text(json.dumps({**config, "report_to": ["tensorboard"]}))
    out = replay(reporting / "trajectories.db", ReplayConfig(), out_dir=tmp_path / "replay")
    expected = expected_scalars(out, {"replay_select": SOURCE_STEPS})
    assert [step for step, _ in expected["grpo/loss"]] == [SOURCE_STEPS + 1]
    assert tensorboard_scalars(out / "tensorboard") == as_float32(expected)


def test_where_keeps_whole_groups_and_only_groups_with_reward_differences_train(source: Path, tmp_path: Path) -> None:
    mixed = mixed_groups(source)
    groups, counts = select(source, tmp_path / "a", where="group_id = 'step2-g0' AND id % 4 = 0")
    assert counts["episodes"] == G and counts["groups"] == 1 and counts["skipped_small_groups"] == 0  # the whole group
    assert [{t.group_id for t in g} for g in groups] == ([{"step2-g0"}] if "step2-g0" in mixed else [])
    groups, counts = select(source, tmp_path / "b", where="reward >= 0")
    assert counts["episodes"] == SOURCE_STEPS * 2 * G and counts["groups"] == SOURCE_STEPS * 2
    assert sorted(g[0].group_id for g in groups) == sorted(mixed)  # all-equal rewards: zero advantages, skipped
    assert counts["groups_skipped_uniform"] == SOURCE_STEPS * 2 - len(mixed) == counts["groups"] - len(groups)
    # "reward > 0" selects the groups that solved the task at least once, with their failures.
    groups, counts = select(source, tmp_path / "c", where="reward > 0")
    assert sorted(g[0].group_id for g in groups) == sorted(mixed)
    assert all(len(g) == G and any(t.reward == 0 for t in g) for g in groups)
    with pytest.raises(StoreError, match="no such column"):
        select(source, tmp_path / "d", where="rewrd > 0")


def scripted_episode(group: str, reward: float, env_id: str = "LongStraw/Calculator-v0") -> Trajectory:
    return Trajectory([Segment("user", [1, 2]), Segment("assistant", [3, 4])], env_id, group, 5, reward)


def test_groups_are_per_run_and_ungrouped_episodes_are_skipped(tmp_path: Path) -> None:
    """Two runs reuse the group id "g0", and scripted episodes of several envs have no group id: neither may be
    merged into one bogus group."""
    with Store.open(tmp_path / "mixed.db") as store:
        a = store.add_run("a", config={}, model="m", tokenizer="t")
        b = store.add_run("b", config={}, model="m", tokenizer="t")
        store.add_episodes([scripted_episode("g0", r) for r in (1.0, 0.0)], run_id=a)
        store.add_episodes([scripted_episode("", 1.0, env) for env in ("A-v0", "B-v0", "C-v0")], run_id=a)
        store.add_episodes([scripted_episode("", 0.0)], run_id=a)
        store.add_episodes([scripted_episode("g0", 1.0) for _ in range(2)], run_id=b)  # uniform
        store.add_episodes([scripted_episode("g1", 0.0)], run_id=b)  # alone
        groups, counts = select_logged_groups(store, ReplayConfig(), policy_version=0)
        assert [[t.reward for t in g] for g in groups] == [[1.0, 0.0]]
        assert counts == {
            "episodes": 5,
            "stale": 0,
            "skipped_stale": 0,
            "skipped_unrewarded": 0,
            "skipped_small_groups": 1,
            "skipped_ungrouped": 4,
            "groups": 2,
            "groups_skipped_uniform": 1,
            "groups_trained": 1,
        }
        _, counts = select_logged_groups(store, ReplayConfig(where="reward > 0"), policy_version=0)
        assert counts["skipped_ungrouped"] == 3 and counts["episodes"] == 4  # both g0 groups, whole


def test_episodes_without_a_reward_are_skipped_and_counted(tmp_path: Path) -> None:
    with Store.open(tmp_path / "unrewarded.db") as store:
        run = store.add_run("a", config={}, model="m", tokenizer="t")
        store.add_episodes([scripted_episode("g0", r) for r in (1.0, 0.0, None)], run_id=run)  # type: ignore[arg-type]
        store.add_episodes([scripted_episode("g1", r) for r in (1.0, None)], run_id=run)  # type: ignore[arg-type]
        groups, counts = select_logged_groups(store, ReplayConfig(), policy_version=0)
    assert [[t.reward for t in g] for g in groups] == [[1.0, 0.0]]
    assert (counts["skipped_unrewarded"], counts["skipped_small_groups"]) == (2, 1)


def test_stale_episodes_are_skipped_or_kept_and_flagged(source: Path, tmp_path: Path) -> None:
    # The source policy is at version 2; episodes of step 0 are 2 versions old, those of step 1 one.
    groups, counts = select(source, tmp_path / "skip", max_staleness=1)
    assert counts["stale"] == counts["skipped_stale"] == 2 * G and counts["groups"] == 2
    assert {t.policy_version for g in groups for t in g} <= {1}
    groups, counts = select(source, tmp_path / "keep", max_staleness=1, keep_stale=True)
    assert counts["stale"] == 2 * G and counts["skipped_stale"] == 0 and counts["groups"] == 4
    records: list[MetricsRecord] = []
    with pytest.raises(ValueError, match="no trainable groups"):
        config = ReplayConfig(max_staleness=0)
        replay(source / "trajectories.db", config, out_dir=tmp_path / "none", on_metrics=records.append)
    [selected] = records  # reported as it happened; the failed replay's directory is removed
    assert isinstance(selected, ReplaySelectRecord) and selected.skipped_stale == SOURCE_STEPS * 2 * G
    assert not (tmp_path / "none").exists()


def test_uniform_groups_spend_no_policy_version(source: Path, tmp_path: Path) -> None:
    uniform = [
        g
        for g in (f"step{s}-g{k}" for s in range(1, SOURCE_STEPS + 1) for k in range(2))
        if g not in mixed_groups(source)
    ]
    assert uniform, "the source run (seeded) must log at least one group with equal rewards"
    where = f"group_id = '{uniform[0]}'"
    records: list[MetricsRecord] = []
    with pytest.raises(ValueError, match="no trainable groups.*groups_skipped_uniform 1"):
        replay(
            source / "trajectories.db", ReplayConfig(where=where), out_dir=tmp_path / "out", on_metrics=records.append
        )
    [selected] = records
    assert isinstance(selected, ReplaySelectRecord)
    assert selected.groups == selected.groups_skipped_uniform == 1 and selected.groups_trained == 0
    assert not (tmp_path / "out").exists()  # no checkpoint, no partial run


def test_truncated_importance_weights_come_from_the_stored_behaviour_logprobs(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cap = 1.05
    seen = []

    def spy(self, logp, advantage, old_logp=None, ref_logp=None):
        seen.append((self.config.importance, self.config.tis_cap, logp.detach().clone(), old_logp))
        return original(self, logp, advantage, old_logp, ref_logp)

    original = GRPOLoss.__call__
    monkeypatch.setattr(GRPOLoss, "__call__", spy)
    [group_id] = mixed_groups(source)[:1]
    for trajectory in logged(source, f"group_id = '{group_id}'"):  # every loss token has its behaviour logprob
        for segment in trajectory:
            assert not segment.loss_mask.any() or np.isfinite(segment.logprobs[segment.loss_mask]).all()
    replay(source / "trajectories.db", ReplayConfig(where=f"group_id = '{group_id}'", tis_cap=cap), out_dir=tmp_path)

    assert seen and {(importance, tis_cap) for importance, tis_cap, _, _ in seen} == {("tis", cap)}
    weights = []
    for _, _, logp, old in seen:
        assert old is not None
        known = ~torch.isnan(old)  # NaN: context tokens inside a fused node (no loss there)
        weights.append(torch.clamp(torch.exp(logp.expand_as(old)[known] - old[known]), max=cap).flatten())
    weights = torch.cat(weights)
    assert weights.max() == pytest.approx(cap)  # the policy moved since the logged version: some weights are cut
    assert (weights < cap).any()


def test_fork_at_replays_the_logged_turns_and_trains_on_new_continuations(source: Path, tmp_path: Path) -> None:
    where = "group_id LIKE 'step%'"  # every logged episode
    originals = logged(source, where)
    # 8 continuations of each of the 16 logged episodes: training needs some group whose answers differ in reward,
    # and this tiny policy solves about one in ten (with one group of 4 forks, whether it did turned on which ids
    # the prompts encode to, and then on the warm start's attention kernel)
    fork = 8
    config = ReplayConfig(where=where, fork_at=1, fork_group_size=fork, recorded_tools=False)
    out = replay(source / "trajectories.db", config, out_dir=tmp_path / "fork")

    selected, step = metrics(out)
    assert selected["forked_groups"] == len(originals) and step["phase"] == "grpo"
    with Store.open(out / "trajectories.db", create=False) as store:
        members = list(store.episodes())  # written fork by fork, in the order of the logged episodes
        groups = store.groups()
    assert len(members) == fork * len(originals)
    for k, original in enumerate(originals):
        prefix = np.concatenate([s.token_ids for s in original.segments[: _end_of_turn(original, 0)]])
        for member in members[fork * k : fork * (k + 1)]:
            assert member.policy_version == SOURCE_STEPS and member.seed == original.seed
            np.testing.assert_array_equal(member.token_ids()[: len(prefix)], prefix)
            replayed = [s for s in member.segments if s.role == "assistant" and s.turn == 0]
            new = [s for s in member.segments if s.role == "assistant" and s.turn >= 1]
            assert replayed and not any(s.loss_mask.any() for s in replayed)  # the replayed prefix carries no loss
            assert new and all(s.loss_mask.all() and s.logprobs is not None for s in new)
            assert _tool_results(member) == _tool_results(original)  # the tool ran again, with the same result
    # One group per logged episode, even though the logged members of a group share their seed.
    assert sorted(len(g) for g in groups.values()) == [fork] * len(originals)


def run_copy(source: Path, path: Path, **config_updates) -> Path:
    """A copy of the source run directory whose config.json has ``config_updates`` applied (top-level keys)."""
    shutil.copytree(source, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **config_updates}))
    return path


def test_fork_at_skips_what_cannot_be_forked_and_rebuilds_the_logged_env(
    source: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The run's config now names other tasks: the env must come from the episode's own run row and info.
    run = run_copy(
        source, tmp_path / "run", env={"id": ENV_ID, "kwargs": {**ENV_KWARGS, "min_operand": 50, "max_operand": 99}}
    )
    with Store.open(run / "trajectories.db", create=False) as store:
        record = store.get_record(1)  # a two-turn episode: a calculator call, then the answer
        original, run_id = record.trajectory, record.run_id
        prompt = [s for s in original.segments if s.role in ("system", "user") and s.turn == 0]
        answer = [s for s in original.segments if s.role == "assistant"][-1]
        answered_at_once = dataclasses.replace(original, segments=[*prompt, dataclasses.replace(answer, turn=0)])
        bad = [
            dataclasses.replace(original, env_id="LongStraw/Nope-v0"),
            dataclasses.replace(original, seed=None),
            answered_at_once,
        ]
        ids = store.add_episodes(bad, run_id=run_id)
    where = f"id IN (1, {', '.join(map(str, ids))})"
    replayer = Replayer(run / "trajectories.db", None, tmp_path / "out", ReplayConfig(where=where, fork_at=1))
    try:
        with caplog.at_level(logging.WARNING, logger="longstraw_agents.app.replay"):
            groups, counts = replayer.forked_groups()
    finally:
        replayer.close()
    assert counts["forked_groups"] == 1 and counts["fork_skipped"] == 3
    assert [counts[f"fork_skipped_{r}"] for r in ("env", "no_seed", "too_short", "mismatch")] == [1, 1, 1, 0]
    assert "skipped 3 episodes that cannot be forked" in caplog.text and "LongStraw/Nope-v0" in caplog.text
    with Store.open(tmp_path / "out" / "trajectories.db", create=False) as store:
        members = list(store.episodes())
    prefix = np.concatenate([s.token_ids for s in original.segments[: _end_of_turn(original, 0)]])
    assert len(members) == 4 and len(groups) == counts["groups_trained"] <= 1
    for member in members:
        np.testing.assert_array_equal(member.token_ids()[: len(prefix)], prefix)
        # The logged result itself (its timing too): the tool was not run again.
        assert (
            next(s for s in member.segments if s.role == "tool").tool_calls
            == next(s for s in original.segments if s.role == "tool").tool_calls
        )


def test_recorded_tools_replay_a_nondeterministic_tool(source: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = logged(source, "id = 1")[0]

    def another_answer(self, call) -> ToolResult:  # a tool whose output changed since the episode was logged
        return ToolResult(name="calculator", ok=True, content="13")

    monkeypatch.setattr(ToolRegistry, "call", another_answer)
    with pytest.raises(ReplayMismatch, match="observation after turn 0"):
        replay_prefix(fresh_env(), original, 1, recorded_tools=False)
    env = fresh_env()
    ids = replay_prefix(env, original, 1)  # recorded tools by default
    np.testing.assert_array_equal(ids, original.token_ids()[: len(ids)])
    assert "call" not in vars(env.registry)  # the continuation's own tool calls run live


def _tool_results(trajectory) -> list[dict]:
    tool = next(s for s in trajectory.segments if s.role == "tool")
    return [{k: v for k, v in record.items() if k != "elapsed_s"} for record in tool.tool_calls]


def _end_of_turn(trajectory, turn: int) -> int:
    """Index after the observation that follows assistant turn ``turn``."""
    actions = [k for k, s in enumerate(trajectory.segments) if s.role == "assistant"]
    return actions[turn + 1]


def fresh_env():
    return unwrap_tool_env(gymnasium.make(ENV_ID, **ENV_KWARGS))


def test_replay_prefix_re_executes_the_log_and_detects_tampering(source: Path) -> None:
    original = logged(source, "id = 1")[0]
    ids = replay_prefix(fresh_env(), original, 1)
    np.testing.assert_array_equal(ids, original.token_ids()[: len(ids)])
    assert len(ids) == sum(len(s) for s in original.segments[: _end_of_turn(original, 0)])

    def tampered(role: str):
        k = next(k for k, s in enumerate(original.segments) if s.role == role)
        segment = original.segments[k]
        changed = dataclasses.replace(segment, token_ids=segment.token_ids[::-1].copy())
        return dataclasses.replace(original, segments=[*original.segments[:k], changed, *original.segments[k + 1 :]])

    with pytest.raises(ReplayMismatch, match="observation after turn 0"):
        replay_prefix(fresh_env(), tampered("tool"), 1)
    with pytest.raises(ReplayMismatch, match="prompt"):
        replay_prefix(fresh_env(), tampered("user"), 0)
    with pytest.raises(ReplayMismatch, match="before the fork point 2"):
        replay_prefix(fresh_env(), original, 2)  # a two-turn episode ends at turn 1
    with pytest.raises(ReplayMismatch, match="no seed"):
        replay_prefix(fresh_env(), dataclasses.replace(original, seed=None), 1)
    edited = evicting_before_the_answer(original, original.group_id)  # the tool output evicted before turn 1
    np.testing.assert_array_equal(replay_prefix(fresh_env(), edited, 0), replay_prefix(fresh_env(), original, 0))
    with pytest.raises(ReplayMismatch, match="edited its context before turn 1") as refused:
        replay_prefix(fresh_env(), edited, 1)
    assert refused.value.reason == "edited"


def test_as_context_drops_the_loss_of_earlier_turns_only(source: Path) -> None:
    original = logged(source, "id = 2")[0]
    context = as_context(original, 1)
    for before, after in zip(original.segments, context.segments, strict=True):
        np.testing.assert_array_equal(after.token_ids, before.token_ids)
        expected = before.loss_mask if before.role != "assistant" or before.turn >= 1 else np.zeros(len(before), bool)
        np.testing.assert_array_equal(after.loss_mask, expected)
    assert original.loss_mask().any()  # the input is left as it was


def test_replay_loads_the_policy_of_a_checkpoint_whose_save_was_cut_short(source: Path, tmp_path: Path) -> None:
    """A save killed between moving the old checkpoint aside and renaming the new one leaves ``checkpoint.old``;
    the trainer resumes from it, and so must replay."""
    run = tmp_path / "run"
    shutil.copytree(source, run)
    (run / "checkpoint").rename(run / "checkpoint.old")
    replayer = Replayer(run / "trajectories.db", None, tmp_path / "out", ReplayConfig())
    try:
        assert replayer.trainer.policy_version == SOURCE_STEPS
    finally:
        replayer.close()


def test_bad_input_is_a_clear_error(source: Path, tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no store"):
        replay(tmp_path / "missing.db", ReplayConfig())
    (tmp_path / "notes.db").write_text("not a database\n" * 100)
    with pytest.raises(StoreError, match="not a longstraw store"):
        replay(tmp_path / "notes.db", ReplayConfig())
    # The store is checked before the run directory: an empty store is the problem, not the missing config.json.
    empty = tmp_path / "empty"
    Store.open(empty / "trajectories.db").close()
    with pytest.raises(StoreError, match="holds no episodes"):
        replay(empty / "trajectories.db", ReplayConfig())
    assert not (empty / "replay").exists()  # nothing was built
    orphan = tmp_path / "orphan"
    orphan.mkdir()
    shutil.copy(source / "trajectories.db", orphan / "trajectories.db")
    with pytest.raises(FileNotFoundError, match="config.json"):
        replay(orphan / "trajectories.db", ReplayConfig())
    with pytest.raises(ValueError, match="fork_group_size"):
        ReplayConfig(fork_at=1, fork_group_size=1)


def test_an_output_directory_that_holds_a_run_is_refused_naming_out(source: Path, tmp_path: Path) -> None:
    used = run_copy(source, tmp_path / "used")
    for out, message in ((used, "already holds a run; choose another --out"), (source, "is the source run")):
        with pytest.raises(FileExistsError, match=message) as error:
            replay(source / "trajectories.db", ReplayConfig(), out_dir=out)
        assert "--resume" not in str(error.value)


def test_a_failed_replay_leaves_no_output_and_keeps_what_was_there(source: Path, tmp_path: Path) -> None:
    """The replay run is written (config.json, store, ...) before groups are selected; a replay that then fails used
    to leave that partial directory behind."""
    nothing = ReplayConfig(where="reward > 100")  # valid SQL, no group: fails after the replay run was set up
    out = tmp_path / "new" / "replay"
    with pytest.raises(ValueError, match="no trainable groups selected"):
        replay(source / "trajectories.db", nothing, out_dir=out)
    assert not (tmp_path / "new").exists()  # the parent it created too
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="no trainable groups selected"):
        replay(source / "trajectories.db", nothing, out_dir=existing)
    assert [p.name for p in existing.iterdir()] == ["notes.txt"] and (existing / "notes.txt").read_text() == "mine"


def test_a_failed_start_closes_the_stores_it_opened(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = json.loads((source / "config.json").read_text())
    config["trainer"]["loss"]["beta"] = 0.1  # a KL penalty, but the run has no reference policy
    run = run_copy(source, tmp_path / "run", trainer=config["trainer"])
    opened, closed = [], []
    real_open, real_close = Store.open.__func__, Store.close
    monkeypatch.setattr(
        Store, "open", classmethod(lambda cls, *a, **k: opened.append(real_open(cls, *a, **k)) or opened[-1])
    )
    monkeypatch.setattr(Store, "close", lambda self: closed.append(self) or real_close(self))
    with pytest.raises(FileNotFoundError, match="reference"):
        Replayer(run / "trajectories.db", None, tmp_path / "out", ReplayConfig())
    # the source store, closed; the missing reference is found before the replay run writes anything
    assert len(opened) == 1 and all(store in closed for store in opened)
    assert not (tmp_path / "out").exists()


def test_a_run_without_checkpoint_warns_that_an_untrained_policy_is_trained(
    source: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = json.loads((source / "config.json").read_text())
    run = run_copy(source, tmp_path / "run", model={**config["model"], "preset": "llama", "path": None})
    shutil.rmtree(run / "checkpoint")
    with caplog.at_level(logging.WARNING, logger="longstraw_agents.app.replay"):
        replayer = Replayer(run / "trajectories.db", None, tmp_path / "out", ReplayConfig())
    try:
        assert replayer.policy_source == "random_init" and replayer.trainer.policy_version == 0
    finally:
        replayer.close()
    assert "has no checkpoint" in caplog.text and "RANDOMLY INITIALISED" in caplog.text


def evicting_before_the_answer(trajectory: Trajectory, group_id: str) -> Trajectory:
    """``trajectory`` as if the agent had evicted its first tool output before its last turn (a placeholder takes
    its place), logged under ``group_id``; unchanged but regrouped when there is no tool output before that turn."""
    last = max(k for k, s in enumerate(trajectory.segments) if s.role == "assistant")
    tools = [k for k, s in enumerate(trajectory.segments[:last]) if s.role == "tool"]
    edited = dataclasses.replace(trajectory, segments=list(trajectory.segments[:last]), group_id=group_id, edits=[])
    if tools:
        edited.evict([tools[0]], Segment("tool", trajectory.segments[tools[0]].token_ids[:3], text="[removed]"))
    edited.extend(trajectory.segments[last:])
    return edited


def test_replay_rebuilds_the_physical_sequences_of_edited_episodes_and_their_loss(source: Path, tmp_path: Path) -> None:
    """Episodes that evicted a tool output are stored with their edits; replay trains them over their physical
    sequences, and its step's loss is the loss of the same episodes computed in memory at the checkpoint."""
    run = tmp_path / "source"
    shutil.copytree(source, run)
    group_id = mixed_groups(source)[0]
    with Store.open(run / "trajectories.db") as store:
        records = list(store.records(f"group_id = '{group_id}'"))
        edited = [evicting_before_the_answer(r.trajectory, "edited") for r in records]
        assert sum(t.is_edited for t in edited) >= 2
        store.add_episodes(edited, run_id=records[0].run_id)
        assert [store.get_episode(i) for i in store.episode_ids("group_id = 'edited'")] == edited

    out = replay(run / "trajectories.db", ReplayConfig(where="group_id = 'edited'"), out_dir=tmp_path / "replay")

    _, step = metrics(out)
    trainer = json.loads((out / "config.json").read_text())["trainer"]
    policy = load_run_policy(run).model
    expected = grpo_backward_trajectories(policy, edited, mode=trainer["mode"], config=LossConfig(**trainer["loss"]))
    assert expected.sequences > len(edited)
    assert step["loss"] == pytest.approx(expected.loss, rel=1e-6)
