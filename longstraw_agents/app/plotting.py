"""``longstraw plot RUN_DIR``: reward, loss, episode length and memory curves from a run's ``metrics.jsonl``.

The reader is lenient on purpose: it plots whatever step and eval lines carry the metric of a curve (lines written by
older versions, or by hand, may lack fields the current records have), and skips lines without a step.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# The phases of the lines plotted (``StepRecord.PHASE``, ``EvalRecord.PHASE``), named here so that reading a run's
# metrics imports neither the records nor, through them, torch. Lines without a phase are steps (the first versions
# wrote none).
STEP, EVAL = "grpo", "eval"

# File → (metric, label) candidates; the first metric with data is drawn. Memory: the tracked tensor peak needs
# trainer.track_memory; every run logs the process's peak RSS (and the CUDA peak on a GPU).
CURVES: dict[str, tuple[tuple[str, str], ...]] = {
    "reward.png": (("reward_mean", "mean reward"),),
    "loss.png": (("loss", "GRPO loss"),),
    "length.png": (("episode_tokens_mean", "episode tokens (mean)"),),
    "memory.png": (
        ("peak_bytes", "peak tracked memory"),
        ("cuda_peak_bytes", "peak CUDA memory allocated"),
        ("rss_peak_bytes", "peak process RSS"),
    ),
}
BYTE_METRICS = frozenset(key for key, _ in CURVES["memory.png"])  # drawn in KiB, MiB or GiB, not in bytes
BINARY_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist (is {run_dir} a longstraw run directory?)")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not JSON ({err})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: not a JSON object (a metrics line is {{...}}): {line[:80]}")
        if record.get("phase", STEP) in (STEP, EVAL) and not _is_number(record.get("step")):
            log.warning("%s:%d: skipped (a %r line without a step)", path, number, record.get("phase", STEP))
            continue
        records.append(record)
    return records


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _points(records: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    """(step, value) of the records with a numeric ``key``."""
    return [(r["step"], r[key]) for r in records if _is_number(r.get(key))]


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value and the ``window - 1`` before it (fewer at the start)."""
    sums = [0.0]
    for v in values:
        sums.append(sums[-1] + v)
    return [(sums[i + 1] - sums[max(0, i + 1 - window)]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(values))]


def _first_curve(
    records: list[dict[str, Any]], candidates: tuple[tuple[str, str], ...]
) -> tuple[str, str, list[tuple[float, float]]] | None:
    """(metric, label, points) of the first candidate metric with data, or None."""
    for key, label in candidates:
        points = _points(records, key)
        if points:
            return key, label, points
    return None


def byte_unit(values: list[float]) -> tuple[str, int]:
    """The unit memory figures read best in: the largest of GiB, MiB and KiB that the largest value reaches (bytes
    below one KiB), with its size in bytes."""
    largest = max((abs(v) for v in values), default=0.0)
    return next(((name, size) for name, size in BINARY_UNITS if largest >= size), ("bytes", 1))


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write one PNG per curve that has data; returns the written paths. A run directory without metrics fails
    before matplotlib is imported."""
    all_records = read_metrics(run_dir)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in all_records if r.get("phase", STEP) == STEP]
    evals = [r for r in all_records if r.get("phase") == EVAL]
    out = Path(out_dir or run_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for filename, candidates in CURVES.items():
        curve = _first_curve(records, candidates)
        if curve is None:
            continue
        key, label, points = curve
        steps, values = zip(*points, strict=True)
        if key in BYTE_METRICS:
            unit, size = byte_unit(list(values))
            values, label = tuple(v / size for v in values), f"{label} ({unit})"
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(steps, values, marker="o", markersize=3, alpha=0.5, label="per step")
        window = min(10, len(values))
        if window > 1:
            ax.plot(steps, trailing_mean(list(values), window), linewidth=2, label=f"mean of last {window}")
        eval_points = _points(evals, "reward_mean") if key == "reward_mean" else []
        if eval_points:
            eval_steps, eval_rewards = zip(*eval_points, strict=True)
            ax.plot(eval_steps, eval_rewards, "s", markersize=8, color="black", label="held-out eval")
        ax.legend(fontsize=8)
        ax.set(xlabel="step", ylabel=label, title=f"{Path(run_dir).name}: {label}")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / filename
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
