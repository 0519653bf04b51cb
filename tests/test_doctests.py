"""Every ``>>>`` example in the package's docstrings runs and prints what it shows (sketches that need a model are
written as plain indented code instead). Modules are found by their text, so a new example cannot go unrun."""

from __future__ import annotations

import doctest
import importlib
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def modules_with_examples() -> list[str]:
    """Installed names of the package's modules whose source holds a ``>>>`` prompt."""
    mapping = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    names = []
    for package, folder in mapping.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            if ">>> " in path.read_text():
                parts = path.relative_to(REPO / folder).with_suffix("").parts
                names.append(".".join((package, *parts)).removesuffix(".__init__"))
    return names


@pytest.mark.parametrize("name", modules_with_examples())
def test_docstring_examples_run(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.attempted > 0, f"{name}: no example found by doctest (a '>>>' outside a docstring?)"
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed (see the output above)"
