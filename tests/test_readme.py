"""What README.md shows is what the repository has: the config it prints, the commands it names, the env id form."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from longstraw_agents.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_shows_the_example_training_config_verbatim() -> None:
    shown = README.split("```yaml\n", 1)[1].split("```\n", 1)[0]
    assert shown == (ROOT / "examples" / "train_calculator.yaml").read_text()


def test_readme_names_the_two_commands_and_every_cli_subcommand() -> None:
    assert "make demo" in README and "make test" in README
    subcommands = build_parser()._subparsers._group_actions[0].choices  # argparse keeps them here
    for name in subcommands:
        assert f"longstraw {name}" in README, name


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
    core = _modules(ROOT / "longstraw_agents") - {"app"}
    assert _layout_names("longstraw_agents/") == core
    assert _layout_names("longstraw_agents/app/") == _modules(ROOT / "longstraw_agents" / "app")


def test_every_path_the_readme_names_exists() -> None:
    named = set(
        re.findall(r"`((?:tests|examples|scripts|bench|envs|tools|trainer|longstraw_agents)/[\w/.]+\.py)`", README)
    )
    assert named and not [path for path in named if not (ROOT / path).exists()]
