"""Type-check the package with mypy (settings in ``pyproject.toml``), over the package as installed
(``package_view``: mypy cannot follow the editable install's import hook to ``envs/``, ``tools/`` and ``trainer/``).
Reported paths are the repository's. Exit status: mypy's.
"""

from __future__ import annotations

import re
import subprocess
import sys

from package_view import REPO, fresh_view, repository_path

LOCATION = re.compile(r"^(longstraw_agents/[^:]+)(:.*)$")


def main() -> int:
    view = fresh_view()  # at a fixed place, so that mypy's cache (.mypy_cache) stays valid between runs
    command = [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"), "-p", "longstraw_agents"]
    command += ["--cache-dir", str(REPO / ".mypy_cache")]
    result = subprocess.run(command, cwd=view, capture_output=True, text=True, check=False)
    for line in (result.stdout + result.stderr).splitlines():
        match = LOCATION.match(line)
        print(repository_path(match.group(1)) + match.group(2) if match else line)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
