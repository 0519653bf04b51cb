"""What a run's experiment trackers (``report_to``) should hold, worked out from its ``metrics.jsonl`` alone, and
what its TensorBoard event files hold."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

Scalars = dict[str, list[tuple[int, float]]]
"""tag -> [(step, value)], in the order logged."""


def expected_scalars(run_dir: Path, steps_of_phases: dict[str, int]) -> dict[str, list[tuple[int, Any]]]:
    """Every number of every line of ``run_dir/metrics.jsonl`` as ``phase/key`` (``phase/key/inner`` in a mapping)
    at the line's ``step``, or ``steps_of_phases[phase]`` for a line without one."""
    expected: dict[str, list[tuple[int, Any]]] = {}
    for text in (run_dir / "metrics.jsonl").read_text().splitlines():
        line = json.loads(text)
        phase = line.pop("phase")
        step = line.pop("step") if "step" in line else steps_of_phases[phase]
        for tag, value in _numbers(line, f"{phase}/"):
            expected.setdefault(tag, []).append((step, value))
    return expected


def _numbers(data: dict[str, Any], prefix: str) -> list[tuple[str, Any]]:
    found = []
    for key, value in data.items():
        if isinstance(value, dict):
            found += _numbers(value, f"{prefix}{key}/")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            found.append((f"{prefix}{key}", value))
    return found


def tensorboard_scalars(logdir: Path) -> Scalars:
    """The scalars of the event files in ``logdir`` (not its subdirectories), read with TensorBoard's reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def as_float32(scalars: dict[str, list[tuple[int, Any]]]) -> Scalars:
    """``scalars`` as TensorBoard stores them (float32)."""
    return {tag: [(step, float(np.float32(value))) for step, value in points] for tag, points in scalars.items()}
