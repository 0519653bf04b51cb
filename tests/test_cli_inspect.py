"""`longstraw inspect DB`: the store summary and transcripts through the command line."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from longstraw_agents.cli import main
from longstraw_agents.store import Store
from longstraw_agents.trajectory import Segment, Trajectory


def calculator_episode(group: str, reward: float, policy_version: int = 0) -> Trajectory:
    return Trajectory(
        [
            Segment("system", [1, 2], text="You solve arithmetic with the calculator tool."),
            Segment("user", [3, 4, 5], text="What is 6 * 7?"),
            Segment(
                "assistant",
                [6, 7],
                logprobs=[-0.25, -0.75],
                text='<tool_call>{"name": "calculator"}</tool_call>',
                tool_calls=[{"name": "calculator", "arguments": {"expression": "6 * 7"}}],
            ),
            Segment("tool", [8], text="42"),
            Segment("assistant", [9, 10], text="The answer is 42."),
        ],
        env_id="LongStraw/Calculator-v0",
        group_id=group,
        seed=7,
        reward=reward,
        finish_reason="answered" if reward > 0 else "max_turns",
        policy_version=policy_version,
    )


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "runs" / "trajectories.db"
    with Store.open(path) as store:
        run_id = store.add_run("demo", config={"group_size": 3}, model="tiny-dense", tokenizer="longstraw-bpe")
        store.add_episodes([calculator_episode("g0", r) for r in (1.0, 0.0, 1.0)], run_id=run_id)
        store.add_episode(calculator_episode("g1", 0.5, policy_version=2), run_id=run_id)
    return path


def run_inspect(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["inspect", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_inspect_summarises_the_store(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_inspect(capsys, str(db))
    assert code == 0 and err == ""
    assert f"store {db} (schema v1)" in out
    assert "episodes 4  groups 2  tokens 40  policy versions 0..2" in out
    env_line = next(line for line in out.splitlines() if line.startswith("LongStraw/Calculator-v0"))
    assert env_line.split()[1:] == ["4", "2", "40", "0.625", "0.000", "1.000"]
    assert "finish reasons  answered 3, max_turns 1" in out
    assert "demo  model tiny-dense  tokenizer longstraw-bpe  episodes 4" in out
    assert "episode 1 " not in out  # transcripts only on request


def test_inspect_one_episode(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_inspect(capsys, str(db), "--episode", "4")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("episode 4  env LongStraw/Calculator-v0  group g1  seed 7  policy v2  reward 0.500")
    roles = [line.split()[1] for line in lines[2:] if line.split()[0].isdigit()]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    assert any(line.split()[:6] == ["2", "assistant", "0", "2", "100%", "-0.500"] for line in lines)
    assert 'tool_calls [{"name": "calculator", "arguments": {"expression": "6 * 7"}}]' in out


def test_inspect_a_group_and_all_transcripts(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_inspect(capsys, str(db), "--group", "g0")
    assert code == 0
    assert out.startswith("group g0: 3 episodes, reward mean 0.667 min 0.000 max 1.000")
    assert [line.split()[1] for line in out.splitlines() if line.startswith("episode ")] == ["1", "2", "3"]

    code, out, _ = run_inspect(capsys, str(db), "--transcript", "--where", "reward > 0", "--max-text", "10")
    assert code == 0
    assert "episodes 3  groups 2" in out and "(where reward > 0)" in out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("episode ")] == ["1", "3", "4"]
    assert '"You so" … "ool." (46 chars)' in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--episode", "99"], "error: no episode 99 in "),
        (["--group", "nope"], "error: no group 'nope' in "),
        (["--where", "rewrd > 0"], "no such column: rewrd"),
    ],
)
def test_inspect_reports_bad_requests(
    db: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, out, err = run_inspect(capsys, str(db), *args)
    assert code == 2 and out == "" and message in err


def test_inspect_refuses_what_is_not_a_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.db"
    code, _, err = run_inspect(capsys, str(missing))
    assert code == 2 and err.strip() == f"error: no store at {missing}: the file does not exist"
    assert not missing.exists()

    text = tmp_path / "notes.txt"
    text.write_text("not a database, just some words\n" * 50)
    code, _, err = run_inspect(capsys, str(text))
    assert code == 2 and "is not a longstraw store: it is not a SQLite database" in err

    foreign = tmp_path / "other.db"
    with closing(sqlite3.connect(foreign)) as conn:
        conn.execute("CREATE TABLE notes (body TEXT)")
    code, _, err = run_inspect(capsys, str(foreign))
    assert code == 2 and "is not a longstraw store (it is a SQLite database with tables: notes)" in err


def test_episode_and_group_are_exclusive(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", str(db), "--episode", "1", "--group", "g0"])
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_replay_checks_the_store_before_the_run_directory(
    db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty" / "trajectories.db"
    Store.open(empty).close()
    code = main(["replay", str(empty)])
    err = capsys.readouterr().err
    assert code == 2 and "holds no episodes" in err and "config.json" not in err
    code = main(["replay", str(db)])  # a store with episodes, but no run directory around it
    err = capsys.readouterr().err
    assert code == 2 and "has no config.json" in err
    assert not (db.parent / "replay").exists()


def test_replay_help_says_where_keeps_whole_groups(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["replay", "--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "keeps every group with at least one matching episode whole" in help_text
    assert "--recorded-tools, --no-recorded-tools" in help_text and "--out OUT" in help_text
