"""The programs in examples/ run as a user would run them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
