"""The package as installed, laid out from links into the repository, for tools that find modules by walking
directories (import-linter, mypy).

``envs/``, ``tools/`` and ``trainer/`` sit at the top of the repository and are installed as
``longstraw_agents.envs`` / ``.tools`` / ``.trainer`` (``[tool.setuptools.package-dir]``); a tool that walks
``longstraw_agents/`` alone would never see them. ``installed_view(target)`` builds ``target/longstraw_agents`` with
one symbolic link per entry of ``longstraw_agents/`` plus one per mapped subpackage.
"""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VIEW = REPO / ".package_view"  # git-ignored


def package_dirs() -> dict[str, str]:
    """Subpackage → repository directory, from ``[tool.setuptools.package-dir]`` (the root package excluded)."""
    mapping = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {package: directory for package, directory in mapping.items() if package != "longstraw_agents"}


def installed_view(target: Path) -> Path:
    """``target/longstraw_agents``: the package as installed, built from links into the repository."""
    root = target / "longstraw_agents"
    root.mkdir()
    for entry in (REPO / "longstraw_agents").iterdir():
        if entry.name != "__pycache__":
            (root / entry.name).symlink_to(entry)
    for package, directory in package_dirs().items():
        (root / package.rsplit(".", 1)[1]).symlink_to(REPO / directory)
    return root


def repository_path(view_path: str) -> str:
    """A path inside the view as the repository's own path (``longstraw_agents/envs/base.py`` → ``envs/base.py``)."""
    for package, directory in package_dirs().items():
        prefix = package.replace(".", "/") + "/"
        if view_path.startswith(prefix):
            return directory + "/" + view_path[len(prefix) :]
    return view_path


def fresh_view() -> Path:
    """``installed_view`` rebuilt at ``VIEW`` (new entries of ``longstraw_agents/`` appear in it); returns ``VIEW``."""
    shutil.rmtree(VIEW, ignore_errors=True)
    VIEW.mkdir()
    installed_view(VIEW)
    return VIEW


if __name__ == "__main__":
    print(fresh_view())
