"""DESIGN.md's import rules hold (the import-linter contracts of pyproject.toml), and the check catches a breach;
inside the engine no module imports back into itself through others, type hints and function-level imports
included."""

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


ENGINE = "longstraw_agents.engine"


def engine_imports(package_dir: Path) -> dict[str, set[str]]:
    """Each module of the engine package in ``package_dir`` (``__init__`` included) → the modules of the package it
    imports anywhere in its source: at the top, under ``TYPE_CHECKING``, inside functions."""
    modules = {path.stem for path in package_dir.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name in modules:
        targets: set[str] = set()
        for node in ast.walk(ast.parse((package_dir / f"{name}.py").read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                parent = ENGINE.rsplit(".", node.level - 1)[0] if node.level else ""  # (every module sits in ENGINE)
                base = ".".join(part for part in (parent, node.module) if part)
                targets.add(base)
                targets.update(f"{base}.{alias.name}" for alias in node.names)  # ``from . import kit``
        found = {_engine_module(target, modules) for target in targets}
        graph[name] = {module for module in found if module is not None and module != name}
    return graph


def _engine_module(target: str, modules: set[str]) -> str | None:
    """The engine module ``target`` names (the package itself: ``__init__``), or None outside the engine."""
    if target == ENGINE:
        return "__init__"
    prefix = f"{ENGINE}."
    if not target.startswith(prefix):
        return None
    name = target[len(prefix) :].split(".")[0]
    return name if name in modules else "__init__"  # (a name the package exports, not a module of its own)


def import_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports in ``graph`` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, str] = {}  # "open" while on the path walked, "done" once every import below it was walked
    path: list[str] = []

    def walk(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return [*path[path.index(target) :], target]
            if target not in state and (circle := walk(target)) is not None:
                return circle
        state[module] = "done"
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (circle := walk(module)) is not None:
            return circle
    return None


def test_the_engine_has_no_import_circle_not_even_for_type_hints() -> None:
    graph = engine_imports(REPO / "longstraw_agents" / "engine")
    assert {"engine", "kit", "tags", "decoding", "wavefront", "sharded_capture", "reverse_walk"} <= set(graph)
    assert import_circle(graph) is None, " -> ".join(import_circle(graph) or [])
    schedules = {"chunked_extend", "reverse_walk", "sharded_capture", "wavefront", "decoding", "engine"}
    assert not graph["kit"] & schedules, "the execution kit imports a schedule"


@pytest.mark.parametrize(
    "breach",
    [
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .wavefront import WavefrontWalk\n",
        "def _late() -> None:\n    from longstraw_agents.engine import wavefront\n",
        "from longstraw_agents.engine import Engine\n",
    ],
    ids=["type-hint", "in-a-function", "through-the-package"],
)
def test_an_import_circle_inside_the_engine_is_found(tmp_path: Path, breach: str) -> None:
    """The walk sees a circle however the import back is written: the kit importing what imports it."""
    engine = tmp_path / "engine"
    shutil.copytree(REPO / "longstraw_agents" / "engine", engine, ignore=shutil.ignore_patterns("__pycache__"))
    (engine / "kit.py").write_text((engine / "kit.py").read_text() + "\n" + breach)
    circle = import_circle(engine_imports(engine))
    assert circle is not None and "kit" in circle and circle[0] == circle[-1], circle


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
