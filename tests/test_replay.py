"""Offline GRPO from a store (``longstraw replay``): selection, staleness, truncated importance weights, forking
from a logged turn with re-executed tools, tamper detection and bad input."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import gymnasium
import numpy as np
import pytest
import torch
from tiny_runs import ENV_ID, ENV_KWARGS, checkpoint_weights, tiny_config, warm_started_policy

import longstraw_agents.trainer.grpo as grpo
from longstraw_agents.envs import unwrap_tool_env
from longstraw_agents.replay import ReplayConfig, Replayer, ReplayMismatch, as_context, replay, replay_prefix
from longstraw_agents.store import Store, StoreError
from longstraw_agents.trainer import GRPOTrainer
from longstraw_agents.training import train

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
    with Store.open(source / "trajectories.db", create=False) as store:
        rows = store.db.query("SELECT group_id FROM episodes GROUP BY group_id HAVING MIN(reward) < MAX(reward)")
        return [row["group_id"] for row in rows]


def test_replay_trains_on_the_selected_groups(source: Path, tmp_path: Path) -> None:
    groups = mixed_groups(source)
    assert groups, "no logged group has mixed rewards: replay would see zero gradients"
    where = "group_id IN ({})".format(", ".join(f"'{g}'" for g in groups))
    out = replay(source / "trajectories.db", ReplayConfig(where=where, tis_cap=1.5), out_dir=tmp_path / "replay")

    assert out == tmp_path / "replay"
    selected, step = metrics(out)
    assert selected["phase"] == "replay_select" and selected["policy_version"] == SOURCE_STEPS
    assert selected["episodes"] == G * len(groups) and selected["groups"] == len(groups)
    assert step["phase"] == "grpo" and step["step"] == step["policy_version"] == SOURCE_STEPS + 1
    assert step["grad_norm"] > 0
    assert GRPOTrainer.checkpoint_info(out / "checkpoint")["policy_version"] == SOURCE_STEPS + 1
    before, after = checkpoint_weights(source), checkpoint_weights(out)
    assert any(not after[name].equal(before[name]) for name in before)
    trainer_config = json.loads((out / "config.json").read_text())["trainer"]
    assert trainer_config["loss"]["importance"] == "tis" and trainer_config["loss"]["tis_cap"] == 1.5
    with Store.open(source / "trajectories.db", create=False) as store:
        assert store.count() == SOURCE_STEPS * 2 * G  # the source store is only read


def test_where_filters_the_episodes(source: Path, tmp_path: Path) -> None:
    groups, counts = select(source, tmp_path / "a", where="group_id = 'step1-g0'")
    assert counts["episodes"] == G and [{t.group_id for t in g} for g in groups] == [{"step1-g0"}]
    groups, counts = select(source, tmp_path / "b", where="reward >= 0")
    assert counts["episodes"] == SOURCE_STEPS * 2 * G and len(groups) == SOURCE_STEPS * 2
    _, counts = select(source, tmp_path / "c", where="group_id = 'step1-g0' AND id % 4 = 0")
    assert counts == {"episodes": 1, "stale": 0, "skipped_stale": 0, "skipped_small_groups": 1}
    with pytest.raises(StoreError, match="no such column"):
        select(source, tmp_path / "d", where="rewrd > 0")


def test_stale_episodes_are_skipped_or_kept_and_flagged(source: Path, tmp_path: Path) -> None:
    # The source policy is at version 2; episodes of step 0 are 2 versions old, those of step 1 one.
    groups, counts = select(source, tmp_path / "skip", max_staleness=1)
    assert counts["stale"] == counts["skipped_stale"] == 2 * G
    assert {t.policy_version for g in groups for t in g} == {1}
    groups, counts = select(source, tmp_path / "keep", max_staleness=1, keep_stale=True)
    assert counts["stale"] == 2 * G and counts["skipped_stale"] == 0 and len(groups) == 4
    with pytest.raises(ValueError, match="no trainable groups"):
        replay(source / "trajectories.db", ReplayConfig(max_staleness=0), out_dir=tmp_path / "none")
    assert metrics(tmp_path / "none")[0]["skipped_stale"] == SOURCE_STEPS * 2 * G


def test_truncated_importance_weights_come_from_the_stored_behaviour_logprobs(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cap = 1.05
    seen = []

    def spy(logp, advantage, config, old_logp=None, ref_logp=None):
        seen.append((config.importance, config.tis_cap, logp.detach().clone(), old_logp))
        return original(logp, advantage, config, old_logp, ref_logp)

    original = grpo.per_token_loss
    monkeypatch.setattr(grpo, "per_token_loss", spy)
    [group_id] = mixed_groups(source)[:1]
    replay(source / "trajectories.db", ReplayConfig(where=f"group_id = '{group_id}'", tis_cap=cap), out_dir=tmp_path)

    assert seen and {(importance, tis_cap) for importance, tis_cap, _, _ in seen} == {("tis", cap)}
    weights = []
    for _, _, logp, old in seen:
        assert old is not None and not torch.isnan(old).any()  # every loss token has its behaviour logprob
        weights.append(torch.clamp(torch.exp(logp - old), max=cap).flatten())
    weights = torch.cat(weights)
    assert weights.max() == pytest.approx(cap)  # the policy moved since the logged version: some weights are cut
    assert (weights < cap).any()


def test_fork_at_replays_the_logged_turns_and_trains_on_new_continuations(source: Path, tmp_path: Path) -> None:
    where = "group_id = 'step1-g1'"
    originals = logged(source, where)
    config = ReplayConfig(where=where, fork_at=1, fork_group_size=2)
    out = replay(source / "trajectories.db", config, out_dir=tmp_path / "fork")

    selected, step = metrics(out)
    assert selected["forked_groups"] == len(originals) and step["phase"] == "grpo"
    with Store.open(out / "trajectories.db", create=False) as store:
        members = list(store.episodes())  # written fork by fork, in the order of the logged episodes
        groups = store.groups()
    assert len(members) == 2 * len(originals)
    for k, original in enumerate(originals):
        prefix = np.concatenate([s.token_ids for s in original.segments[: _end_of_turn(original, 0)]])
        for member in members[2 * k : 2 * k + 2]:
            assert member.policy_version == SOURCE_STEPS and member.seed == original.seed
            np.testing.assert_array_equal(member.token_ids()[: len(prefix)], prefix)
            replayed = [s for s in member.segments if s.role == "assistant" and s.turn == 0]
            new = [s for s in member.segments if s.role == "assistant" and s.turn >= 1]
            assert replayed and not any(s.loss_mask.any() for s in replayed)  # the replayed prefix carries no loss
            assert new and all(s.loss_mask.all() and s.logprobs is not None for s in new)
            assert _tool_results(member) == _tool_results(original)  # the tool ran again, with the same result
    # One group per logged episode, even though the logged members of a group share their seed.
    assert sorted(len(g) for g in groups.values()) == [2] * len(originals)


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
    orphan = tmp_path / "orphan"
    orphan.mkdir()
    shutil.copy(source / "trajectories.db", orphan / "trajectories.db")
    with pytest.raises(FileNotFoundError, match="config.json"):
        replay(orphan / "trajectories.db", ReplayConfig())
    with pytest.raises(ValueError, match="fork_group_size"):
        ReplayConfig(fork_at=1, fork_group_size=1)
