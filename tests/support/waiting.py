"""Waiting in tests for what another thread does: a condition polled until it holds, under a generous deadline (a
test never depends on how fast this machine is; it fails only when the condition never comes)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

WAIT_S = 60.0


def wait_until(condition: Callable[[], bool], timeout: float = WAIT_S) -> None:
    """Return once ``condition()`` holds; fail the test if it has not within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"still not so after {timeout:g} s"
        time.sleep(0.005)


def started(target: Callable[[], object]) -> threading.Thread:
    """``target`` running in a daemon thread."""
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread
