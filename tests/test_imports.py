"""DESIGN.md's import rules hold (the import-linter contracts of pyproject.toml), and the check catches a breach; no
module of the package (nor of ``bench/``) imports back into itself through others, type hints and function-level
imports included, and that check catches a circle too."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import shutil
import subprocess
import sys
from collections.abc import Collection, Iterator, Mapping
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


PACKAGE_ROOTS = {"longstraw_agents": REPO / "longstraw_agents"} | {
    package: REPO / directory for package, directory in package_view.package_dirs().items()
}  # (envs/, tools/ and trainer/ live at the top of the repository)
BENCH_ROOTS = {"bench": REPO / "bench"}


def module_files(roots: Mapping[str, Path]) -> dict[str, Path]:
    """Each module under ``roots`` (a package → its folder) → its file; a package is its ``__init__``."""
    files: dict[str, Path] = {}
    for package, folder in roots.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            files[".".join((package, *parts[: -1 if parts[-1] == "__init__" else None]))] = path
    return files


def imported_modules(source: str, module: str, is_package: bool, modules: Collection[str]) -> set[str]:
    """The ``modules`` that ``source`` (the module ``module``; ``is_package``: its ``__init__``) imports anywhere: at
    the top, under ``TYPE_CHECKING``, inside functions. ``from package import name`` imports the module
    ``package.name`` where there is one (``package`` itself is then only the folder it sits in: the package's
    ``__init__`` has begun already, as Python imports every parent package first, and no name of it is read), else
    reads ``name`` from the module ``package``."""
    here = module if is_package else module.rpartition(".")[0]  # what a relative import starts from
    targets: set[str] = set()
    for node in _import_statements(ast.parse(source).body):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        else:
            parent = here.rsplit(".", node.level - 1)[0] if node.level else ""
            base = ".".join(part for part in (parent, node.module) if part)
            targets.update(
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            )
    found = {_innermost_module(target, modules) for target in targets}
    return {target for target in found if target is not None and target != module}


def _import_statements(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements of ``body`` and of every block inside it (functions, classes, ``if TYPE_CHECKING``,
    ``try``...): only statements are walked, not expressions, which hold no import statement."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        for block in ("body", "orelse", "finalbody", "handlers", "cases"):  # (an except handler's, a case's body too)
            yield from _import_statements(getattr(node, block, []))


def _innermost_module(target: str, modules: Collection[str]) -> str | None:
    """The module of ``modules`` that the dotted name ``target`` is or lies in, or None outside them."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def import_graph(roots: Mapping[str, Path]) -> dict[str, set[str]]:
    """Each module under ``roots`` → the modules under ``roots`` it imports anywhere (``imported_modules``)."""
    files = module_files(roots)
    return {
        module: imported_modules(path.read_text(), module, path.name == "__init__.py", files)
        for module, path in files.items()
    }


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


@pytest.fixture(scope="module")
def package_graph() -> dict[str, set[str]]:
    return import_graph(PACKAGE_ROOTS)


@pytest.fixture(scope="module")
def bench_graph() -> dict[str, set[str]]:
    return import_graph(BENCH_ROOTS)


def test_the_package_has_no_import_circle_not_even_for_type_hints(package_graph: dict[str, set[str]]) -> None:
    graph = package_graph
    engine = "longstraw_agents.engine"
    assert {f"{engine}.{name}" for name in ("kit", "tags", "decoding", "wavefront", "reverse_walk")} <= set(graph)
    assert {"longstraw_agents.envs", "longstraw_agents.tools", "longstraw_agents.trainer.modes"} <= set(graph)
    assert "longstraw_agents.kernels.delta_scan" in graph["longstraw_agents.models.delta_rule"]  # inside a function
    assert "longstraw_agents.plan.timing" in graph["longstraw_agents.plan"]  # under TYPE_CHECKING
    assert import_circle(graph) is None, " -> ".join(import_circle(graph) or [])
    schedules = {"chunked_extend", "reverse_walk", "sharded_capture", "wavefront", "decoding", "engine"}
    assert not graph[f"{engine}.kit"] & {f"{engine}.{name}" for name in schedules}, (
        "the execution kit imports a schedule"
    )


def test_the_benchmarks_have_no_import_circle(bench_graph: dict[str, set[str]]) -> None:
    assert {"bench.gpu", "bench.ceilings", "bench.timing", "bench.workloads"} <= set(bench_graph)
    assert import_circle(bench_graph) is None, " -> ".join(import_circle(bench_graph) or [])


@pytest.mark.parametrize(
    ("graph_name", "module", "breach"),
    [
        (
            "package_graph",
            "longstraw_agents.engine.kit",
            "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .wavefront import WavefrontWalk\n",
        ),
        (
            "package_graph",
            "longstraw_agents.engine.kit",
            "def _late() -> None:\n    from longstraw_agents.engine import wavefront\n",
        ),
        ("package_graph", "longstraw_agents.engine.kit", "from longstraw_agents.engine import Engine\n"),
        (
            "package_graph",
            "longstraw_agents.serving.jobs",
            "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
            "    from longstraw_agents.serving.server import CompletionServer\n",
        ),
        (
            "package_graph",
            "longstraw_agents.kernels.delta_scan",
            "from longstraw_agents.models.delta_rule import DELTA_CHUNK\n",
        ),
        ("package_graph", "longstraw_agents.trainer.group", "from longstraw_agents.trainer import grpo_backward\n"),
        ("bench_graph", "bench.workloads", "def _late() -> None:\n    from bench.gpu import Timing\n"),
    ],
    ids=["type-hint", "in-a-function", "through-the-package", "serving", "kernels", "trainer", "bench"],
)
def test_an_import_circle_is_found(request: pytest.FixtureRequest, graph_name: str, module: str, breach: str) -> None:
    """The walk sees a circle however the import back is written: a module importing, at the top, under
    ``TYPE_CHECKING`` or in a function, what imports it (the circles this package had, among them)."""
    graph = dict(request.getfixturevalue(graph_name))
    path = module_files(BENCH_ROOTS if graph_name == "bench_graph" else PACKAGE_ROOTS)[module]
    assert import_circle(graph) is None
    graph[module] = imported_modules(path.read_text() + "\n" + breach, module, False, graph)
    circle = import_circle(graph)
    assert circle is not None and module in circle and circle[0] == circle[-1], circle


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
