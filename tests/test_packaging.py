"""The wheel: built from the repository, installed non-editable into a fresh virtual environment, it has every
package of the source tree and runs the CLI — ``--help``, ``envs`` and a one-step ``train`` — away from the checkout.

The fresh environment reuses the dependencies already installed beside the test (torch among them: no second
download) through a path entry that comes after its own site-packages, so what it imports of this project comes from
the wheel alone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
from pathlib import Path

import pytest
from tiny_runs import tiny_config_dict

from longstraw_agents.app.run import STORE

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # builds a wheel and a virtual environment (~30 s)


def package_dirs() -> dict[str, str]:
    """Installed package name -> repository folder (``[tool.setuptools.package-dir]``)."""
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def source_packages() -> list[str]:
    """Every package of the checkout by its installed name (folders with an ``__init__.py`` under each mapped
    folder)."""
    names = []
    for package, folder in package_dirs().items():
        for init in sorted((REPO / folder).rglob("__init__.py")):
            relative = init.parent.relative_to(REPO / folder).parts
            names.append(".".join((package, *relative)))
    return names


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The wheel built from a copy of the sources, and what the build printed (pip's verbose log, setuptools' own
    messages included)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"  # a copy of what the build reads (setuptools writes build/ beside its sources)
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, source / name)
    for folder in set(package_dirs().values()):
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-w", str(root), "-v"],
        check=True,
        capture_output=True,
        text=True,
    )
    [wheel] = root.glob("longstraw_agents-*.whl")
    return wheel, build.stdout + build.stderr


def test_the_wheel_builds_without_warnings(built: tuple[Path, str]) -> None:
    """setuptools warns of what it will refuse (a license table, importable folders missing from ``packages``) as
    ``...Warning:`` lines; distutils' lowercase notes (byte-compiling disabled) are not warnings of the config."""
    _, log = built
    warnings = [line.strip() for line in log.splitlines() if re.search(r"\w+Warning\b", line)]
    assert not warnings, "\n".join(warnings)


@pytest.fixture(scope="module")
def installed(built: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the wheel installed (no editable hook, no checkout on the path)."""
    wheel, _ = built
    root = tmp_path_factory.mktemp("installed")
    env_dir = root / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        check=True,
        capture_output=True,
    )
    own = Path(
        subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
        .strip()
        .decode()
    )
    # a plain path entry: this environment's .pth files (the editable install's import hook) are not processed
    (own / "zz_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return env_dir


def run_installed(env_dir: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [str(env_dir / "bin" / args[0]), *args[1:]], cwd=cwd, env=environment, capture_output=True, text=True
    )


def test_the_wheel_holds_every_package_of_the_source_tree(installed: Path, tmp_path: Path) -> None:
    packages = source_packages()
    assert {"longstraw_agents.app", "longstraw_agents.parallel", "longstraw_agents.envs"} <= set(packages)
    script = (
        "import importlib, json, sys\n"
        f"names = {packages!r}\n"
        "print(json.dumps({n: importlib.import_module(n).__file__ for n in names}))\n"
    )
    result = run_installed(installed, "python", "-c", script, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    files = json.loads(result.stdout)
    for name, file in files.items():
        assert Path(file).is_relative_to(installed), f"{name} imported from {file}, not from the installed wheel"
    assert (Path(files["longstraw_agents"]).parent / "data" / "longstraw_bpe.tiktoken").is_file()


def test_the_installed_cli_lists_envs_and_trains_one_step(installed: Path, tmp_path: Path) -> None:
    result = run_installed(installed, "longstraw", "--help", cwd=tmp_path)
    assert result.returncode == 0 and "train" in result.stdout, result.stderr
    result = run_installed(installed, "longstraw", "envs", cwd=tmp_path)
    assert result.returncode == 0 and "LongStraw/Calculator-v0" in result.stdout.split(), result.stderr
    config = tmp_path / "run.yaml"  # JSON is YAML
    config.write_text(json.dumps(tiny_config_dict(tmp_path / "run", steps=1, groups_per_step=1)))
    result = run_installed(installed, "longstraw", "train", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "run" / STORE).is_file() and (tmp_path / "run" / "metrics.jsonl").is_file()
    result = run_installed(installed, "longstraw", "view", str(tmp_path / "run"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    page = (tmp_path / "run" / "view.html").read_text()  # the viewer's script and styles ship in the wheel
    assert "function renderBranch" in page and ".branch-head" in page
