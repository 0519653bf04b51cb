"""Check DESIGN.md's import rules: ``lint-imports`` with the contracts of ``pyproject.toml``, run over the package
as installed (``package_view``: import-linter finds modules by walking the package's directory, and ``envs/``,
``tools/`` and ``trainer/`` live outside ``longstraw_agents/`` in the repository). Exit status: lint-imports's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from package_view import REPO, fresh_view


def lint(view: Path, capture: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``lint-imports`` over the package laid out under ``view`` (see ``installed_view``)."""
    path = os.pathsep.join([str(view), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    command = [str(Path(sys.executable).with_name("lint-imports")), "--no-cache", str(REPO / "pyproject.toml")]
    return subprocess.run(
        command, cwd=view, env={**os.environ, "PYTHONPATH": path}, capture_output=capture, text=True, check=False
    )


def main() -> int:
    return lint(fresh_view()).returncode


if __name__ == "__main__":
    sys.exit(main())
