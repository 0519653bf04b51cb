"""What README.md shows is what the repository has: the config it prints, the commands it names, the env id form,
the code it shows (the served-policy snippet, a custom env trained from the CLI) and what it says about them."""

from __future__ import annotations

import ast
import inspect
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import gymnasium
import pytest
import yaml

from longstraw_agents.cli import build_parser, main
from longstraw_agents.envs import ScriptedPolicy, SummaryTurn, run_episode, tool_instructions, unwrap_tool_env
from longstraw_agents.sampler import OpenAISampler, SamplingConfig
from longstraw_agents.store import Store
from longstraw_agents.tokenizer import load_tokenizer
from longstraw_agents.trajectory import Segment

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_shows_the_example_training_config_verbatim() -> None:
    blocks = [block.split("```\n", 1)[0] for block in README.split("```yaml\n")[1:]]
    [shown] = [block for block in blocks if block.startswith("# longstraw train examples/train_calculator.yaml")]
    assert shown == (ROOT / "examples" / "train_calculator.yaml").read_text()


def test_readme_names_the_two_commands_and_every_cli_subcommand() -> None:
    assert "make demo" in README and "make test" in README
    subcommands = build_parser()._subparsers._group_actions[0].choices  # argparse keeps them here
    for name in subcommands:
        assert f"longstraw {name}" in README, name


def test_readme_quotes_the_demo_figures_that_bench_demo_measured() -> None:
    """README's demo table is bench/results/demo.json (`python -m bench.demo`, which runs `make demo` itself), and
    each run it quotes met the demo's target."""
    results = json.loads((ROOT / "bench" / "results" / "demo.json").read_text())
    assert sorted(results["runs"]) == ["1", "2"]
    for threads, run in results["runs"].items():
        assert run["command"] == f"make demo THREADS={threads}" and run["date"] in README
        [row] = [line for line in README.splitlines() if line.startswith(f"| `{run['command']}` |")]
        loss = run["warm_start"]
        assert f"| {loss['loss_first']:.3f} → {loss['loss_last']:.3f} |" in row
        assert f"{run['reward_before']:.3f} → {run['reward_after']:.3f} ({run['rise']:+.2f})" in row
        assert f"| {run['cpu_minutes']:.1f} min | {run['wall_minutes']:.1f} min |" in row
        target = results["target"]
        assert run["rise"] >= target["rise"] and run["cpu_minutes"] <= target["cpu_minutes"] and run["meets_target"]


def test_readme_quotes_the_async_grpo_speedups_that_bench_async_rollouts_measured() -> None:
    """README's asynchronous GRPO table is bench/results/async.json (`python -m bench.async_rollouts`): each loop's
    steps per minute in every round, its speed-up over the synchronous loop, and the run's date and tool delay."""
    result = json.loads((ROOT / "bench" / "results" / "async.json").read_text())
    assert "python -m bench.async_rollouts" in README and result["date"] in README
    assert f"{1000 * result['tool_delay_s']:.0f} ms" in README
    loops = {"sync": "synchronous", "async-1": "max_staleness 1", "async-2": "max_staleness 2"}
    for mode, name in loops.items():
        [row] = [line for line in README.splitlines() if line.startswith(f"| {name} |")]
        rates = ", ".join(f"{runs[mode]['steps_per_minute']:.1f}" for runs in result["rounds"])
        speedups = f"{result['speedup'][mode]:.2f}x | {result['steady_speedup'][mode]:.2f}x"
        assert row.startswith(f"| {name} | {rates} | {speedups} |"), row


def test_readme_has_no_unfilled_template_fields() -> None:
    assert not re.search(r"\{\{[A-Z_]+\}\}", README)


def test_the_module_qualified_env_id_in_the_readme_works_in_a_fresh_interpreter() -> None:
    code = "import gymnasium; gymnasium.make('longstraw_agents.envs:LongStraw/Calculator-v0').reset(seed=0)"
    assert "longstraw_agents.envs:LongStraw/Calculator-v0" in README
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def _layout_names(path: str) -> set[str]:
    """The module names README's layout table lists (in backticks) for ``path``."""
    row = next(line for line in README.splitlines() if line.startswith(f"| `{path}` |"))
    return {name.rstrip("/") for name in re.findall(r"`([a-z_]+/?)`", row.split("|")[3])}


def _modules(directory: Path) -> set[str]:
    names = {p.stem for p in directory.glob("*.py") if p.stem != "__init__"}
    return names | {p.name for p in directory.iterdir() if (p / "__init__.py").exists()}


def test_the_layout_table_names_every_module_and_only_modules_that_exist() -> None:
    core = _modules(ROOT / "longstraw_agents") - {"app", "engine", "viewer"}  # (each has a row of its own; plan/,
    # serving/ and store/ have one too, and the core row names them)
    assert _layout_names("longstraw_agents/") == core
    for package in ("app", "engine", "viewer", "plan", "serving", "store"):
        assert _layout_names(f"longstraw_agents/{package}/") == _modules(ROOT / "longstraw_agents" / package)


def test_every_path_the_readme_names_exists() -> None:
    named = set(
        re.findall(r"`((?:tests|examples|scripts|bench|envs|tools|trainer|longstraw_agents)/[\w/.]+\.py)`", README)
    )
    assert named and not [path for path in named if not (ROOT / path).exists()]


def _code_blocks(language: str) -> list[str]:
    return [block.split("```", 1)[0] for block in README.split(f"```{language}\n")[1:]]


def _block_with(language: str, text: str) -> str:
    [block] = [b for b in _code_blocks(language) if text in b]
    return block


def test_the_openai_sampler_snippet_calls_the_real_signature() -> None:
    """README's example binds to the real constructor (a wrong keyword or a missing stop id would be a TypeError)."""
    snippet = _block_with("python", "OpenAISampler(")
    [call] = [
        node
        for node in ast.walk(ast.parse(snippet))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "OpenAISampler"
    ]
    bound = inspect.signature(OpenAISampler).bind(*call.args, **{kw.arg: kw.value for kw in call.keywords if kw.arg})
    assert {"base_url", "stop_token_ids", "config", "model"} <= set(bound.arguments)
    # and it runs: the shipped tokenizer stands in for the served model's directory (no request is made)
    namespace: dict[str, Any] = {}
    exec(snippet.replace('load_tokenizer("/path/to/model")', 'load_tokenizer("longstraw-bpe")'), namespace)
    sampler = namespace["sampler"]
    assert sampler.stop_token_ids == [load_tokenizer().eos_token_id] and sampler.model == "/path/to/model"
    assert isinstance(sampler.config, SamplingConfig) and sampler.config.temperature == 1.0


def test_the_readme_says_how_to_get_the_longstraw_command() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["longstraw"] == "longstraw_agents.cli:main"
    assert "VENV := .venv" in (ROOT / "Makefile").read_text()
    assert "source .venv/bin/activate" in README and "`.venv/bin/longstraw`" in README


def test_what_the_readme_says_about_instructions_and_system_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    """``instructions`` keeps the tool schemas in the system message; an override of ``system_prompt`` drops them
    unless it appends ``tool_instructions(self.registry)``."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    from custom_env import ReverseEnv

    class Replaced(ReverseEnv):
        def system_prompt(self, task: str) -> str:
            return "Reverse the user's word."

    class Appended(ReverseEnv):
        def system_prompt(self, task: str) -> str:
            return f"Reverse the user's word.\n\n{tool_instructions(self.registry)}"

    def system_text(env_class: type[ReverseEnv]) -> str:
        env = env_class()
        env.reset(seed=0)
        return env.trajectory.segments[0].text

    schema = '"name": "reverse"'
    assert ReverseEnv.instructions in system_text(ReverseEnv) and schema in system_text(ReverseEnv)
    assert schema not in system_text(Replaced) and schema in system_text(Appended)
    assert "`tool_instructions(self.registry)`" in README and "set `instructions`" in README


def test_the_readme_custom_env_config_trains_from_the_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``env.id: "module:Name-v0"`` trains a custom env with the CLI (the module on the path, as PYTHONPATH=examples
    puts it), and the stored group ids have the form README gives for ``inspect --group``."""
    shown = yaml.safe_load(_block_with("yaml", "custom_env:"))
    assert shown["env"]["id"] == "custom_env:MyTasks/Reverse-v0"
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    small = {"preset": "llama", "overrides": {"hidden": 32, "layers": 1}}
    config = {**shown, "model": small, "steps": 1, "groups_per_step": 2, "output_dir": str(tmp_path / "run")}
    config |= {"trainer": {"group_size": 2}, "sampling": {"max_new_tokens": 16}, "progress": False}
    (tmp_path / "reverse.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", str(tmp_path / "reverse.yaml")]) == 0
    with Store.open(tmp_path / "run" / "trajectories.db", create=False) as store:
        groups = store.groups()
        assert {t.env_id for members in groups.values() for t in members} == {"MyTasks/Reverse-v0"}
    assert sorted(groups) == ["step1-g0", "step1-g1"]  # stepN-gK: group K (from 0) of step N (from 1)
    assert "`stepN-gK`" in README and "--group step3-g1" in README


def test_the_context_edit_snippet_does_what_its_comments_say() -> None:
    section = README.split("### Episodes that edit their context", 1)[1]
    snippet = section.split("```python\n", 1)[1].split("```\n", 1)[0]
    names = ["sys_ids", "task_ids", "call_ids", "page_ids", "call2_ids", "page2_ids", "placeholder_ids", "answer_ids"]
    scope: dict[str, Any] = {name: [k + 1] * (k + 2) for k, name in enumerate(names)}
    scope["summary"] = Segment("user", [99, 98])
    exec(compile(snippet, "README.md", "exec"), scope)
    trajectory = scope["t"]
    shown = re.search(r"physical_sequences\(\)\]\s+# (.*)", snippet).group(1)
    assert [s.segments for s in trajectory.physical_sequences()] == ast.literal_eval(shown)
    assert trajectory.context() == [0, 1, 8] and [e.kind for e in trajectory.edits] == ["evict", "summary"]


def test_the_context_policy_snippet_builds_its_environment() -> None:
    blocks = [block.split("```\n", 1)[0] for block in README.split("```yaml\n")[1:]]
    [shown] = [block for block in blocks if "max_context_tokens" in block]
    env = yaml.safe_load(shown)["env"]
    config = unwrap_tool_env(gymnasium.make(env["id"], **env["kwargs"])).config
    assert config.context is not None and config.context.max_context_tokens == 4096
    assert config.context.strategy == SummaryTurn(threshold=2560)
    built = gymnasium.make(env["id"], **env["kwargs"])
    solved = run_episode(built, ScriptedPolicy(built), seed=0)  # its default max_turns counts the summary turns
    assert solved.reward == 1.0 and sum(e.kind == "summary" for e in solved.edits) > 5


def test_readme_quotes_the_compaction_tables_that_bench_compaction_measured() -> None:
    """README's compaction tables are bench/results/compaction.json as ``bench.compaction`` prints them, with the
    command and the date that produced it."""
    from bench.compaction import tables

    record = json.loads((ROOT / "bench" / "results" / "compaction.json").read_text())
    assert f"`{record['command']}`" in README and record["date"] in README
    for line in tables(record):
        assert line in README, line


def test_readme_quotes_the_compaction_learning_runs_that_bench_compaction_learning_measured() -> None:
    """README's table of the long-horizon compaction task is bench/results/compaction_learning.json as
    ``bench.compaction_learning`` renders it, with its command and date, run on the example README names."""
    from bench.compaction_learning import table

    record = json.loads((ROOT / "bench" / "results" / "compaction_learning.json").read_text())
    assert f"`{record['command']}`" in README and record["date"] in README
    assert table(record) in README
    example = yaml.safe_load((ROOT / "examples" / "train_needle_compaction.yaml").read_text())
    assert record["config"] == example


def _positions(n: int) -> str:
    """A context as README quotes it: 89K, 1.52M."""
    return f"{n / 1e6:.2f}M" if n >= 1_000_000 else f"{round(n / 1000)}K"


def test_readme_quotes_the_plans_that_bench_planner_planned() -> None:
    """README's full-scale plans (the published configurations, the stress test, GLM-5.2, the longest exact
    contexts) are what ``bench.planner`` wrote to bench/results/planner.json, so they cannot go stale."""
    record = json.loads((ROOT / "bench" / "results" / "planner.json").read_text())

    def total(label: str, mode: str = "detached", optimizer: str = "adamw", group: int = 8) -> float:
        (row,) = [
            r for r in record["rows"]
            if r["label"] == label and r["request"]["mode"] == mode and r["request"]["optimizer"] == optimizer
            and r["request"]["group"] == group
        ]  # fmt: skip
        return row["total_gib"]

    qwen, stress = "Qwen3.6-27B, 8 x 96 GB, detached, G=8", "Qwen3.6-27B stress, 8 x 96 GB"
    glm = "GLM-5.2, 32 x 96 GB, detached"
    assert f"**{total(qwen):.1f} GiB of 89.4 per GPU: fits**" in README
    assert f"**{total(qwen + ', offloaded'):.1f} GiB** on the GPU" in README
    assert (
        f"detached: {total(stress):.1f} GiB with AdamW on the GPU, **{total(stress, optimizer='none'):.1f} without "
        f"AdamW**, **{total(stress + ', offloaded'):.1f} with AdamW offloaded** (fits); exact (wavefront walk): "
        f"{total(stress, 'exact', 'none'):.1f} GiB without AdamW, "
        f"{total(stress + ', offloaded', 'exact'):.1f} offloaded"
    ) in README
    assert (
        f"{total(glm):.0f} GiB ({total(glm, optimizer='none'):.0f} without AdamW, "
        f"{total(glm + ', offloaded'):.0f} offloaded)"
    ) in README
    longest = {key: _positions(n) for key, n in record["longest_exact"].items()}

    def walk(walk: str, gpus: int) -> list[str]:
        name = f"qwen3.6-27b, {gpus} GPUs, exact ({walk} walk), optimizer"
        return [longest[f"{name} {optimizer}"] for optimizer in ("adamw", "none", "adamw, offloaded")]

    (a, b, c), (d, e, f) = walk("replicated", 8), walk("replicated", 32)
    assert (
        f"replicated walk (`--walk replicated`) **{a}** on 8 GPUs with AdamW, {b} without, **{c} with AdamW "
        f"offloaded**; **{d}** on 32 GPUs with AdamW, {e} without, {f} offloaded"
    ) in README
    (a, b, c), (d, e, f) = walk("wavefront", 8), walk("wavefront", 32)
    assert (
        f"Wavefront walk (the default, balanced): {a} on 8 GPUs with AdamW, **{b}** without, {c} offloaded; {d} on "
        f"32 GPUs with AdamW, {e} without, {f} offloaded"
    ) in README


def test_readme_quotes_the_agent_target_that_bench_planner_planned() -> None:
    """README's agent table is what ``bench.planner --agents`` wrote, each row planned from a command README's shape
    names (the JSON holds each row's request: the CLI's parser must still make the same one of the command)."""
    from dataclasses import asdict

    from bench.planner import AGENT_COMMANDS, agent_table
    from longstraw_agents.cli import flags_plan_request

    record = json.loads((ROOT / "bench" / "results" / "planner_agents.json").read_text())
    assert agent_table(record) in README
    assert {label: row["command"] for label, row in record["rows"].items()} == AGENT_COMMANDS
    for row in record["rows"].values():
        request = asdict(flags_plan_request(row["command"].split()))
        stored = row["request"]
        assert {k: stored[k] for k in ("context", "history", "turns", "group", "gpus", "mode", "offload")} == {
            k: request[k] for k in ("context", "history", "turns", "group", "gpus", "mode", "offload")
        }
        assert stored["engine"]["wavefront_walk"] == request["engine"].wavefront_walk
    assert "python -m bench.planner --agents" in README
