"""``longstraw plot RUN_DIR``: reward, loss, episode length and memory curves from a run's ``metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CURVES = {
    "reward.png": ("reward_mean", "mean reward"),
    "loss.png": ("loss", "GRPO loss"),
    "length.png": ("episode_tokens_mean", "episode tokens (mean)"),
    "memory.png": ("peak_bytes", "peak tracked bytes"),
}


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist (is {run_dir} a longstraw run directory?)")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not JSON ({err})") from None
    return records


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write one PNG per curve that has data; returns the written paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in read_metrics(run_dir) if r.get("phase", "grpo") == "grpo"]
    out = Path(out_dir or run_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for filename, (key, label) in CURVES.items():
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if not points:
            continue
        steps, values = zip(*points, strict=True)
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(steps, values, marker="o", markersize=3)
        if key == "reward_mean" and all(r.get("reward_std") is not None for r in records):
            lows = [r["reward_mean"] - r["reward_std"] for r in records]
            highs = [r["reward_mean"] + r["reward_std"] for r in records]
            ax.fill_between([r["step"] for r in records], lows, highs, alpha=0.2)
        ax.set(xlabel="step", ylabel=label, title=f"{Path(run_dir).name}: {label}")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / filename
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
