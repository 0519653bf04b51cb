"""The ``longstraw`` command line end to end: train a tiny run from a YAML file, replay its store, inspect and plot
it; bad input exits with status 2 and says what is wrong."""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import httpx
import pytest
import yaml
from stored_episodes import edited_trajectory
from terminal import sigint_as_in_a_terminal
from tiny_runs import ENV_ID, TINY_MODEL, WARM_START, tiny_config_dict
from viewer_stores import write_run_directory

from longstraw_agents.app import warm_start as app_warm_start
from longstraw_agents.cli import EXIT_BROKEN_PIPE, build_parser, main
from longstraw_agents.store import SCHEMA_VERSION, Store
from longstraw_agents.trajectory import Segment, Trajectory

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def write_yaml(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int, str]:
    """``longstraw train train.yaml``: a warm start on scripted episodes, then 2 GRPO steps. Returns the config
    file, the run directory, the exit code and what was printed."""
    root = tmp_path_factory.mktemp("cli")
    config = write_yaml(root / "train.yaml", tiny_config_dict(root / "run", warm_start=WARM_START))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["train", str(config)])
    return config, root / "run", code, out.getvalue()


def test_the_console_script_lists_the_subcommands() -> None:
    script = Path(sys.executable).with_name("longstraw")
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: longstraw")
    for command in ("envs", "inspect", "train", "replay", "plot", "export", "serve"):
        assert f"    {command} " in result.stdout


def test_envs_lists_the_registered_environments(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "envs")
    assert code == 0
    assert {"LongStraw/Calculator-v0", "LongStraw/NeedleSearch-v0", "LongStraw/PythonTask-v0"} <= set(out.split())


def test_train_runs_end_to_end(trained) -> None:
    _, run_dir, code, out = trained
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith(f"warm start: {WARM_START['episodes']} scripted episodes, 100 steps, loss ")
    assert [line.split()[:2] for line in lines[1:3]] == [["step", "1"], ["step", "2"]]
    assert all("reward" in line and "loss" in line for line in lines[1:3])
    assert lines[-1] == f"run directory: {run_dir}"
    for name in ("config.json", "trajectories.db", "metrics.jsonl", "checkpoint/trainer_state.json"):
        assert (run_dir / name).is_file(), name
    phases = [json.loads(line)["phase"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert phases == ["warm_start", "grpo", "grpo"]


def test_train_refuses_an_existing_run_and_resumes_it(trained, tmp_path: Path, capsys) -> None:
    config, run_dir, _, _ = trained
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    code, _, err = run_cli(capsys, "train", config, "--output-dir", copy)
    assert code == 2 and "already holds a run" in err and "--resume" in err
    code, out, _ = run_cli(capsys, "train", config, "--output-dir", copy, "--resume", "--steps", "3")
    assert code == 0 and "warm start" not in out
    assert [line.split()[:2] for line in out.splitlines()[:-1]] == [["step", "3"]]
    grpo = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in grpo if r["phase"] == "grpo"] == [1, 2, 3]
    code, _, err = run_cli(capsys, "train", config, "--output-dir", tmp_path / "empty", "--resume")
    assert code == 2 and "no checkpoint" in err


def test_invalid_configs_exit_2_and_name_the_fields(tmp_path: Path, capsys) -> None:
    bad = tiny_config_dict(tmp_path / "run", groups_per_step=0, stepz=3, trainer={"group_size": 0})
    code, out, err = run_cli(capsys, "train", write_yaml(tmp_path / "bad.yaml", bad))
    assert code == 2 and out == ""
    assert err.startswith("error: invalid configuration:")
    for field in ("  groups_per_step:", "  stepz:", "  trainer.group_size:"):
        assert field in err
    assert "  stepz: Extra inputs are not permitted; did you mean 'steps'?" in err
    code, _, err = run_cli(
        capsys, "train", write_yaml(tmp_path / "ok.yaml", tiny_config_dict(tmp_path)), "--steps", "-1"
    )
    assert code == 2 and "  steps:" in err
    quoted = write_yaml(tmp_path / "quoted.yaml", tiny_config_dict(tmp_path / "run", steps="3"))
    code, _, err = run_cli(capsys, "train", quoted)
    assert code == 2 and "  steps: Input should be a valid integer" in err  # not silently run as 3 steps
    code, _, err = run_cli(capsys, "train", tmp_path / "missing.yaml")
    assert code == 2 and "does not exist" in err
    (tmp_path / "train.ini").write_text("[env]\n")
    code, _, err = run_cli(capsys, "train", tmp_path / "train.ini")
    assert code == 2 and ".toml" in err
    assert not (tmp_path / "run").exists()  # nothing was started


def test_config_errors_found_before_training_exit_2_and_leave_no_run(tmp_path: Path, capsys) -> None:
    """Errors a run would otherwise meet at its first rollout, after the model was built, are one ``error:`` message
    before it, and no run directory is left behind."""
    run = tmp_path / "run"
    cases = {
        "unknown-env": ({"env": {"id": "LongStraw/Nope-v0"}}, ["env.id: unknown environment", "Calculator-v0"]),
        "bad-kwargs": (
            {"env": {"id": ENV_ID, "kwargs": {"max_turns": 0, "colour": "red"}}},
            ["invalid env.kwargs", "  env.kwargs.max_turns:", "  env.kwargs.colour:"],
        ),
        "long-prompt": ({"model": {**TINY_MODEL, "max_context": 16}}, ["model's context limit of 16 tokens"]),
        "preset-argument": (
            {"model": {"preset": "llama", "overrides": {"hiden": 128}}},
            ["model.overrides.hiden: not an argument of the llama preset; valid: vocab_size, hidden, layers"],
        ),
        "missing-model": ({"model": {"path": str(tmp_path / "no-model")}}, ["model.path: no model directory at"]),
        "missing-tokenizer": ({"tokenizer": str(tmp_path / "no-tokenizer")}, ["tokenizer: unknown tokenizer"]),
    }
    for name, (update, expected) in cases.items():
        code, out, err = run_cli(
            capsys, "train", write_yaml(tmp_path / f"{name}.yaml", tiny_config_dict(run, **update))
        )
        assert code == 2 and out == "" and err.startswith("error: "), (name, err)
        assert all(text in err for text in expected), (name, err)
        assert "Traceback" not in err and not run.exists(), name


def test_malformed_config_files_exit_2_and_name_the_file(tmp_path: Path, capsys) -> None:
    files = {
        "broken.yaml": ("env: {id: [unclosed\n", "not valid YAML"),
        "broken.toml": ("steps = = 3\n", "not valid TOML"),
        "list.yaml": ("- env\n- steps\n", "expected a mapping"),
    }
    for name, (text, expected) in files.items():
        (tmp_path / name).write_text(text)
        code, _, err = run_cli(capsys, "train", tmp_path / name)
        assert code == 2 and err.startswith(f"error: {tmp_path / name}: {expected}"), err


def test_replay_trains_on_the_selected_episodes(trained, tmp_path: Path, capsys) -> None:
    _, run_dir, _, _ = trained
    db = run_dir / "trajectories.db"
    code, out, err = run_cli(capsys, "replay", db, "--where", "reward >= 0", "--out", tmp_path / "replay")
    assert code == 0, err
    assert "episodes=16" in out and "groups=4" in out  # the replay_select record
    assert any(line.split()[:2] == ["step", "3"] for line in out.splitlines())  # the run's policy was at step 2
    assert out.splitlines()[-1] == f"replay run directory: {tmp_path / 'replay'}"
    assert (tmp_path / "replay" / "checkpoint" / "trainer_state.json").is_file()

    code, _, err = run_cli(capsys, "replay", tmp_path / "missing.db")
    assert code == 2 and "no store" in err
    code, _, err = run_cli(capsys, "replay", db, "--where", "rewrd > 0", "--out", tmp_path / "bad-where")
    assert code == 2 and "no such column: rewrd" in err
    code, _, err = run_cli(capsys, "replay", db, "--fork-at", "1", "--fork-group-size", "1")
    assert code == 2 and "fork_group_size" in err


def test_inspect_shows_transcripts_with_roles_and_tool_calls(trained, capsys) -> None:
    _, run_dir, _, _ = trained
    code, out, _ = run_cli(capsys, "inspect", run_dir / "trajectories.db", "--transcript")
    assert code == 0
    assert "episodes 16  groups 4" in out
    transcripts = out.split("\nepisode ")[1:]
    assert len(transcripts) == 16
    rows = [line.split() for line in transcripts[0].splitlines()[1:]]
    roles = [row[1] for row in rows if row and row[0].isdigit()]
    assert roles[:3] == ["system", "user", "assistant"]
    assert "tool_calls" in out and '"name": "calculator"' in out
    code, out, _ = run_cli(capsys, "inspect", run_dir / "trajectories.db", "--group", "step2-g0")
    assert code == 0 and out.startswith("group step2-g0: 4 episodes, reward ")


def test_plot_writes_the_curves(trained, tmp_path: Path, capsys) -> None:
    _, run_dir, _, _ = trained
    code, out, _ = run_cli(capsys, "plot", run_dir, "--out", tmp_path)
    assert code == 0
    written = [Path(line) for line in out.splitlines()]
    # memory.png too: without trainer.track_memory, the steps' process memory (rss_peak_bytes) is plotted
    assert [p.name for p in written] == ["reward.png", "loss.png", "length.png", "memory.png"]
    assert all(p.parent == tmp_path and p.read_bytes().startswith(PNG_MAGIC) for p in written)
    code, _, err = run_cli(capsys, "plot", tmp_path / "not-a-run")
    assert code == 2 and "metrics.jsonl does not exist" in err


# -- recovery: Ctrl-C, damaged stores and checkpoints --------------------------------------------------------------


def test_ctrl_c_in_the_warm_start_says_there_is_nothing_to_resume_and_a_rerun_starts_over(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped before its first checkpoint, a run has nothing to resume: the message says to run the command again,
    no run row is left in the store, and running again records one run (end to end: ~3 s)."""
    run_dir = tmp_path / "run"
    warm_start = {"episodes": 2, "sft": {"steps": 2, "batch_size": 1}}
    config = write_yaml(
        tmp_path / "train.yaml", tiny_config_dict(run_dir, steps=1, groups_per_step=1, warm_start=warm_start)
    )

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(app_warm_start, "supervised_warm_start", ctrl_c)
    code, _, err = run_cli(capsys, "train", config)
    assert code == 130 and "nothing to resume" in err and "resume with --resume" not in err, err
    with Store.open(run_dir / "trajectories.db", create=False) as store:
        assert store.runs() == []
    monkeypatch.undo()
    code, _, err = run_cli(capsys, "train", config, "--resume")
    assert code == 2 and "no checkpoint" in err  # what the message said
    code, _, err = run_cli(capsys, "train", config)
    assert code == 0, err
    with Store.open(run_dir / "trajectories.db", create=False) as store:
        [run] = store.runs()
        assert store.episodes_per_run() == {run.id: 4}


def test_resume_on_a_damaged_store_is_the_one_line_inspect_prints(trained, tmp_path: Path, capsys) -> None:
    config, run_dir, _, _ = trained
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    db = copy / "trajectories.db"
    for suffix in ("-wal", "-shm"):
        db.with_name(db.name + suffix).unlink(missing_ok=True)
    db.write_bytes(db.read_bytes()[:5000])  # cut short: SQLite finds the file malformed
    code, _, inspected = run_cli(capsys, "inspect", db)
    assert code == 2 and inspected.startswith("error: ") and len(inspected.splitlines()) == 1
    code, out, err = run_cli(capsys, "train", config, "--output-dir", copy, "--resume", "--steps", "3")
    assert code == 2 and out == "" and err == inspected, err


@pytest.mark.parametrize("removed", ["sharded/__0_0.distcp", "sharded/.metadata", "scheduler.bin"])
def test_resume_from_a_checkpoint_missing_files_names_them_in_one_line(
    trained, tmp_path: Path, capfd: pytest.CaptureFixture[str], removed: str
) -> None:
    """No DCP traceback, and no blame on the settings (they are the ones the checkpoint was written with)."""
    config, run_dir, _, _ = trained
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (copy / "checkpoint" / removed).unlink()
    code = main(["train", str(config), "--output-dir", str(copy), "--resume", "--steps", "3"])
    out, err = capfd.readouterr()
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(
        f"error: --resume: the checkpoint in {copy / 'checkpoint'} is incomplete: {removed} is missing"
    )
    assert "written with" not in err and "does not load" not in err


def test_resume_from_a_damaged_checkpoint_does_not_blame_the_same_settings(trained, tmp_path: Path, capsys) -> None:
    config, run_dir, _, _ = trained
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    shard = copy / "checkpoint" / "sharded" / "__0_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))  # all there, but zeros
    code, _, err = run_cli(capsys, "train", config, "--output-dir", copy, "--resume", "--steps", "3")
    assert code == 2 and "does not load with the model and mesh it was written with (model preset llama" in err
    assert "written with model" not in err and "Traceback" not in err


# -- failures found before heavy imports ---------------------------------------------------------------------------

FAILS_WITHOUT_TORCH = """
import contextlib, io, json, sys
from longstraw_agents.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    heavy = sorted(name for name in ("torch", "transformers", "matplotlib") if name in sys.modules)
    results.append({"argv": argv, "code": code, "err": err.getvalue(), "heavy": heavy})
print(json.dumps(results))
"""


def test_bad_arguments_and_missing_paths_fail_before_torch_is_imported(tmp_path: Path) -> None:
    """`longstraw plan` with a bad flag and `plot` of a missing directory answer at once: they import neither torch
    nor transformers (seconds of CPU) before saying what is wrong (one fresh interpreter for all the cases)."""
    cases = [
        (["plan", "--gpus", "0"], "--gpus: Input should be greater than or equal to 1"),
        (["plan", "--dp", "3"], "gpus (8) is not a multiple of dp (3)"),
        (["plan", "--model", str(tmp_path / "missing.json")], f"--model: {tmp_path / 'missing.json'} does not exist"),
        (["plan", "--model", "qwen9"], "--model: unknown model 'qwen9': give one of"),
        (["plan", "--longest", "--context", "1M"], "--longest searches the context length itself"),
        (["plot", str(tmp_path / "not-a-run")], "metrics.jsonl does not exist"),
    ]
    done = subprocess.run(
        [sys.executable, "-c", FAILS_WITHOUT_TORCH, json.dumps([argv for argv, _ in cases])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    for result, (_, expected) in zip(json.loads(done.stdout), cases, strict=True):
        assert result["code"] == 2 and expected in result["err"], result
        assert len(result["err"].splitlines()) <= 2 and result["heavy"] == [], result


def test_every_command_and_option_has_a_help_text() -> None:
    parser = build_parser()
    commands = parser._subparsers._group_actions[0]  # argparse keeps the subcommands here
    said = {action.dest: action.help for action in commands._choices_actions}
    missing = [f"longstraw {name}" for name in commands.choices if not said.get(name)]
    for name, command in [("", parser), *commands.choices.items()]:
        for action in command._actions:
            if not action.help:
                missing.append(f"longstraw {name} {'/'.join(action.option_strings) or action.dest}".replace("  ", " "))
    assert not missing, missing


# -- longstraw inspect: the store summary and transcripts ----------------------------------------------------------


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
    assert f"store {db} (schema v{SCHEMA_VERSION})" in out
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


def test_inspect_an_edited_episode_and_a_damaged_edit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "trajectories.db"
    with Store.open(path) as store:
        episode_id = store.add_episode(edited_trajectory())
        store.add_episode(edited_trajectory())
    code, out, _ = run_inspect(capsys, str(path))
    assert code == 0 and "context edits  6 in 2 episodes" in out.splitlines()
    code, out, _ = run_inspect(capsys, str(path), "--where", f"id = {episode_id}")
    assert code == 0 and "context edits  3 in 1 episode" in out.splitlines()
    code, out, _ = run_inspect(capsys, str(path), "--episode", str(episode_id))
    assert code == 0 and "  3 context edits, 4 physical sequences: 334, 88, 44, 42 tokens (loss 13, 10, 8, 5)" in out
    assert "  edit 1 before segment 6 (turn 1): evict segments 3 (tool, 300 tokens) -> placeholder segment 6" in out
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("UPDATE context_edits SET removed = '[99]' WHERE idx = 0")
    code, out, err = run_inspect(capsys, str(path), "--episode", str(episode_id))
    assert code == 2 and out == ""
    assert err == (
        f"error: episode {episode_id} is damaged: its context edits do not fit its 13 segments: context edit removes "
        "segments [99], which are not in the context [0, 1, 2, 3, 4, 5]\n"
    )


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

    code, _, err = run_inspect(capsys, str(tmp_path))  # a run directory given for its store
    assert code == 2 and err.strip() == f"error: {tmp_path} is a directory, not a store file"

    foreign = tmp_path / "other.db"
    with closing(sqlite3.connect(foreign)) as conn:
        conn.execute("CREATE TABLE notes (body TEXT)")
    code, _, err = run_inspect(capsys, str(foreign))
    assert code == 2 and "is not a longstraw store (it is a SQLite database with tables: notes)" in err


def test_inspect_into_a_closed_pipe_exits_quietly(db: Path) -> None:
    """``longstraw inspect DB | head``: the reader leaves early; the CLI exits without a BrokenPipeError traceback.
    The read end is closed before the CLI writes, so its first write fails, as after ``head`` has its lines."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "longstraw_agents.cli", "inspect", str(db), "--transcript"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert done.stderr.decode() == "" and done.returncode == EXIT_BROKEN_PIPE == 141


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


def test_version_is_the_installed_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"longstraw {importlib.metadata.version('longstraw-agents')}\n"


@pytest.mark.parametrize(
    ("args", "shown", "not_shown"),
    [
        (["--gpus", "0"], "--gpus: Input should be greater than or equal to 1", "Traceback"),
        (["--gpus", "-2"], "--gpus: Input should be greater than or equal to 1", "fits"),
        (["--dp", "3", "--gpus", "8"], "gpus (8) is not a multiple of dp (3)", "cp"),  # no cp was given
        (["--cp", "3"], "gpus (8) is not a multiple of cp (3)", "dp"),
        (["--gpu-mem", "0", "--beta", "-1"], "--gpu-mem: Input should be greater", "gpu_mem"),
        (["--cp", "4", "--cp-rank", "4"], "cp_rank (4) must be below cp (4)", "dp"),
        (["--hsdp"], "hsdp replicates over the dp ranks: with dp = 1 there is nothing to replicate over", "fits"),
        (
            ["--expert-dispatch"],
            "expert_dispatch sends tokens to their experts' ranks: it needs expert_parallel",
            "fits",
        ),
    ],
)
def test_plan_refuses_bad_requests_naming_what_was_given(
    capsys: pytest.CaptureFixture[str], args: list[str], shown: str, not_shown: str
) -> None:
    code, out, err = run_cli(capsys, "plan", *args)
    assert code == 2 and out == ""
    assert err.startswith("error: invalid plan:\n") and shown in err and not_shown not in err


def test_plan_of_each_cp_rank_holds_the_earlier_rows_its_cells_read(capsys: pytest.CaptureFixture[str]) -> None:
    """A balanced capture's rank 0 computes the first and the last of 8 parts: its last reads 6 parts of other
    ranks' rows, rank 3's middle run 3 (in rank order, for the wavefront walk, it is the other way round:
    tests/test_planner.py)."""
    tiny = ("plan", "--model", "tiny-llama", "--gpus", "4", "--context", "32M", "--chunk", "64", "--gpu-mem", "1000T",
            "--group", "2", "--completion", "16")  # fmt: skip
    rows = {}
    for rank in ("0", "3"):
        code, out, _ = run_cli(capsys, *tiny, "--cp-rank", rank)
        assert code == 0 and "the step's peak is in its capture phase" in out
        (line,) = [ln for ln in out.splitlines() if ln.strip().startswith("sharded capture (hidden, earlier rows)")]
        rows[rank] = float(line.split()[-1])
    code, out, _ = run_cli(capsys, *tiny, "--cp-rank", "3", "--capture", "rank-order")  # the last rank, in order
    (line,) = [ln for ln in out.splitlines() if ln.strip().startswith("sharded capture (hidden, earlier rows)")]
    rows["3 in rank order"] = float(line.split()[-1])
    hidden = 32e6 / 4 * 64 * 2 / 2**30  # a rank's hidden states (tiny-llama: hidden 64, bf16), then the rows
    assert rows["0"] - hidden == pytest.approx(2 * (rows["3"] - hidden), rel=0.01)  # 6 and 3 parts
    assert rows["3 in rank order"] - hidden == pytest.approx(rows["0"] - hidden, rel=0.01)  # 3 shards


def test_plan_time_prints_each_phase_on_the_chosen_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    tiny = ("plan", "--model", "tiny-qwen3_5", "--gpus", "2", "--context", "8K", "--chunk", "1K", "--group", "2",
            "--completion", "16", "--mode", "exact", "--time", "--hardware", "h20")  # fmt: skip
    code, out, _ = run_cli(capsys, *tiny)
    assert code == 0
    timing = out[out.index("Time model (H20") :].splitlines()
    assert [line.split()[0] for line in timing[2:6]] == ["rollout", "capture", "replay", "walk"]
    assert timing[-1].startswith("step (without rollouts): ") and "on each of 2 GPUs" in timing[-1]


def test_plan_time_takes_the_rates_a_gpu_run_measured(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``--profile``: the model family's profile of a bench/gpu.py record (implies --time); a record without it, or
    no record, is one line of error."""
    from longstraw_agents.plan import PROFILES

    measured = PROFILES["h100"].model_copy(update={"name": "NVIDIA H100 80GB HBM3", "measured_on": "micro-benchmarks"})
    record = tmp_path / "gpu.json"
    record.write_text(json.dumps({"setup": {"hybrid": {"profile": measured.model_dump()}}}))
    tiny = ("plan", "--model", "tiny-qwen3_5", "--gpus", "1", "--context", "1K", "--chunk", "256", "--group", "2")
    code, out, _ = run_cli(capsys, *tiny, "--completion", "16", "--profile", str(record))
    assert code == 0 and "Time model (NVIDIA H100 80GB HBM3; efficiencies: micro-benchmarks; links: H200's)" in out
    code, _, err = run_cli(capsys, *tiny, "--model", "tiny-llama", "--profile", str(record))
    assert code != 0 and "no profile measured for the dense family (it has: hybrid)" in err
    code, _, err = run_cli(capsys, *tiny, "--profile", str(tmp_path / "none.json"))
    assert code != 0 and "--profile" in err and "No such file" in err


def test_plan_longest_says_when_the_answer_is_the_search_bound(capsys: pytest.CaptureFixture[str]) -> None:
    tiny = ("plan", "--model", "tiny-llama", "--gpus", "1", "--group", "2", "--completion", "16", "--chunk", "64")
    code, out, _ = run_cli(capsys, *tiny, "--gpu-mem", "1000T", "--longest")
    assert code == 0
    assert out.splitlines()[0] == (
        "longest context that fits: at least 67,108,863 positions (the search's upper bound; longer contexts were "
        "not tried)"
    )
    code, out, _ = run_cli(capsys, *tiny, "--gpu-mem", "4GB", "--longest")
    assert code == 0 and out.startswith("longest context that fits: ") and "at least" not in out.splitlines()[0]


def test_plan_of_a_mixture_of_experts_that_needs_expert_parallelism_says_so(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A MoE step that does not fit as asked but fits with expert parallelism and offload (GLM-5.2 on 32 GPUs): the
    plan names the flags, and does not offer serving the policy, which helps only a step that fits. (The plans'
    figures are set here: measuring them takes seconds; tests/test_planner.py checks the alternative itself.)"""
    import longstraw_agents.plan as planning

    def plan_memory(request: planning.PlanRequest) -> planning.Plan:
        held = (40 if request.expert_parallel else 120) * 2**30
        return planning.Plan(request, {"weights": held}, rollout={"sampler state": 2 * held})

    monkeypatch.setattr(planning, "plan_memory", plan_memory)
    code, out, _ = run_cli(capsys, "plan", "--model", "tiny-glm_moe_dsa", "--gpus", "2")
    assert code == 0 and out.count("does NOT fit") == 2 and "serve the policy" not in out
    assert out.splitlines()[-1] == (
        "with expert parallelism (--expert-parallel --offload) it fits: 43.00 GiB per GPU, each cp rank holding whole "
        "experts, never gathered (add the flags for its plan)"
    )
    code, out, _ = run_cli(capsys, "plan", "--model", "tiny-glm_moe_dsa", "--gpus", "4", "--dp", "2", "--offload")
    assert code == 0 and out.splitlines()[-1].startswith("with expert parallelism (--expert-parallel --hsdp) it fits")
    code, out, _ = run_cli(capsys, "plan", "--model", "tiny-llama", "--gpus", "2")  # no experts: nothing to add
    assert code == 0 and "expert" not in out.splitlines()[-1]


# -- view ------------------------------------------------------------------------------------------------------


def test_view_writes_a_self_contained_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = write_run_directory(tmp_path / "run")
    code, out, err = run_cli(capsys, "view", run_dir)
    assert code == 0 and err == ""
    assert out.startswith(f"wrote {run_dir / 'view.html'} (") and "3 of 3 selected groups" in out
    assert '"mode":"static"' in (run_dir / "view.html").read_text()
    chosen = tmp_path / "pages" / "step2.html"
    code, out, _ = run_cli(capsys, "view", run_dir / "trajectories.db", "--group", "step2-g0", "--out", chosen)
    assert code == 0 and "1 of 1 selected groups" in out and chosen.is_file()
    code, out, _ = run_cli(capsys, "view", run_dir, "--where", "reward > 0.5", "--max-groups", "1", "--out", chosen)
    assert code == 0 and "1 of 2 selected groups" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing"], "error: no store at missing: the file does not exist"),
        (["RUN", "--group", "step9-g0"], "error: no group 'step9-g0' in RUN/trajectories.db"),
        (["RUN", "--where", "reward > 5"], "error: no episode of RUN/trajectories.db matches --where 'reward > 5'"),
        (["RUN", "--where", "rewrd > 5"], "no such column: rewrd"),
        (["RUN", "--max-groups", "0"], "error: max_groups must be at least 1, got 0"),
    ],
)
def test_view_reports_bad_requests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, args: list[str], message: str
) -> None:
    write_run_directory(tmp_path / "RUN")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, "view", *args)
    assert code == 2 and out == "" and message in err and "Traceback" not in err


def test_view_refuses_a_port_it_cannot_listen_on(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = write_run_directory(tmp_path / "run")
    with closing(socket.socket()) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = run_cli(capsys, "view", run_dir, "--serve", "--port", port)
    assert code == 2 and out == "" and err == f"error: cannot listen on port {port}: Address already in use\n"
    with pytest.raises(SystemExit):
        main(["view", str(run_dir), "--serve", "--port", "70000"])
    assert "--port: not a port: '70000' (0-65535; 0 picks a free one)" in capsys.readouterr().err


def test_view_serves_until_ctrl_c(tmp_path: Path) -> None:
    run_dir = write_run_directory(tmp_path / "run")
    command = [str(Path(sys.executable).with_name("longstraw")), "view", str(run_dir), "--serve", "--port", "0"]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_as_in_a_terminal
    )
    try:
        assert process.stdout is not None
        banner = process.stdout.readline()
        assert banner.startswith(f"viewing {run_dir / 'trajectories.db'} (3 groups) on http://127.0.0.1:"), banner
        url = banner.split(" on ", 1)[1].split(";", 1)[0]
        assert [g["group_id"] for g in httpx.get(url + "api/index", timeout=30).json()["groups"]][1:] == [
            "step1-g0",
            "step2-g0",
        ]
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=30)
        assert process.returncode == 130 and "stopped" in err and "Traceback" not in err
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_train_seed_overrides_the_configs_seed(tmp_path: Path, capsys) -> None:
    """``--seed`` runs the config under another seed (bench.compaction_learning runs an example per seed so)."""
    config = write_yaml(tmp_path / "run.yaml", tiny_config_dict(tmp_path / "run", seed=1))
    code, _, err = run_cli(capsys, "train", config, "--seed", "5", "--steps", "0")
    assert code == 0, err
    assert json.loads((tmp_path / "run" / "config.json").read_text())["seed"] == 5
