"""Headless Chromium for the browser tests: Debian's ``chromium`` package driven by Playwright (the ``playwright``
Python package of the dev extra, pointed at that executable: no browser is downloaded).

Without Chromium the tests are skipped with the command that installs it; where ``LONGSTRAW_REQUIRE_BROWSER=1`` (CI,
``.ci/run``) a missing browser fails them instead, so a skip cannot pass for a run.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any, NoReturn

import pytest

INSTALL = "sudo apt-get install -y chromium"
REQUIRE = "LONGSTRAW_REQUIRE_BROWSER"
# Flags known to work as root in a container with no network: no sandbox (root), no GPU, and none of Chromium's
# background connections (refused here, many at a time, and slow to fail); Playwright adds --headless and a fresh
# --user-data-dir of its own.
LAUNCH_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def require_or_skip(what: str) -> NoReturn:
    """Skip for want of ``what``, or fail where the browser tests must run."""
    if os.environ.get(REQUIRE) == "1":
        pytest.fail(f"{REQUIRE}=1 but {what}")
    pytest.skip(what)


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    """A headless Chromium (Playwright's ``Browser``), closed after the module's tests."""
    executable = shutil.which("chromium")
    if executable is None:
        require_or_skip(f"Chromium is not installed; install it with: {INSTALL}")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        require_or_skip("the playwright package is not installed; install the dev extra: pip install -e '.[dev]'")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=LAUNCH_ARGS)
        try:
            yield browser
        finally:
            browser.close()
