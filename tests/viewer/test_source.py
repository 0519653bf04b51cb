"""What the viewer reads: the index of runs and selected groups, the metrics beside the store and the run they
belong to, and groups loaded by their first episode."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from stored_episodes import edited_trajectory
from viewer_stores import RUN_CONFIG, calculator_group, write_run_directory

from longstraw_agents.app.training import group_prefix
from longstraw_agents.store import Store, StoreError
from longstraw_agents.viewer.group_view import ViewLimits
from longstraw_agents.viewer.source import ViewSource, step_of_group
from longstraw_agents.viewer.tokens import IdText


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return write_run_directory(tmp_path / "run")


def test_the_index_lists_runs_groups_and_the_runs_metrics(run_dir: Path) -> None:
    index = ViewSource(run_dir).index()
    scripted, training = index["runs"]
    assert (scripted["model"], scripted["groups"], scripted["alone"], scripted["has_metrics"]) == (
        "scripted-policy",
        0,
        1,
        False,
    )
    assert (training["model"], training["groups"], training["alone"], training["has_metrics"]) == (
        "preset:llama",
        2,
        0,
        True,
    )
    groups = [(g["key"], g["run_id"], g["group_id"], g["step"], g["members"]) for g in index["groups"]]
    assert groups == [(1, scripted["id"], "", None, 1), (2, training["id"], "step1-g0", 1, 2),
                      (4, training["id"], "step2-g0", 2, 4)]  # fmt: skip
    step2 = index["groups"][2]
    assert (step2["reward_mean"], step2["reward_min"], step2["reward_max"]) == (0.25, 0.0, 1.0)
    assert step2["finish_reasons"] == {"answered": 3, "max_turns": 1}
    metrics = index["metrics"]
    assert metrics["run_id"] == training["id"] and metrics["skipped_lines"] == 1  # a line being written
    assert [(s["step"], s["reward_mean"], s["loss"], s["kl"]) for s in metrics["steps"]] == [
        (1, 0.0, 0.01, 0.0),
        (2, 0.25, -0.02, 0.003),
    ]
    assert metrics["evals"] == [{"step": 0, "reward_mean": 0.25}, {"step": 2, "reward_mean": 0.5}]
    assert index["store"] == str(run_dir / "trajectories.db") and index["selection"] is None
    json.dumps(index, allow_nan=False)  # what the page embeds


def test_a_group_links_to_the_step_training_stored_it_at() -> None:
    for dp, rank in ((1, 0), (2, 1)):
        run = SimpleNamespace(ranks=SimpleNamespace(dp=dp))
        assert step_of_group(group_prefix(run, 6, rank) + "3") == 7  # type: ignore[arg-type]
    assert step_of_group("fork-episode12-t1") is None and step_of_group("") is None


def test_metrics_belong_to_the_run_of_config_json_else_to_the_last_run(run_dir: Path) -> None:
    with Store.open(run_dir / "trajectories.db") as store:
        runs = [run.id for run in store.runs()]
        later = store.add_run(config={"other": True}, model="m", tokenizer="longstraw-bpe")
    source = ViewSource(run_dir)
    assert source.metrics is not None and source.metrics.run_id == runs[1]
    (run_dir / "config.json").unlink()
    assert ViewSource(run_dir).metrics.run_id == later  # type: ignore[union-attr]
    (run_dir / "metrics.jsonl").unlink()
    assert ViewSource(run_dir / "trajectories.db").index()["metrics"] is None


def test_a_selection_keeps_whole_groups(run_dir: Path) -> None:
    source = ViewSource(run_dir, "reward > 0.5")
    assert [(s.group_id, s.members) for s in source.summaries] == [("", 1), ("step2-g0", 4)]
    assert source.index()["selection"] == "reward > 0.5"
    only = ViewSource(run_dir, "group_id = ?", ["step1-g0"])
    assert [s.first_episode for s in only.summaries] == [2]
    with pytest.raises(StoreError, match="no such column: rewrd"):
        ViewSource(run_dir, "rewrd > 0")


def test_groups_are_loaded_by_their_first_episode(run_dir: Path) -> None:
    source = ViewSource(run_dir)
    page = source.group(4)
    assert [m.episode for m in page.members] == [4, 5, 6, 7] and page.group_id == "step2-g0"
    assert page.scale_rewards is RUN_CONFIG["trainer"]["loss"]["scale_rewards"]
    assert source.load(4) is source.load(4)  # kept for range requests
    alone = source.group(1)
    assert alone.group_id == "" and [m.advantage for m in alone.members] == [None]
    assert "tokenizer longstraw-bpe" in alone.text_source  # the scripted run's identity names the shipped BPE
    with pytest.raises(KeyError, match="episode 5 is not the first of its group 'step2-g0'"):
        source.load(5)
    with pytest.raises(KeyError, match="no episode 99"):
        source.load(99)
    window = source.window(4, 2, 0, 37)
    assert window.start == 0 and "".join(window.text) == "".join(s.text for s in calculator_group()[2].segments)
    limited = ViewSource(run_dir, limits=ViewLimits(range_tokens=5)).window(4, 2, 3, 37)
    assert (limited.start, len(limited.text)) == (3, 5)


def test_a_group_with_an_edited_episode_loads_with_a_note_instead_of_its_tree(tmp_path: Path) -> None:
    edited = edited_trajectory()
    edited.group_id = "step2-g0"
    with Store.open(tmp_path / "trajectories.db") as store:
        store.add_episodes([*calculator_group()[:3], edited])
    source = ViewSource(tmp_path)
    assert [(g["key"], g["members"]) for g in source.index()["groups"]] == [(1, 4)]
    page = source.group(1)
    assert [m.episode for m in page.members] == [1, 2, 3, 4] and page.branches == []
    assert "members 3 (4 physical sequences) edited their context" in (page.tree_error or "")
    window = source.window(1, 3, 0, 12)
    assert window.loss == "0" * 12  # the system prompt


def test_a_run_without_scaled_rewards_and_a_tokenizer_given_or_missing(tmp_path: Path) -> None:
    with Store.open(tmp_path / "trajectories.db") as store:
        run = store.add_run(config={"trainer": {"loss": {"scale_rewards": False}}}, model="m", tokenizer="")
        store.add_episodes(calculator_group(), run_id=run)
    page = ViewSource(tmp_path).group(1)
    assert [m.advantage for m in page.members] == [0.75, -0.25, -0.25, -0.25]
    assert "names no tokenizer" in page.text_source
    first_id = calculator_group()[0].segments[0].token_ids[0]
    assert page.branches[0].pieces[0].windows[0].text[0] == f"⟨{first_id}⟩"
    named = ViewSource(tmp_path, tokenizer="longstraw-bpe").group(1)
    assert named.branches[0].pieces[0].windows[0].text[0] == "<|im_start|>"
    assert isinstance(ViewSource(tmp_path, tokenizer="nope")._text(run), IdText)


def test_refresh_sees_what_a_running_training_added(run_dir: Path) -> None:
    source = ViewSource(run_dir)
    with Store.open(run_dir / "trajectories.db") as store:
        store.add_episodes(calculator_group("step3-g0"), run_id=store.runs()[-1].id)
    assert len(source.summaries) == 3
    source.refresh()
    assert [s.group_id for s in source.summaries][-1] == "step3-g0"


def test_what_is_not_a_store_is_named(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="directory without a store"):
        ViewSource(tmp_path)
    with pytest.raises(StoreError, match="no store at .*missing.db"):
        ViewSource(tmp_path / "missing.db")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(StoreError, match="not a longstraw store"):
        ViewSource(tmp_path / "notes.txt")
