"""The programs in examples/ run as a user would run them."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import gymnasium
import yaml

from longstraw_agents.cli import main
from longstraw_agents.envs import ScriptedPolicy, run_episode
from longstraw_agents.store import Store

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_custom_env_example_runs_and_solves_its_task() -> None:
    script = EXAMPLES / "custom_env.py"
    assert len(script.read_text().splitlines()) < 50  # the README promises a custom env in under 50 lines
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "[tool]" in done.stdout and "<tool_response>" in done.stdout
    assert "reward 1.0 (answered" in done.stdout


def test_readme_shows_the_custom_env_example_verbatim() -> None:
    readme = (EXAMPLES.parent / "README.md").read_text()
    section = readme.split("## Environments and tools", 1)[1]
    shown = section.split("```python\n", 1)[1].split("```\n", 1)[0]
    assert shown == (EXAMPLES / "custom_env.py").read_text()


def test_needle_long_context_example_runs_end_to_end(tmp_path: Path) -> None:
    """The long-context example at a small size: stored episodes share a scripted prefix of >= --tokens tokens
    that carries no loss; only the continuations after it do."""
    script = EXAMPLES / "needle_long_context.py"
    assert len(script.read_text().splitlines()) < 150
    tokens, group = 2112, 3
    argv = ["--tokens", str(tokens), "--group", str(group), "--steps", "1", "--max-new-tokens", "8"]
    done = subprocess.run(
        [sys.executable, str(script), *argv, "--out", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "exact GRPO: loss" in done.stdout and "peak tracked" in done.stdout and "wall time" in done.stdout

    with Store.open(tmp_path / "trajectories.db", create=False) as store:
        episodes = list(store.episodes())
    assert len(episodes) == group and len({t.group_id for t in episodes}) == 1  # one group, one task
    starts = {t.completion_start() for t in episodes}
    assert len(starts) == 1 and (prefix := starts.pop()) >= tokens  # first loss token: the end of the prefix
    shared = episodes[0].token_ids()[:prefix]
    assert all((t.token_ids()[:prefix] == shared).all() for t in episodes)
    # G-1 members sampled by the policy (behaviour logprobs on every loss turn) and the scripted answer (reward 1)
    trained = [[s for s in t if s.loss_mask.any()] for t in episodes]
    assert all(segments and all(s.role == "assistant" for s in segments) for segments in trained)
    sampled = [all(s.logprobs is not None for s in segments) for segments in trained]
    assert sampled.count(True) == group - 1
    assert episodes[sampled.index(False)].reward == 1.0


def test_needle_long_context_prefix_reaches_the_target_where_the_env_falls_short() -> None:
    """At target_tokens=4096 the scripted episode of seed 7 stops at 4,072 tokens; the example grows the task."""
    spec = importlib.util.spec_from_file_location("needle_long_context", EXAMPLES / "needle_long_context.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    short, _ = example.scripted_prefix(example.make_env(4096), seed=7, options={})
    assert len(short) < 4096
    envs, prefix, turns = example.long_group(4096, 2, seed=7, options={})
    assert len(prefix) >= 4096 and turns == 4 and all(env.num_tokens == len(prefix) for env in envs)


def test_slurm_script_starts_one_torchrun_per_node_meeting_at_the_first_node(tmp_path: Path) -> None:
    """examples/slurm/train.sbatch under stand-ins for SLURM's ``scontrol`` and ``srun`` (which prints what it would
    start on every node): a torchrun command that torchrun's own parser reads as 2 nodes of 8 processes meeting at
    the first node of the allocation, running ``longstraw train`` with the given flags."""
    from torch.distributed.run import get_args_parser

    from longstraw_agents.cli import build_parser

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_ins = {"scontrol": 'printf "gpu-a1\\ngpu-a2\\n"', "srun": 'printf "%s\\n" "$@" > "$SRUN_ARGS"'}
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    slurm = {"SLURM_JOB_NODELIST": "gpu-a[1-2]", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "77"}
    env = {**os.environ, **slurm, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env["SRUN_ARGS"] = str(tmp_path / "srun-args")
    script = EXAMPLES / "slurm" / "train.sbatch"
    done = subprocess.run(
        ["bash", str(script), "train.yaml", "--resume"], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0, done.stderr

    srun_flag, launcher, *torchrun_args = (tmp_path / "srun-args").read_text().splitlines()
    assert (srun_flag, launcher) == ("--kill-on-bad-exit=1", "torchrun")
    torchrun = get_args_parser().parse_args(torchrun_args)
    assert (torchrun.nnodes, torchrun.nproc_per_node) == ("2", "8")
    assert (torchrun.rdzv_backend, torchrun.rdzv_endpoint, torchrun.rdzv_id) == ("c10d", "gpu-a1:29500", "77")
    assert torchrun.module and torchrun.training_script == "longstraw_agents.cli"
    assert torchrun.training_script_args == ["train", "train.yaml", "--resume"]
    train = build_parser().parse_args(torchrun.training_script_args)
    assert (train.config, train.resume) == ("train.yaml", True)


def test_context_edits_example_logs_edited_episodes_and_trains_over_their_sequences(tmp_path: Path) -> None:
    """At a small size: the stored episodes keep their edits, and the printed sharing is the tree's."""
    script = EXAMPLES / "context_edits.py"
    assert len(script.read_text().splitlines()) < 150
    argv = ["--group", "4", "--pages", "8", "--reads", "6", "--words", "40", "--budget", "400", "--out", str(tmp_path)]
    done = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    with Store.open(tmp_path / "trajectories.db", create=False) as store:
        episodes = list(store.episodes())
    assert len(episodes) == 4 and all(t.is_edited for t in episodes)
    assert {e.kind for e in episodes[0].edits} == {"evict"} and {e.kind for e in episodes[1].edits} == {"summary"}
    sequences = [s for t in episodes for s in t.physical_sequences()]
    lengths = sum(sum(len(t.segments[k]) for k in s.segments) for t in episodes for s in t.physical_sequences())
    assert f"{len(sequences)} physical sequences, {lengths:,} tokens in all" in done.stdout
    for t in episodes:  # every sequence stays within the budget plus the turn that crossed it
        assert max(sum(len(t.segments[k]) for k in s.segments) for s in t.physical_sequences()) < 400 + 200


def test_the_full_size_compaction_config_would_run(tmp_path: Path, capsys) -> None:
    """``longstraw train --check`` on the full-size compaction example: the env builds with its context policy, the
    model's context holds the budget, and the scripted solution reads 32K tokens or more through contexts of 4K
    (the run itself takes about half an hour on 2 cores: README's figures)."""
    config = yaml.safe_load((EXAMPLES / "train_needle_compaction.yaml").read_text())
    env = gymnasium.make(config["env"]["id"], **config["env"]["kwargs"])
    trajectory = run_episode(env, ScriptedPolicy(env), seed=0)
    assert trajectory.reward == 1.0 and trajectory.num_tokens >= 32_768
    assert max(trajectory.num_tokens_of(list(s.segments)) for s in trajectory.physical_sequences()) <= 4096
    assert config["env"]["kwargs"]["context"]["max_context_tokens"] == 4096
    config["output_dir"] = str(tmp_path / "run")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", "--check", str(tmp_path / "config.yaml")]) == 0, capsys.readouterr().err
    [warm_start] = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("warm start")]
    stages = config["warm_start"]["drill"]
    assert f"drill {len(stages)}: {stages[-1]['sft']['steps']:,} steps x" in warm_start  # the stages, then episodes
    given = ", ".join(f"{k}={v}" for k, v in config["warm_start"]["env_kwargs"].items())  # (pages=3, ...)
    assert f"{config['warm_start']['episodes']:,} scripted episodes ({given}) + " in warm_start


def test_the_compaction_learning_bench_runs_the_example_at_the_suites_size(tmp_path: Path) -> None:
    """``python -m bench.compaction_learning --quick``: the example's pipeline (warm start on scripted traces with
    summaries, GRPO through ``longstraw train --seed``, held-out evaluations) at a small size, and the figures README
    reads from its results (the full size: README's table)."""
    from bench.compaction_learning import main as bench

    result = bench(["--quick", "--seeds", "3", "--threads", "1"])
    [run] = result["runs"]
    assert run["seed"] == 3 and run["grpo_steps"] == 2 and run["eval_episodes"] == 4
    assert run["warm_start"]["loss_last"] < run["warm_start"]["loss_first"]
    assert run["summaries_per_episode"] >= 1  # the episodes were compacted: no context held a whole history
    assert run["context_tokens_max"] < run["history_tokens_max"]
    assert run["context_tokens_max"] <= 1024 + result["config"]["sampling"]["max_new_tokens"]  # (a last turn)
    assert 0 <= run["reward_before"] <= 1 and run["rise"] == run["reward_after"] - run["reward_before"]
    assert result["config"]["env"]["id"] == "LongStraw/PageRecall-v0" and "meets_target" in result
    sharpness = run["sharpness"]  # the warm start read on held-out scripted episodes (beta > 0 keeps its weights)
    assert 0 < sharpness["format_intact"] <= sharpness["format_p_min"] <= sharpness["format_p_median"] <= 1
    assert 0 <= sharpness["code_p_mean"] <= 1 and sharpness["format_tokens"] > 0
