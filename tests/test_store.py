"""The SQLite trajectory store: token-exact round trips, the on-disk format, bad input, crashes and concurrency."""

from __future__ import annotations

import json
import os
import select
import signal
import sqlite3
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import pytest
from click.testing import CliRunner
from sqlite_utils.cli import cli as sqlite_utils_cli
from stored_episodes import LARGEST_ID, edge_case_trajectory, edited_trajectory, make_trajectory

from longstraw_agents.store import APPLICATION_ID, SCHEMA_VERSION, Store, StoreError
from longstraw_agents.store import schema as store_schema
from longstraw_agents.store.queries import _grouped_episodes
from longstraw_agents.trajectory import ContextEdit, Segment, Trajectory

TESTS_DIR = Path(__file__).resolve().parent
SUPPORT_DIR = TESTS_DIR / "support"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store.open(tmp_path / "trajectories.db") as opened:
        yield opened


def raw_query(path: Path, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    """Run ``sql`` with plain sqlite3, bypassing the store, as any other reader of the file would."""
    with closing(sqlite3.connect(path)) as conn, conn:  # the inner `with conn` commits
        return conn.execute(sql, params).fetchall()


# -- round trip and format -----------------------------------------------------------------------------------------


def test_round_trip_is_token_exact(store: Store) -> None:
    originals = [make_trajectory(n) for n in range(40)] + [edge_case_trajectory(), Trajectory()]
    ids = [store.add_episode(t) for t in originals]
    assert ids == sorted(set(ids))
    for episode_id, original in zip(ids, originals, strict=True):
        loaded = store.get_episode(episode_id)
        assert loaded == original
        for seg_loaded, seg_original in zip(loaded.segments, original.segments, strict=True):
            assert seg_loaded.token_ids.dtype == np.int32 and seg_loaded.loss_mask.dtype == bool
            assert (seg_loaded.logprobs is None) == (seg_original.logprobs is None)
            if seg_loaded.logprobs is not None:
                assert seg_loaded.logprobs.dtype == np.float32
                assert seg_loaded.logprobs.tobytes() == seg_original.logprobs.tobytes()  # bit-exact, NaNs too
    edge = store.get_episode(ids[-2])
    assert edge.segments[0].token_ids.tolist() == [0, 1, LARGEST_ID]
    assert type(edge.reward) is float and edge.seed == 2**63 - 1


def test_numpy_values_in_info_are_stored_as_plain_json(store: Store) -> None:
    trajectory = make_trajectory(1)
    trajectory.info = {"count": np.int64(3), "score": np.float32(0.5), "ok": np.bool_(True), "ids": np.arange(3)}
    loaded = store.get_episode(store.add_episode(trajectory))
    assert loaded.info == {"count": 3, "score": 0.5, "ok": True, "ids": [0, 1, 2]}
    assert type(loaded.info["count"]) is int


def test_blobs_are_little_endian_int32_uint8_float32(store: Store) -> None:
    trajectory = edge_case_trajectory()
    episode_id = store.add_episode(trajectory)
    rows = raw_query(
        store.path,
        "SELECT token_ids, loss_mask, logprobs, typeof(token_ids), num_tokens FROM segments"
        " WHERE episode_id = ? ORDER BY idx",
        [episode_id],
    )
    for (ids_blob, mask_blob, logprobs_blob, blob_type, num_tokens), segment in zip(
        rows, trajectory.segments, strict=True
    ):
        assert blob_type == "blob" and num_tokens == len(segment)
        assert len(ids_blob) == 4 * len(segment) and len(mask_blob) == len(segment)
        np.testing.assert_array_equal(np.frombuffer(ids_blob, dtype="<i4"), segment.token_ids)
        np.testing.assert_array_equal(np.frombuffer(mask_blob, dtype=np.uint8), segment.loss_mask.astype(np.uint8))
        if segment.logprobs is None:
            assert logprobs_blob is None
        else:
            np.testing.assert_array_equal(np.frombuffer(logprobs_blob, dtype="<f4"), segment.logprobs)
    [(first,)] = raw_query(store.path, "SELECT hex(token_ids) FROM segments WHERE idx = 0")
    assert first == "00000000" + "01000000" + "FFFFFF7F"  # 0, 1, 2**31 - 1, least significant byte first


def test_wal_mode_schema_version_and_integrity(store: Store) -> None:
    store.add_episodes([make_trajectory(n) for n in range(5)])
    assert raw_query(store.path, "PRAGMA journal_mode") == [("wal",)]
    assert raw_query(store.path, "PRAGMA integrity_check") == [("ok",)]
    assert raw_query(store.path, "PRAGMA user_version") == [(SCHEMA_VERSION,)] and store.schema_version == 3
    assert raw_query(store.path, "PRAGMA application_id") == [(APPLICATION_ID,)]
    indexed = raw_query(
        store.path,
        "SELECT info.name FROM pragma_index_list('episodes') AS idx, pragma_index_info(idx.name) AS info",
    )
    assert sorted(indexed) == [("group_id",), ("policy_version",), ("run_id",)]


def test_store_is_readable_with_the_sqlite_utils_cli(store: Store) -> None:
    run_id = store.add_run("cli-run", config={"lr": 1e-5}, model="tiny-dense", tokenizer="longstraw-bpe")
    store.add_episodes([make_trajectory(n) for n in range(3)], run_id=run_id)
    runner = CliRunner()
    result = runner.invoke(sqlite_utils_cli, ["rows", str(store.path), "episodes", "-c", "env_id", "-c", "run_id"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == [{"env_id": make_trajectory(n).env_id, "run_id": run_id} for n in range(3)]
    result = runner.invoke(sqlite_utils_cli, ["tables", str(store.path), "--counts"])
    counts = {row["table"]: row["count"] for row in json.loads(result.output)}
    assert counts["runs"] == 1 and counts["episodes"] == 3
    assert counts["segments"] == sum(len(make_trajectory(n)) for n in range(3))


# -- transactions and bad input ------------------------------------------------------------------------------------


def test_add_episodes_writes_all_or_nothing(store: Store) -> None:
    bad = make_trajectory(2)
    bad.info["callback"] = object()
    with pytest.raises(StoreError, match="info cannot be stored as JSON"):
        store.add_episodes([make_trajectory(0), make_trajectory(1), bad])
    assert store.count() == 0
    assert store.add_episodes([make_trajectory(0), make_trajectory(1)]) == [1, 2]


def test_failure_in_the_middle_of_an_episode_leaves_nothing_behind(store: Store) -> None:
    store._db.execute(
        "CREATE TRIGGER fail_third_segment BEFORE INSERT ON segments WHEN NEW.idx = 2"
        " BEGIN SELECT RAISE(ABORT, 'disk on fire'); END"
    )
    store.add_episode(make_trajectory(1, num_segments=2))
    with pytest.raises(StoreError, match="nothing was written: disk on fire"):
        store.add_episodes([make_trajectory(2, num_segments=2), make_trajectory(3, num_segments=5)])
    assert store.count() == 1
    assert raw_query(store.path, "SELECT COUNT(*) FROM segments") == [(2,)]
    store._db.execute("DROP TRIGGER fail_third_segment")
    episode_id = store.add_episode(make_trajectory(3, num_segments=5))
    assert store.get_episode(episode_id) == make_trajectory(3, num_segments=5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"reward": float("nan")}, "reward must be a finite number"),
        ({"reward": "1.0"}, "reward must be a finite number"),
        ({"seed": 2**64}, "does not fit SQLite's 64-bit INTEGER"),
        ({"seed": 1.5}, "seed must be an integer or None"),
        ({"policy_version": None}, "policy_version must be an integer"),
        ({"group_id": 3}, "group_id must be a str"),
        ({"info": ["not", "a", "dict"]}, "info must be a dict"),
        ({"info": {"score": float("nan")}}, "Out of range float values"),
        ({"segments": [Segment("user", [1]), "not a segment"]}, "segment 1 is a str"),
    ],
)
def test_invalid_metadata_is_refused_before_writing(store: Store, change: dict[str, Any], message: str) -> None:
    trajectory = make_trajectory(3)
    for name, value in change.items():
        setattr(trajectory, name, value)
    with pytest.raises(StoreError, match=message):
        store.add_episode(trajectory)
    assert store.count() == 0


def test_add_episode_needs_a_trajectory(store: Store) -> None:
    with pytest.raises(StoreError, match="expected a Trajectory, got dict"):
        store.add_episode({"segments": []})  # type: ignore[arg-type]


def test_runs_round_trip_and_episode_provenance(store: Store) -> None:
    config = {"lr": 1e-5, "group_size": 8, "mode": "exact", "nested": {"betas": [0.9, 0.95]}}
    named = store.add_run("grpo-1", config=config, model="Qwen/tiny", tokenizer="longstraw-bpe", notes="first")
    generated = store.add_run(config={}, model="m", tokenizer="t")
    assert named == "grpo-1" and generated != named
    runs = {run.id: run for run in store.runs()}
    assert runs["grpo-1"].config == config and runs["grpo-1"].model == "Qwen/tiny"
    assert runs["grpo-1"].tokenizer == "longstraw-bpe" and runs["grpo-1"].notes == "first"
    with pytest.raises(StoreError, match="run 'grpo-1' already exists"):
        store.add_run("grpo-1", config={}, model="m", tokenizer="t")
    with pytest.raises(StoreError, match="unknown run 'nope'"):
        store.add_episode(make_trajectory(0), run_id="nope")
    episode_id = store.add_episode(make_trajectory(0), run_id="grpo-1")
    record = store.get_record(episode_id)
    assert record.run_id == "grpo-1" and record.trajectory == make_trajectory(0)
    assert store.get_record(store.add_episode(make_trajectory(1))).run_id is None


# -- selecting episodes --------------------------------------------------------------------------------------------


def test_episodes_where_order_and_limit(store: Store) -> None:
    originals = [make_trajectory(n) for n in range(30)]
    store.add_episodes(originals)
    wanted = [t for t in originals if t.reward is not None and t.reward > 0 and t.policy_version >= 3]
    assert wanted and list(store.episodes("reward > 0 AND policy_version >= ?", [3])) == wanted
    assert store.count("reward > 0 AND policy_version >= :v", {"v": 3}) == len(wanted)
    assert store.episode_ids("policy_version = 4") == [n + 1 for n in range(30) if n % 5 == 4]
    best = sorted((t for t in originals if t.reward is not None), key=lambda t: -t.reward)[:3]
    assert list(store.episodes(order_by="reward DESC", limit=3)) == best
    assert [r.id for r in store.records("env_id = ?", ["LongStraw/Env1-v0"], limit=2)] == [2, 5]
    assert store.count() == 30 and list(store.episodes("0")) == []


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("rewrd > 0", "no such column: rewrd"),
        ("reward >", "syntax error"),
        ("1); DROP TABLE runs; --", "one statement at a time"),
    ],
)
def test_bad_sql_raises_store_error_with_sqlites_message(store: Store, where: str, message: str) -> None:
    store.add_episode(make_trajectory(0))
    with pytest.raises(StoreError, match=message):
        store.episodes(where)
    with pytest.raises(StoreError, match=message):
        store.count(where)
    assert store.count() == 1 and "runs" in store._db.table_names()


def test_groups_rebuild_grpo_groups(store: Store) -> None:
    originals = [make_trajectory(n) for n in range(10)]
    store.add_episodes(originals)
    groups = store.groups()
    assert list(groups) == ["group-0", "group-1", "group-2"]
    for group_id, members in groups.items():
        assert members == [t for t in originals if t.group_id == group_id]
    assert store.groups("policy_version = 0") == {"group-0": [originals[0]], "group-1": [originals[5]]}


def small_episode(group: str, reward: float | None) -> Trajectory:
    return Trajectory([Segment("user", [1, 2]), Segment("assistant", [3])], "LongStraw/Env-v0", group, 0, reward)


def test_group_records_group_by_run_and_group_id_and_keep_whole_groups(store: Store) -> None:
    """A group id is only unique within its run, and an episode without one (scripted, eval) is in no group."""
    a = store.add_run("a", config={}, model="m", tokenizer="t")
    b = store.add_run("b", config={}, model="m", tokenizer="t")
    store.add_episodes([small_episode("g0", r) for r in (1.0, 0.0)], run_id=a)
    store.add_episodes([small_episode("", 1.0), small_episode("", 0.0)], run_id=a)
    store.add_episodes([small_episode("g0", r) for r in (0.0, 0.0, 0.5)], run_id=b)

    groups = store.group_records()
    assert [(g.run_id, g.group_id, [r.id for r in g.records]) for g in groups] == [
        ("a", "g0", [1, 2]),
        ("b", "g0", [5, 6, 7]),
    ]
    assert [t.reward for t in groups[1].trajectories] == [0.0, 0.0, 0.5]
    assert store.ungrouped_count() == 2 and store.ungrouped_count("reward > 0") == 1
    # `where` keeps every group with a matching member, whole; unqualified columns are the episode's own.
    whole = store.group_records("reward > 0")
    assert [[r.id for r in g.records] for g in whole] == [[1, 2], [5, 6, 7]]
    assert [[r.id for r in g.records] for g in store.group_records("id = 6 -- a comment")] == [[5, 6, 7]]
    partial = store.group_records("reward > 0", whole_groups=False)
    assert [[r.id for r in g.records] for g in partial] == [[1], [7]]
    assert store.group_records("run_id = ? AND reward = ?", ["b", 0.5])[0].group_id == "g0"
    with pytest.raises(StoreError, match="no such column"):
        store.group_records("rewrd > 0")
    # groups() is keyed by group id alone: it refuses to merge two runs' groups rather than mix them.
    with pytest.raises(StoreError, match="several runs"):
        store.groups()
    assert {k: len(v) for k, v in store.groups("run_id = 'b'").items()} == {"g0": 3}
    assert {k: len(v) for k, v in store.groups("run_id = 'a'").items()} == {"g0": 2}  # no "" group


def test_group_summaries_agree_with_the_group_records(store: Store) -> None:
    """Summaries come from SQL alone and describe exactly the groups ``group_records`` reads; ``alone`` lists each
    episode without a group id as a group of its own."""
    a = store.add_run("a", config={}, model="m", tokenizer="t")
    b = store.add_run("b", config={}, model="m", tokenizer="t")
    store.add_episodes([small_episode("g0", r) for r in (1.0, 0.0)], run_id=a)
    store.add_episodes([small_episode("", 1.0), small_episode("", None)], run_id=a)
    other_env = Trajectory([Segment("user", [1, 2, 3])], "LongStraw/Other,Env-v0", "g0", 7, None, "max_turns", 4)
    store.add_episodes([small_episode("g0", 0.0), small_episode("g0", 0.5), other_env], run_id=b)

    for where, params in ((None, ()), ("reward > 0.2", ()), ("run_id = ?", ["b"])):
        summaries = store.group_summaries(where, params)
        groups = store.group_records(where, params)
        assert [(s.run_id, s.group_id, s.first_episode) for s in summaries] == [
            (g.run_id, g.group_id, g.records[0].id) for g in groups
        ]
        for summary, group in zip(summaries, groups, strict=True):
            trajectories = group.trajectories
            rewards = [t.reward for t in trajectories if t.reward is not None]
            assert summary.members == len(trajectories) and summary.rewarded == len(rewards)
            assert summary.env_ids == tuple(sorted({t.env_id for t in trajectories}))
            assert (summary.min_version, summary.max_version) == (
                min(t.policy_version for t in trajectories),
                max(t.policy_version for t in trajectories),
            )
            assert summary.reward_mean == pytest.approx(sum(rewards) / len(rewards))
            assert (summary.reward_min, summary.reward_max) == (min(rewards), max(rewards))
            assert summary.tokens == sum(t.num_tokens for t in trajectories)
            assert summary.max_tokens == max(t.num_tokens for t in trajectories)
    [_, in_b] = store.group_summaries()
    assert in_b.env_ids == ("LongStraw/Env-v0", "LongStraw/Other,Env-v0")  # env ids are kept whole
    assert in_b.finish_reasons == {"running": 2, "max_turns": 1}
    alone = store.group_summaries(alone=True)
    assert [(s.group_id, s.first_episode, s.members) for s in alone] == [
        ("g0", 1, 2),
        ("", 3, 1),
        ("", 4, 1),
        ("g0", 5, 3),
    ]
    assert [s.first_episode for s in store.group_summaries("reward = 1.0", alone=True)] == [1, 3]
    assert alone[2].reward_mean is None and alone[2].rewarded == 0
    assert store.group_summaries("reward > 5") == []


def test_whole_groups_are_looked_up_by_group_id(store: Store) -> None:
    """A run holds every episode of a training: looking a member's group up by run would read the whole run for each
    member (12 s for the demo's 10,240 episodes instead of 0.1 s)."""
    for alone in (False, True):
        source = _grouped_episodes("reward > 0", whole_groups=True, alone=alone)
        plan = [row[3] for row in store._db.execute(f"EXPLAIN QUERY PLAN SELECT * FROM {source}").fetchall()]
        assert "SEARCH episodes USING INDEX idx_episodes_group_id (group_id=?)" in plan, plan


def test_get_missing_episode(store: Store) -> None:
    with pytest.raises(StoreError, match=r"no episode 99 in .*trajectories\.db"):
        store.get_episode(99)


# -- lone surrogates and damaged rows ------------------------------------------------------------------------------

LONE = "\ud800"


def surrogate_episode() -> Trajectory:
    """A real Calculator episode whose policy wrote lone surrogate escapes in tool-call JSON: in the arguments (a
    value and a key) and in the tool name. The env answers with error observations; its records keep the decoded
    lone surrogates."""
    env = gymnasium.make("LongStraw/Calculator-v0", max_turns=4)
    env.reset(seed=0)
    tool_env = env.unwrapped
    turns = [
        '<tool_call>{"name": "calculator", "arguments": {"expression": "\\ud800", "\\udfff": 1}}</tool_call>',
        '<tool_call>{"name": "calc\\ud800", "arguments": {}}</tool_call>',
    ]
    for text in turns:
        ids = tool_env.tokenizer.encode(text, allow_special=True) + [tool_env.tokenizer.eos_token_id]
        env.step(np.array(ids))
    return tool_env.trajectory


def test_lone_surrogates_an_env_recorded_read_back_exactly(store: Store) -> None:
    """Lone surrogates an env recorded (text, tool calls, results) are stored and read back as they were: no
    UnicodeEncodeError that would lose a rollout's group, no escapes in place of the text."""
    trajectory = surrogate_episode()
    calls, results = trajectory.segments[2].tool_calls, trajectory.segments[3].tool_calls
    assert calls is not None and results is not None
    assert calls[0]["arguments"] == {"expression": LONE, "\udfff": 1} and results[0]["ok"] is False
    assert trajectory.segments[4].tool_calls == [{"name": f"calc{LONE}", "arguments": {}}]

    loaded = store.get_episode(store.add_episode(trajectory))
    assert loaded == trajectory and "store_escaped_surrogates" not in loaded.info
    assert loaded.segments[2].tool_calls[0]["arguments"]["expression"] == LONE
    assert trajectory.segments[2].tool_calls == calls and calls[0]["arguments"]["expression"] == LONE  # untouched


def test_text_tool_calls_and_info_with_lone_surrogates_round_trip(store: Store) -> None:
    texts = [f"a{LONE}b", "\udfff", f"{LONE}\\ud800 literal escape, é and 🎉", "\udbff\udc00 a reversed pair"]
    calls = [{LONE: [LONE], "\\ud800": 0, "text": "\\ud800 is six characters"}]  # a key and its escape: both kept
    trajectory = Trajectory(
        [Segment("user", [1, 2], text=t) for t in texts] + [Segment("tool", [3], text="plain", tool_calls=calls)],
        info={"note": LONE, "nested": {LONE: ["\udc80"]}},
    )
    episode_id = store.add_episode(trajectory)
    loaded = store.get_episode(episode_id)
    assert loaded == trajectory
    assert [seg.text for seg in loaded.segments[:4]] == texts and loaded.segments[4].tool_calls == calls
    assert loaded.info == trajectory.info
    # other readers of the file: a text that UTF-8 cannot hold is a blob of its surrogatepass bytes, the JSON is valid
    rows = raw_query(
        store.path, "SELECT text, tool_calls FROM segments WHERE episode_id = ? ORDER BY idx", [episode_id]
    )
    assert rows[0][0] == texts[0].encode("utf-8", "surrogatepass") and rows[4] == ("plain", json.dumps(calls))
    [(info,)] = raw_query(store.path, "SELECT json_extract(info, '$.note') IS NOT NULL FROM episodes")
    assert info == 1


def test_lone_surrogates_in_ids_are_escaped_and_the_change_is_recorded(store: Store) -> None:
    """Ids and the finish reason are SQL keys compared as text: a surrogate there is escaped, and said so."""
    trajectory = Trajectory(
        [Segment("user", [1, 2], text=f"a{LONE}b")],
        env_id=f"Env{LONE}-v0",
        group_id=f"g{LONE}",
        info={"note": LONE, "store_escaped_surrogates": ["earlier"]},
    )
    loaded = store.get_episode(store.add_episode(trajectory))
    assert (loaded.env_id, loaded.group_id) == ("Env\\ud800-v0", "g\\ud800")
    assert loaded.segments[0].text == f"a{LONE}b"
    assert loaded.info == {"note": LONE, "store_escaped_surrogates": ["earlier", "env_id", "group_id"]}
    assert store.groups() == {"g\\ud800": [loaded]}


def corrupt(path: Path, sql: str) -> None:
    """Damage the file as another program could, through plain sqlite3 (the schema's CHECKs switched off)."""
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("PRAGMA ignore_check_constraints = ON")
        conn.execute(sql)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("token_ids = substr(token_ids, 1, length(token_ids) - 4)", "token_ids holds 2 values for a segment of 3"),
        ("token_ids = substr(token_ids, 1, length(token_ids) - 1)", "token_ids: blob of 11 bytes is not a whole"),
        ("token_ids = X'FFFFFFFF0500000006000000'", r"token_ids holds negative ids: \[-1\]"),
        ("token_ids = 'abcdefghijkl'", "token_ids is text where a blob belongs"),
        ("loss_mask = X'0101'", "loss_mask holds 2 values for a segment of 3"),
        ("loss_mask = X'010201'", r"loss_mask holds values other than 0 and 1: \[2\]"),
        ("loss_mask = 7", "loss_mask is an integer where a blob belongs"),
        ("logprobs = X'0000803F'", "logprobs holds 1 values for a segment of 3"),
        ("tool_calls = '[{\"name\": '", "tool_calls is not valid JSON"),
        ('tool_calls = \'{"name": "calculator"}\'', "tool_calls is .*, not a JSON list of objects"),
        ("tool_calls = X'00'", "tool_calls is bytes where JSON text belongs"),
        ("role = 'robot'", "role is 'robot', not one of"),
        ("turn = 'first'", "turn is text where an integer belongs"),
        ("text = X'FF'", "text is a blob that is not UTF-8"),
        ("num_tokens = -1", "num_tokens is -1"),
    ],
)
def test_a_damaged_segment_is_a_store_error_naming_episode_and_segment(store: Store, change: str, message: str) -> None:
    trajectory = Trajectory(
        [
            Segment("user", [1, 2, 3]),
            Segment("assistant", [4, 5, 6], logprobs=[-0.5, -1.0, -1.5], tool_calls=[{"name": "calculator"}]),
        ]
    )
    episode_id = store.add_episode(trajectory)
    corrupt(store.path, f"UPDATE segments SET {change} WHERE episode_id = {episode_id} AND idx = 1")
    with pytest.raises(StoreError, match=f"^episode {episode_id} segment 1 is damaged: {message}"):
        store.get_episode(episode_id)
    with pytest.raises(StoreError, match=f"episode {episode_id} segment 1"):
        list(store.episodes())


def test_damaged_episode_and_run_json_name_their_row(store: Store) -> None:
    store.add_run("r1", config={"lr": 1e-3}, model="m", tokenizer="t")
    episode_id = store.add_episode(make_trajectory(1), run_id="r1")
    corrupt(store.path, f"UPDATE episodes SET info = '{{\"n\": ' WHERE id = {episode_id}")
    with pytest.raises(StoreError, match=f"^episode {episode_id} is damaged: info is not valid JSON"):
        store.get_episode(episode_id)
    corrupt(store.path, "UPDATE runs SET config = 'lr=1e-3' WHERE id = 'r1'")
    with pytest.raises(StoreError, match="^run 'r1' is damaged: config is not valid JSON"):
        store.runs()


def test_a_lone_surrogate_in_a_run_is_a_store_error(store: Store) -> None:
    with pytest.raises(StoreError, match="adding run 'r1' .* failed, nothing was written: .*surrogates not allowed"):
        store.add_run("r1", config={}, model=f"m{LONE}", tokenizer="t")
    assert store.runs() == []


# -- context edits -------------------------------------------------------------------------------------------------


def test_context_edits_round_trip_exactly(store: Store) -> None:
    """An eviction with a placeholder, a policy summary reused by index and a summary the environment wrote."""
    originals = [edited_trajectory(0), make_trajectory(1), edited_trajectory(2)]
    ids = store.add_episodes(originals)
    for episode_id, original in zip(ids, originals, strict=True):
        loaded = store.get_episode(episode_id)
        assert loaded == original and loaded.edits == original.edits
        assert loaded.physical_sequences() == original.physical_sequences()
    assert list(store.episodes()) == originals
    assert store.get_episode(ids[1]).edits == []
    rows = raw_query(
        store.path,
        "SELECT idx, before, removed, replacement, kind FROM context_edits WHERE episode_id = ? ORDER BY idx",
        [ids[0]],
    )
    assert rows == [(0, 6, "[3]", 6, "evict"), (1, 8, "[2, 6, 4, 5, 7]", 7, "summary"),
                    (2, 11, "[8, 9, 10]", 11, "summary")]  # fmt: skip
    assert raw_query(store.path, "SELECT COUNT(*) FROM context_edits WHERE episode_id = ?", [ids[1]]) == [(0,)]


def test_an_edit_that_removes_the_end_of_the_context_with_nothing_in_its_place(store: Store) -> None:
    trajectory = Trajectory([Segment("user", [1, 2]), Segment("assistant", [3]), Segment("tool", [4, 5, 6])])
    trajectory.edits.append(ContextEdit(before=3, removed=(2,), replacement=None, kind="evict"))
    loaded = store.get_episode(store.add_episode(trajectory))
    assert loaded == trajectory and loaded.edits == [ContextEdit(3, (2,), None, "evict")]


def test_edits_that_do_not_fit_the_segments_are_refused_before_writing(store: Store) -> None:
    trajectory = edited_trajectory()
    trajectory.edits.append(ContextEdit(before=13, removed=(3,), replacement=None, kind="evict"))
    refused = r"cannot store the trajectory: its context edits do not fit its 13 segments: .* \[3\], which are not"
    with pytest.raises(StoreError, match=refused):
        store.add_episodes([make_trajectory(0), trajectory])
    assert store.count() == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("removed = '[3'", "removed is not valid JSON"),
        ("removed = '[]'", "a context edit must remove at least one segment"),
        ("removed = '[\"3\"]'", "removed is .*, not a JSON list of segment indices"),
        ("removed = '[-3]'", "removed is .*, not a JSON list of segment indices"),
        ("removed = X'5B335D'", "removed is bytes where JSON text belongs"),
        ("kind = 'forget'", "kind is 'forget', not one of"),
        ("before = 'six'", "before is text where an integer belongs"),
        ("replacement = 6.5", "replacement is a real where an integer belongs"),
    ],
)
def test_a_damaged_context_edit_is_a_store_error_naming_episode_and_edit(
    store: Store, change: str, message: str
) -> None:
    episode_id = store.add_episode(edited_trajectory())
    corrupt(store.path, f"UPDATE context_edits SET {change} WHERE episode_id = {episode_id} AND idx = 0")
    with pytest.raises(StoreError, match=f"^episode {episode_id} context edit 0 is damaged: {message}"):
        store.get_episode(episode_id)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("UPDATE context_edits SET removed = '[99]' WHERE idx = 0", r"context edit removes segments \[99\]"),
        ("UPDATE context_edits SET before = 20 WHERE idx = 2", r"context edit .* is after the end of the log \(13 "),
        ("UPDATE context_edits SET replacement = 12 WHERE idx = 0", "replacement 12 is neither logged yet"),
        ("UPDATE context_edits SET removed = '[2, 4]' WHERE idx = 1", "context edit must remove consecutive"),
    ],
)
def test_edits_that_do_not_fit_the_stored_segments_are_a_damaged_episode(
    store: Store, change: str, message: str
) -> None:
    episode_id = store.add_episode(edited_trajectory())
    corrupt(store.path, change)
    damaged = f"^episode {episode_id} is damaged: its context edits do not fit its 13 segments: {message}"
    with pytest.raises(StoreError, match=damaged):
        store.get_episode(episode_id)


def test_a_missing_context_edit_row_is_named(store: Store) -> None:
    episode_id = store.add_episode(edited_trajectory())
    corrupt(store.path, "UPDATE context_edits SET idx = 5 WHERE idx = 1")
    damaged = rf"^episode {episode_id} is damaged: expected context edits 0..2, found \[0, 2, 5\]"
    with pytest.raises(StoreError, match=damaged):
        store.get_episode(episode_id)


# -- opening files -------------------------------------------------------------------------------------------------


def test_reopen_keeps_everything(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "dirs" / "store.db"
    with Store.open(path) as store:
        store.add_episodes([make_trajectory(n) for n in range(4)])
    with Store.open(path, create=False) as store:
        assert list(store.episodes()) == [make_trajectory(n) for n in range(4)]


def test_missing_file_without_create_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "absent.db"
    with pytest.raises(StoreError, match=f"no store at {path}"):
        Store.open(path, create=False)
    assert not path.exists()


def test_a_directory_is_named_a_directory_not_a_missing_file(tmp_path: Path) -> None:
    for create in (False, True):
        with pytest.raises(StoreError, match=f"^{tmp_path} is a directory, not a store file$"):
            Store.open(tmp_path, create=create)
    Store.open(tmp_path / "trajectories.db").close()
    with pytest.raises(StoreError, match=r"is a directory, not a store file \(the run's store is .*trajectories\.db\)"):
        Store.open(tmp_path, create=False)


def test_file_that_is_not_sqlite(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("these are not the bytes you are looking for\n" * 100)
    for create in (False, True):
        with pytest.raises(StoreError, match=f"{path} is not a longstraw store: it is not a SQLite database"):
            Store.open(path, create=create)
    assert path.read_text().startswith("these are not")


def test_sqlite_file_without_the_tables(tmp_path: Path) -> None:
    empty = tmp_path / "empty.db"
    raw_query(empty, "PRAGMA user_version")  # creates a valid, empty SQLite file
    with pytest.raises(StoreError, match="is not a longstraw store: it is an empty SQLite database"):
        Store.open(empty, create=False)

    foreign = tmp_path / "foreign.db"
    raw_query(foreign, "CREATE TABLE people (name TEXT)")
    for create in (False, True):
        with pytest.raises(StoreError, match=r"is not a longstraw store \(it is a SQLite database with tables: people"):
            Store.open(foreign, create=create)
    assert raw_query(foreign, "SELECT name FROM sqlite_master") == [("people",)]  # left untouched


def test_newer_schema_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "future.db"
    Store.open(path).close()
    raw_query(path, f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(StoreError, match=f"schema version {SCHEMA_VERSION + 1}, newer than .* upgrade"):
        Store.open(path, create=False)


def test_a_store_missing_its_context_edits_table_is_damaged(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    Store.open(path).close()
    raw_query(path, "DROP TABLE context_edits")
    with pytest.raises(StoreError, match=r"damaged longstraw store: missing tables \['context_edits'\], version 3"):
        Store.open(path)


def test_each_turn_keeps_the_policy_version_that_sampled_it(store: Store) -> None:
    """An episode that went on across weight updates (asynchronous GRPO): its turns' versions read back as written,
    and a segment no policy sampled has none."""
    trajectory = Trajectory(
        segments=[
            Segment("user", [1, 2]),
            Segment("assistant", [3], logprobs=[-0.5], policy_version=4),
            Segment("tool", [5]),
            Segment("assistant", [6, 7], logprobs=[-1.0, -2.0], policy_version=5),
        ],
        group_id="g",
        policy_version=4,
    )
    stored = store.get_episode(store.add_episode(trajectory))
    assert stored == trajectory
    assert [s.policy_version for s in stored.segments] == [None, 4, None, 5]
    assert raw_query(store.path, "SELECT policy_version FROM segments ORDER BY idx") == [(None,), (4,), (None,), (5,)]


# -- upgrading a store of schema version 1 -------------------------------------------------------------------------

# The schema version 1 wrote, as it wrote it (kept literally: an upgrade must read the files that exist).
VERSION_1_SCHEMA = """
CREATE TABLE runs (
    id TEXT PRIMARY KEY,
    created_at TEXT NOT NULL,
    config TEXT NOT NULL,
    model TEXT NOT NULL,
    tokenizer TEXT NOT NULL,
    notes TEXT NOT NULL DEFAULT ''
);
CREATE TABLE episodes (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT REFERENCES runs(id),
    env_id TEXT NOT NULL,
    group_id TEXT NOT NULL,
    seed INTEGER,
    policy_version INTEGER NOT NULL,
    reward REAL,
    finish_reason TEXT NOT NULL,
    num_tokens INTEGER NOT NULL,
    num_segments INTEGER NOT NULL,
    created_at TEXT NOT NULL,
    info TEXT NOT NULL
);
CREATE TABLE segments (
    episode_id INTEGER NOT NULL REFERENCES episodes(id),
    idx INTEGER NOT NULL,
    role TEXT NOT NULL,
    turn INTEGER NOT NULL,
    num_tokens INTEGER NOT NULL,
    token_ids BLOB NOT NULL CHECK (length(token_ids) = 4 * num_tokens),
    loss_mask BLOB NOT NULL CHECK (length(loss_mask) = num_tokens),
    logprobs BLOB CHECK (logprobs IS NULL OR length(logprobs) = 4 * num_tokens),
    text TEXT NOT NULL,
    tool_calls TEXT,
    PRIMARY KEY (episode_id, idx)
);
CREATE INDEX idx_episodes_group_id ON episodes(group_id);
CREATE INDEX idx_episodes_run_id ON episodes(run_id);
CREATE INDEX idx_episodes_policy_version ON episodes(policy_version);
"""


def write_version_1_store(path: Path, trajectories: list[Trajectory]) -> None:
    """A store as version 1 of the package left it (WAL, its schema, its rows), written with plain sqlite3."""
    with closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.executescript(VERSION_1_SCHEMA)
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        conn.execute("PRAGMA user_version = 1")
        with conn:
            conn.execute("INSERT INTO runs VALUES ('r1', '2026-01-01', '{}', 'tiny', 'bpe', '')")
            for t in trajectories:
                episode = conn.execute(
                    "INSERT INTO episodes (run_id, env_id, group_id, seed, policy_version, reward, finish_reason,"
                    " num_tokens, num_segments, created_at, info) VALUES ('r1', ?, ?, ?, ?, ?, ?, ?, ?, '', ?)",
                    [t.env_id, t.group_id, t.seed, t.policy_version, t.reward, t.finish_reason, t.num_tokens,
                     len(t), json.dumps(t.info)],
                )  # fmt: skip
                for idx, seg in enumerate(t.segments):
                    lp = None if seg.logprobs is None else seg.logprobs.astype("<f4").tobytes()
                    conn.execute(
                        "INSERT INTO segments VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        [episode.lastrowid, idx, seg.role, seg.turn, len(seg), seg.token_ids.astype("<i4").tobytes(),
                         seg.loss_mask.astype(np.uint8).tobytes(), lp, seg.text,
                         None if seg.tool_calls is None else json.dumps(seg.tool_calls)],
                    )  # fmt: skip


def schema(path: Path) -> set[tuple[str, str, str]]:
    return set(raw_query(path, "SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL"))


@pytest.mark.parametrize("create", [True, False])
def test_a_version_1_store_is_upgraded_in_place_when_opened(tmp_path: Path, create: bool) -> None:
    path = tmp_path / "old.db"
    originals = [make_trajectory(n) for n in range(6)]
    write_version_1_store(path, originals)
    with Store.open(path, create=create) as store:
        assert store.schema_version == SCHEMA_VERSION == 3
        assert list(store.episodes()) == originals
        edited = edited_trajectory()
        assert store.get_episode(store.add_episode(edited, run_id="r1")) == edited
    Store.open(tmp_path / "new.db").close()
    assert schema(path) == schema(tmp_path / "new.db")  # exactly a new store's tables and indexes
    assert raw_query(path, "PRAGMA user_version") == [(3,)]
    assert raw_query(path, "PRAGMA integrity_check") == [("ok",)]
    assert raw_query(path, "PRAGMA foreign_key_check") == []
    with Store.open(path, create=False) as store:  # and it opens as any store of this version
        assert list(store.episodes()) == [*originals, edited]


def test_a_version_1_store_this_process_cannot_write_is_read_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "old.db"
    originals = [make_trajectory(n) for n in range(3)]
    write_version_1_store(path, originals)
    before = path.read_bytes()

    def read_only(target: Path, create: bool) -> sqlite3.Connection:
        return sqlite3.connect(f"{target.absolute().as_uri()}?mode=ro", uri=True)

    monkeypatch.setattr(store_schema, "connect", read_only)
    with Store.open(path, create=False) as reader:
        assert reader.schema_version == 1
        assert list(reader.episodes()) == originals
        assert reader.edit_totals() == (0, 0)
        with pytest.raises(StoreError, match="writing episodes in .* failed, nothing was written: .*readonly"):
            reader.add_episode(make_trajectory(9))
        assert path.read_bytes() == before
        monkeypatch.undo()
        with Store.open(path) as writer:  # another process upgrades the store and writes an edited episode
            episode_id = writer.add_episode(edited_trajectory())
        assert reader.get_episode(episode_id) == edited_trajectory()
        assert reader.edit_totals() == (1, 3)


# -- crashes and concurrent writers --------------------------------------------------------------------------------

STALL_AFTER_SEGMENTS = 5


def _writer_main(spec: dict[str, Any]) -> None:
    """Child process: write episodes ``first, first + 1, ...``; print their ids (see the ``start_writer`` fixture)."""
    if spec.get("wait_for_go"):  # lets the parent release several writers at the same moment
        print("ready", flush=True)
        assert sys.stdin.readline().strip() == "go"
    with Store.open(spec["db"]) as store:
        if spec.get("run_id"):
            store.add_run(spec["run_id"], config=spec, model="test-model", tokenizer="test-tokenizer")
        if spec.get("stall_at") is not None:
            _stall_inside_episode(store, spec["stall_at"])
        ids = []
        count = spec.get("count")
        n = spec["first"]
        while count is None or n < spec["first"] + count:
            trajectory = make_trajectory(n, num_segments=spec.get("num_segments"), max_tokens=spec["max_tokens"])
            ids.append(store.add_episode(trajectory, run_id=spec.get("run_id")))
            print(f"committed {n}", flush=True)
            n += 1
        print(json.dumps(ids), flush=True)


def _stall_inside_episode(store: Store, n: int) -> None:
    """Make the writer hang halfway through episode ``n``: its row and some segments written, not committed."""

    def stall() -> None:
        print("stalled", flush=True)
        time.sleep(600)

    store._db.conn.create_function("stall", 0, stall)
    # A tiny page cache makes SQLite spill the open transaction's pages into the WAL before the kill, so reopening
    # has to skip frames that were written but never committed.
    store._db.execute("PRAGMA cache_size = 8")
    store._db.execute(
        "CREATE TEMP TRIGGER stall_in_episode AFTER INSERT ON segments"
        f" WHEN NEW.idx = {STALL_AFTER_SEGMENTS}"
        f" AND (SELECT json_extract(info, '$.n') FROM episodes WHERE id = NEW.episode_id) = {int(n)}"
        " BEGIN SELECT stall(); END"
    )


StartWriter = Callable[..., subprocess.Popen[bytes]]


@pytest.fixture
def start_writer() -> Iterator[StartWriter]:
    """Run ``_writer_main(spec)`` in fresh interpreters; any writer still alive at teardown is killed."""
    started: list[subprocess.Popen[bytes]] = []
    code = (
        f"import sys, json; sys.path[:0] = [{str(TESTS_DIR)!r}, {str(SUPPORT_DIR)!r}]; import test_store; "
        "test_store._writer_main(json.loads(sys.argv[1]))"
    )

    def start(**spec: Any) -> subprocess.Popen[bytes]:
        pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        started.append(subprocess.Popen([sys.executable, "-c", code, json.dumps(spec)], **pipes))
        return started[-1]

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def wait_for_line(proc: subprocess.Popen[bytes], wanted: str, timeout: float = 60.0) -> None:
    """Block until the writer prints the line ``wanted``; fail (not hang) if it exits or takes too long."""
    assert proc.stdout is not None
    fd, seen = proc.stdout.fileno(), b""
    deadline = time.monotonic() + timeout
    while wanted.encode() not in seen.split(b"\n"):
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"writer did not print {wanted!r} within {timeout}s"
        if select.select([fd], [], [], remaining)[0]:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise AssertionError(f"writer exited ({proc.wait()}) before {wanted!r}: {proc.stderr.read().decode()}")
            seen += chunk


def kill_9(proc: subprocess.Popen[bytes]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL


def uncommitted_wal_frames(path: Path) -> int:
    """Frames at the end of the WAL after its last commit frame: pages of a transaction that never committed."""
    wal = Path(f"{path}-wal").read_bytes()
    page_size = struct.unpack(">I", wal[8:12])[0]
    salts = wal[16:24]
    commits = []
    for offset in range(32, len(wal) - page_size - 23, 24 + page_size):
        if wal[offset + 8 : offset + 16] != salts:  # left over from before a checkpoint: not part of this log
            break
        commits.append(struct.unpack(">I", wal[offset + 4 : offset + 8])[0] != 0)
    return len(commits) - 1 - max(i for i, is_commit in enumerate(commits) if is_commit)


def assert_store_intact(path: Path, numbers: list[int], **size: Any) -> None:
    """Exactly the episodes ``numbers`` are stored, each complete and token-exact; no orphan rows; file is sound."""
    with Store.open(path, create=False) as store:
        records = list(store.records())  # raises if an episode's segments are incomplete
        assert [record.trajectory.info["n"] for record in records] == numbers
        for record in records:
            assert record.trajectory == make_trajectory(record.trajectory.info["n"], **size)
        orphans = store._db.execute("SELECT COUNT(*) FROM segments WHERE episode_id NOT IN (SELECT id FROM episodes)")
        assert orphans.fetchone()[0] == 0
        assert store._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_writer_killed_inside_a_transaction_loses_only_that_episode(tmp_path: Path, start_writer: StartWriter) -> None:
    path = tmp_path / "killed.db"
    size = {"num_segments": 12, "max_tokens": 4000}
    writer = start_writer(db=str(path), first=0, stall_at=3, **size)
    wait_for_line(writer, "stalled")
    assert uncommitted_wal_frames(path) > 0  # the half-written episode really is on disk when the writer dies
    assert_store_intact(path, [0, 1, 2], **size)  # meanwhile readers see only committed episodes, unblocked
    kill_9(writer)
    assert_store_intact(path, [0, 1, 2], **size)
    with Store.open(path) as store:  # the store stays writable after the crash
        assert store.add_episode(make_trajectory(3, **size)) == 4
        assert store.get_episode(4) == make_trajectory(3, **size)


def test_writer_killed_mid_stream_keeps_every_committed_episode(tmp_path: Path, start_writer: StartWriter) -> None:
    path = tmp_path / "streaming.db"
    size = {"num_segments": 6, "max_tokens": 3000}
    writer = start_writer(db=str(path), first=0, **size)
    wait_for_line(writer, "committed 4")
    kill_9(writer)  # while it writes episode 5 (or a later one)
    with Store.open(path, create=False) as store:
        written = store.count()
    assert written >= 5
    assert_store_intact(path, list(range(written)), **size)


def test_four_concurrent_writers_lose_nothing(tmp_path: Path, start_writer: StartWriter) -> None:
    path = tmp_path / "shared.db"  # does not exist yet: the writers also race to create it
    per_writer, size = 30, {"max_tokens": 500}
    writers = [
        start_writer(db=str(path), first=1000 * w, count=per_writer, run_id=f"writer-{w}", wait_for_go=True, **size)
        for w in range(4)
    ]
    for writer in writers:
        wait_for_line(writer, "ready")
    for writer in writers:
        writer.stdin.write(b"go\n")
        writer.stdin.flush()
    ids_by_writer = []
    for writer in writers:
        out, err = writer.communicate(timeout=120)
        assert writer.returncode == 0, err.decode()
        ids_by_writer.append(json.loads(out.splitlines()[-1]))
    all_ids = [episode_id for ids in ids_by_writer for episode_id in ids]
    assert len(all_ids) == len(set(all_ids)) == 4 * per_writer
    with Store.open(path, create=False) as store:
        assert store.count() == 4 * per_writer and store.episode_ids() == sorted(all_ids)
        assert sorted(run.id for run in store.runs()) == [f"writer-{w}" for w in range(4)]
        for w, ids in enumerate(ids_by_writer):
            for i, episode_id in enumerate(ids):
                record = store.get_record(episode_id)
                assert record.run_id == f"writer-{w}"
                assert record.trajectory == make_trajectory(1000 * w + i, **size)
        assert store._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
