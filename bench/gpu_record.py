"""``bench/gpu.py``'s record, written row by row (a run stopped by a timeout loses nothing it measured), and its time
budget (rows not started before it runs out are skipped, and listed as such)."""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


class Record:
    """The run's JSON record at ``path``: its header (device, date, versions, settings, the GPU tests' verdicts...),
    each family's set-up, the measured rows and the skipped ones; the file is rewritten whole (through a temporary
    file and a rename, so a reader never sees half of it) at every change. ``finished`` stays None until the run
    ends."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {
            **header,
            "started": now(),
            "finished": None,
            "setup": {},
            "rows": [],
            "skipped": [],
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        self.write()

    def add_row(self, row: dict[str, Any]) -> None:
        self.data["rows"].append(row)
        self.write()

    def add_setup(self, family: str, setup: dict[str, Any]) -> None:
        self.data["setup"][family] = setup
        self.write()

    def skip(self, family: str, positions: int, phase: str, reason: str) -> None:
        self.data["skipped"].append({"family": family, "positions": positions, "phase": phase, "reason": reason})
        self.write()

    def finish(self) -> dict[str, Any]:
        self.data["finished"] = now()
        self.write()
        return self.data

    def write(self) -> None:
        partial = self.path.with_name(f".{self.path.name}.partial")
        partial.write_text(json.dumps(self.data, indent=1))
        os.replace(partial, self.path)


class BudgetSpent(Exception):
    """The run's time budget ran out before a phase started."""


class Deadline:
    """A time after which no phase starts: ``end`` in seconds since the epoch (None: no limit), so that a script
    can set it before Python's own start-up."""

    def __init__(self, end: float | None) -> None:
        self.end = end

    @classmethod
    def after(cls, seconds: float | None) -> Deadline:
        return cls(None if seconds is None else time.time() + seconds)

    @property
    def passed(self) -> bool:
        return self.left() <= 0

    def left(self) -> float:
        return float("inf") if self.end is None else self.end - time.time()

    def check(self, reserve: float = 0.0) -> None:
        """Raise ``BudgetSpent`` unless more than ``reserve`` seconds are left."""
        if self.left() <= reserve:
            raise BudgetSpent
