"""DESIGN.md's import rules hold (the import-linter contracts of pyproject.toml), and the check catches a breach."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import shutil
import subprocess
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
        (
            "store/queries.py",
            "from longstraw_agents.envs import ToolEnv\n",
            "longstraw_agents.store is not allowed to import",
        ),
        ("plan/shape.py", "import torch\n", "longstraw_agents.plan.shape is not allowed to import torch"),
        ("state.py", "import longstraw_agents.trainer\n", "longstraw_agents.state is not allowed to import"),
        ("report.py", "from longstraw_agents.app import run\n", "longstraw_agents.report is not allowed to import"),
    ],
)
def test_a_forbidden_import_breaks_a_contract(tmp_path: Path, module: str, source: str, message: str) -> None:
    root = package_view.installed_view(tmp_path)
    package, _, _ = module.rpartition("/")
    if package:  # the view's link to the real package, replaced by a copy
        (root / package).unlink()
        shutil.copytree(
            REPO / "longstraw_agents" / package, root / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    (root / module).unlink()  # the view's link to the real module (or the copy), replaced by a breach
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


def test_the_plan_package_imports_torch_only_for_the_names_that_need_it() -> None:
    """``longstraw_agents.plan`` imports no torch until a name that needs it is used (``longstraw plan`` checks its
    flags first); each such name is its module's own object, and the names type checkers see (the ``TYPE_CHECKING``
    imports) are the ones imported at run time."""
    code = "import sys, longstraw_agents.plan; sys.exit(sorted({'torch', 'transformers'} & set(sys.modules)) or 0)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    import longstraw_agents.plan as plan

    source = ast.parse((REPO / "longstraw_agents" / "plan" / "__init__.py").read_text())
    [checked] = [node for node in source.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"]
    typed = {node.module.rsplit(".", 1)[1]: {alias.name for alias in node.names} for node in checked.body}
    assert typed == {module: set(names) for module, names in plan._HOMES.items()}
    assert set(plan.__all__) == {"MODEL_NAMES", "PlanShape", "model_problem", *plan._MODULE_OF}
    for name, module in plan._MODULE_OF.items():
        assert getattr(plan, name) is getattr(importlib.import_module(f"longstraw_agents.plan.{module}"), name)
