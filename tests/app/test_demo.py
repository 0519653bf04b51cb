"""``make demo`` (longstraw_agents/app/demo.py): the scripted episodes, the store they go to, the quick training run."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from longstraw_agents.app import demo
from longstraw_agents.app.replay import ReplayConfig, select_logged_groups
from longstraw_agents.store import Store

ROOT = Path(__file__).parents[2]


def test_scripted_demo_stores_one_solved_episode_per_env(tmp_path: Path) -> None:
    result = demo.run_scripted_demo(tmp_path / "out", seed=1)
    assert result.store_path == tmp_path / "out" / demo.STORE
    with Store.open(result.store_path, create=False) as store:
        assert store.count() == 3
        [run] = store.runs()
        assert run.id == result.run_id and run.tokenizer == "longstraw-bpe-v1" and run.model == "scripted-policy"
        episodes = {t.env_id: t for t in store.episodes()}
    assert set(episodes) == set(demo.DEMO_ENVS)
    for env_id, stored in episodes.items():
        assert stored.reward == 1.0 and stored.finish_reason == "answered" and stored.seed == 1
        np.testing.assert_array_equal(stored.token_ids(), result.trajectories[env_id].token_ids())
    for env_id in demo.DEMO_ENVS:
        assert env_id in result.report
    assert "finish reasons  answered 3" in result.report
    assert "<answer>" in result.report and "tool_calls" in result.report  # transcripts, not just the overview


def test_main_prints_the_transcript_and_appends_a_run_per_invocation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert demo.main(["--out", str(tmp_path), "--scripted-only"]) == 0
    first = capsys.readouterr().out
    assert "LongStraw/Calculator-v0: reward 1.000 (answered" in first and "What is " in first
    assert demo.main(["--out", str(tmp_path), "--seed", "4", "--scripted-only"]) == 0
    second = capsys.readouterr().out
    assert "episodes 3 " in second  # the report shows this invocation's run only
    with Store.open(tmp_path / demo.STORE, create=False) as store:
        assert store.count() == 6 and len(store.runs()) == 2


def earlier_demo(out: Path) -> None:
    """What a finished demo leaves (its store, run files and plots), and what a user added: a replay, a note."""
    demo.run_scripted_demo(out)
    (out / "checkpoint").mkdir()
    (out / "checkpoint" / "trainer_state.json").write_text("{}")
    for name in ("metrics.jsonl", "config.json", "reward.png"):
        (out / name).write_text("")
    (out / "replay").mkdir()
    (out / "replay" / "metrics.jsonl").write_text("")
    (out / "notes.txt").write_text("mine")


def test_a_new_demo_says_what_it_replaces_and_keeps_what_it_did_not_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "demo"
    earlier_demo(out)
    trained: list[Path] = []

    def training(out_dir: Path, quick: bool = False) -> dict[str, float]:  # the store must be fresh by now
        trained.append(out_dir)
        with Store.open(out_dir / demo.STORE, create=False) as store:
            assert store.count() == len(demo.DEMO_ENVS) and not (out_dir / "checkpoint").exists()
        names = ("reward_before", "reward_after", "train_reward_first", "train_reward_last", "seconds")
        return dict.fromkeys(names, 0.0)

    monkeypatch.setattr(demo, "run_training_demo", training)
    assert demo.main(["--out", str(out)]) == 0
    printed = capsys.readouterr().out
    threads = torch.get_num_threads()
    assert f"(SFT warm start, then GRPO in exact mode) on {threads} thread" in printed and "CPU-minutes" in printed
    first = printed.splitlines()[0]
    assert first.startswith(f"replacing the earlier demo in {out}: removing ")
    removed, kept = first.split(": removing ")[1].split("; keeping ")
    assert set(removed.split(", ")) == {"trajectories.db", "metrics.jsonl", "config.json", "checkpoint/", "reward.png"}
    assert kept == "notes.txt, replay/"
    assert (
        trained == [out] and (out / "replay" / "metrics.jsonl").exists() and (out / "notes.txt").read_text() == "mine"
    )

    lines: list[str] = []
    demo.clear_earlier_demo(tmp_path / "elsewhere", echo=lines.append)  # nothing of a demo there: nothing said
    assert lines == []


def test_the_suggested_replay_learns_from_groups_with_reward_differences(tmp_path: Path) -> None:
    """`--where` keeps whole groups: the suggested condition must leave groups whose members' rewards differ (an
    episode-level "reward > 0" would keep only solved members: zero advantages), and the scripted episodes, which
    have no group id, must not form a group."""
    result = demo.run_scripted_demo(tmp_path, seed=2)
    calculator = result.trajectories["LongStraw/Calculator-v0"]
    with Store.open(result.store_path, create=False) as store:
        run_id = store.add_run(config={}, model="tiny", tokenizer="longstraw-bpe-v1")
        for group, rewards in (("step1-g0", (1.0, 0.0, 0.0, 1.0)), ("step1-g1", (0.0, 0.0, 0.0, 0.0))):
            members = [dataclasses.replace(calculator, group_id=group, reward=r) for r in rewards]
            store.add_episodes(members, run_id=run_id)
        groups, counts = select_logged_groups(store, ReplayConfig(where=demo.REPLAY_WHERE), policy_version=1)
    assert [[t.reward for t in g] for g in groups] == [[1.0, 0.0, 0.0, 1.0]]
    assert counts["skipped_ungrouped"] == 3 and counts["groups_trained"] == 1
    hint = demo.replay_hint(result.store_path)
    assert hint.startswith(f'longstraw replay {result.store_path} --where "{demo.REPLAY_WHERE}"')


@pytest.mark.slow
def test_quick_training_demo_writes_what_the_demo_promises(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The small version of `make demo`: warm start, held-out evaluation, GRPO steps, evaluation again, then the run
    directory the demo describes, with the phases' progress shown as it goes (not a terminal here: plain lines, each
    bar's last one at least). (Its few steps cannot show learning on every machine: test_learning does.)"""
    lines: list[str] = []
    result = demo.run_training_demo(tmp_path, quick=True, echo=lines.append)
    progress = capsys.readouterr().err.splitlines()
    for bar, steps in (("warm start", demo.QUICK.sft_steps), ("GRPO", demo.QUICK.steps)):
        assert any(line.startswith(f"{bar}: 100% {steps}/{steps}") for line in progress), bar
    for name in ("trajectories.db", "metrics.jsonl", "checkpoint", "reward.png", "config.json"):
        assert (tmp_path / name).exists(), name
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["phase"] == "eval"]
    assert [r["episodes"] for r in evals] == [demo.QUICK.eval_episodes] * 2
    assert [e["reward_mean"] for e in evals] == [result["reward_before"], result["reward_after"]]
    assert [r["step"] for r in records if r["phase"] == "grpo"] == list(range(1, demo.QUICK.steps + 1))
    assert any(line.startswith("held-out reward before GRPO") for line in lines)
    with Store.open(tmp_path / demo.STORE, create=False) as store:
        assert store.count() == demo.QUICK.steps * demo.QUICK.groups_per_step * demo.DEMO_TRAINER["G"]


def test_make_demo_sets_the_threads_and_lets_idle_threads_sleep() -> None:
    """README's figures are `make demo` at 1 thread (the default) and at `THREADS=2`; OpenMP threads that spin
    between parallel regions would cost a busy machine's CPU time for nothing."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    # as from a shell, not as a sub-make of `make test` (which would pass its flags and print "Entering directory")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "THREADS")}

    def command(*args: str) -> str:  # what `make demo` runs, taking the installed venv as up to date
        make = ["make", "--dry-run", "--old-file", ".venv/.installed", "demo", *args]
        return subprocess.run(make, cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout.strip()

    demo_module = ".venv/bin/python -m longstraw_agents.app.demo --out runs/demo"
    assert command() == f"OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE {demo_module}"
    assert command("THREADS=2") == f"OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE {demo_module}"
