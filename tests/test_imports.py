"""DESIGN.md's import rules hold (the import-linter contracts of pyproject.toml), and the check catches a breach."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
from paths import REPO

sys.path.insert(0, str(REPO / "scripts"))  # lint_imports imports its neighbour package_view
spec = importlib.util.spec_from_file_location("lint_imports", REPO / "scripts" / "lint_imports.py")
lint_imports = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lint_imports)
package_view = sys.modules["package_view"]


def test_every_import_contract_is_kept(tmp_path: Path) -> None:
    package_view.installed_view(tmp_path)
    result = lint_imports.lint(tmp_path, capture=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "source", "message"),
    [
        ("rollout.py", "import torch\n", "longstraw_agents.rollout is not allowed to import torch"),
        ("store.py", "from longstraw_agents.envs import ToolEnv\n", "longstraw_agents.store is not allowed to import"),
        ("state.py", "import longstraw_agents.trainer\n", "longstraw_agents.state is not allowed to import"),
        ("report.py", "from longstraw_agents.app import run\n", "longstraw_agents.report is not allowed to import"),
    ],
)
def test_a_forbidden_import_breaks_a_contract(tmp_path: Path, module: str, source: str, message: str) -> None:
    root = package_view.installed_view(tmp_path)
    (root / module).unlink()  # the view's link to the real module, replaced by a breach
    (root / module).write_text(source)
    result = lint_imports.lint(tmp_path, capture=True)
    assert result.returncode != 0 and message in result.stdout, result.stdout


def test_the_viewer_may_not_import_torch(tmp_path: Path) -> None:
    """The viewer's own contract: its advantages are computed in numpy, never by importing the trainer."""
    root = package_view.installed_view(tmp_path)
    (root / "viewer").unlink()  # the view's link to the real package, replaced by a copy with a breach
    shutil.copytree(REPO / "longstraw_agents" / "viewer", root / "viewer", ignore=shutil.ignore_patterns("__pycache__"))
    page = root / "viewer" / "page.py"
    page.write_text(page.read_text() + "\nfrom longstraw_agents.trainer.loss import group_advantages\n")
    result = lint_imports.lint(tmp_path, capture=True)
    assert result.returncode != 0, result.stdout
    assert "longstraw_agents.viewer is not allowed to import torch:" in result.stdout
    assert "longstraw_agents.viewer.page -> longstraw_agents.trainer.loss" in result.stdout
