"""Package discovery for the repository's layout.

``envs/``, ``tools/`` and ``trainer/`` sit at the top of the repository (one folder per concern, as in the design) but
install as ``longstraw_agents.envs``, ``longstraw_agents.tools`` and ``longstraw_agents.trainer``:
``[tool.setuptools.package-dir]`` in pyproject.toml maps them. setuptools' own discovery cannot follow such a mapping,
so this finds every package under each mapped folder: a new subpackage reaches the wheel without being listed. Folders
without an ``__init__.py`` (``data/``, ``viewer/static/``: package data) count as namespace packages, as Python imports
them, so that setuptools finds every importable folder listed.
"""

import tomllib
from pathlib import Path

from setuptools import find_namespace_packages, setup

ROOT = Path(__file__).parent
PACKAGE_DIR: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def packages_under(package: str, directory: str) -> list[str]:
    """``package`` and every package below its folder (data folders too), by their installed names."""
    return [package] + [f"{package}.{sub}" for sub in find_namespace_packages(str(ROOT / directory))]


setup(packages=sorted({name for package, folder in PACKAGE_DIR.items() for name in packages_under(package, folder)}))
