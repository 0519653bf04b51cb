"""A test helper: run a block with little Python stack, so that a recursive walk of a deep tree would fail."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def shallow_stack(frames: int) -> Iterator[None]:
    """Allow only ``frames`` more Python frames than the caller has: a recursive walk of a deeper tree fails."""
    depth, frame = 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(depth + frames)
    try:
        yield
    finally:
        sys.setrecursionlimit(limit)
