"""``plot_run``: one PNG per curve with data, drawn from the GRPO lines of a hand-written ``metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.figure
import numpy as np
import pytest
from matplotlib.image import imread

from longstraw_agents.app.plotting import EVAL, STEP, byte_unit, plot_run, read_metrics
from longstraw_agents.app.records import EvalRecord, StepRecord

RECORDS = [
    {"phase": "warm_start", "episodes": 16, "steps": 100, "loss_first": 3.2, "loss_last": 0.4},
    {"phase": "eval", "step": 0, "reward_mean": 0.9, "episodes": 8},
    {"phase": "grpo", "step": 1, "reward_mean": 0.25, "reward_std": 0.1, "loss": 0.02, "episode_tokens_mean": 380.0,
     "peak_bytes": 4096},
    {"phase": "grpo", "step": 2, "reward_mean": 0.5, "reward_std": 0.2, "loss": -0.01, "episode_tokens_mean": 372.5,
     "peak_bytes": None},
    {"phase": "replay_select", "episodes": 16, "groups": 4},
    {"phase": "grpo", "step": 3, "reward_mean": 0.75, "reward_std": 0.0, "loss": 0.0, "episode_tokens_mean": 360.0,
     "peak_bytes": 6144},
]  # fmt: skip


def write_metrics(run_dir: Path, records: list[dict]) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


class Drawn(dict[str, np.ndarray]):
    """The (step, value) points of the first line of every figure saved, by file name; ``ylabels`` their y axes'."""

    def __init__(self) -> None:
        super().__init__()
        self.ylabels: dict[str, str] = {}


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> Drawn:
    points = Drawn()
    savefig = matplotlib.figure.Figure.savefig

    def recording_savefig(fig, path, *args, **kwargs):
        points[Path(path).name] = fig.axes[0].lines[0].get_xydata()
        points.ylabels[Path(path).name] = fig.axes[0].get_ylabel()
        return savefig(fig, path, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", recording_savefig)
    return points


def test_plot_run_writes_one_png_per_curve_from_the_grpo_lines(tmp_path: Path, drawn) -> None:
    run_dir = write_metrics(tmp_path / "run", RECORDS)
    written = plot_run(run_dir)
    assert [p.name for p in written] == ["reward.png", "loss.png", "length.png", "memory.png"]
    for path in written:
        assert path.parent == run_dir
        image = imread(path)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    np.testing.assert_array_equal(drawn["reward.png"], [[1, 0.25], [2, 0.5], [3, 0.75]])  # no eval point
    np.testing.assert_array_equal(drawn["loss.png"], [[1, 0.02], [2, -0.01], [3, 0.0]])
    np.testing.assert_array_equal(drawn["length.png"], [[1, 380.0], [2, 372.5], [3, 360.0]])
    # memory in KiB (4096 and 6144 bytes); steps without a value are left out
    np.testing.assert_array_equal(drawn["memory.png"], [[1, 4], [3, 6]])
    assert drawn.ylabels["memory.png"] == "peak tracked memory (KiB)"


def test_memory_is_drawn_in_the_binary_unit_its_largest_value_reaches() -> None:
    assert byte_unit([512.0, 1000.0]) == ("bytes", 1)
    assert byte_unit([1024.0]) == ("KiB", 1024)
    assert byte_unit([3 * 2**20, 2**30 - 1]) == ("MiB", 2**20)
    assert byte_unit([5 * 2**30, 2**20]) == ("GiB", 2**30)


def test_the_phases_plotted_are_the_records_phases() -> None:
    """plotting names them itself (reading metrics must not import torch, which the records do)."""
    assert (STEP, EVAL) == (StepRecord.PHASE, EvalRecord.PHASE)


def test_curves_without_data_are_not_written(tmp_path: Path) -> None:
    records = [{**r, "peak_bytes": None} for r in RECORDS]
    run_dir = write_metrics(tmp_path / "run", records)
    written = plot_run(run_dir, tmp_path / "plots")
    assert [p.name for p in written] == ["reward.png", "loss.png", "length.png"]
    assert all(p.parent == tmp_path / "plots" for p in written) and not (run_dir / "reward.png").exists()
    only_warm_start = write_metrics(tmp_path / "warm", RECORDS[:1])
    assert plot_run(only_warm_start) == []


def test_memory_falls_back_to_the_process_memory_every_run_logs(tmp_path: Path, drawn) -> None:
    """Without trainer.track_memory, peak_bytes is null: memory.png shows rss_peak_bytes (logged every step) instead;
    a tracked peak, when there is one, is preferred."""
    records = [{**r, "peak_bytes": None, "rss_peak_bytes": 1000 * r["step"]} for r in RECORDS if "reward_std" in r]
    written = plot_run(write_metrics(tmp_path / "rss", records))
    assert [p.name for p in written] == ["reward.png", "loss.png", "length.png", "memory.png"]
    np.testing.assert_array_equal(drawn["memory.png"], [[1, 1000 / 1024], [2, 2000 / 1024], [3, 3000 / 1024]])
    assert drawn.ylabels["memory.png"] == "peak process RSS (KiB)"
    both = [{**r, "rss_peak_bytes": 1} for r in RECORDS]
    plot_run(write_metrics(tmp_path / "both", both))
    np.testing.assert_array_equal(drawn["memory.png"], [[1, 4], [3, 6]])
    gib = [{**r, "peak_bytes": None, "rss_peak_bytes": r["step"] * 2**30} for r in RECORDS if "reward_std" in r]
    plot_run(write_metrics(tmp_path / "gib", gib))
    np.testing.assert_array_equal(drawn["memory.png"], [[1, 1], [2, 2], [3, 3]])
    assert drawn.ylabels["memory.png"] == "peak process RSS (GiB)"


def test_malformed_metrics_lines_are_errors_or_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run_dir = write_metrics(tmp_path / "array", [*RECORDS[:2]])
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write("[1, 2, 3]\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl:3: not a JSON object"):
        plot_run(run_dir)
    no_step = {k: v for k, v in RECORDS[2].items() if k != "step"}
    run_dir = write_metrics(tmp_path / "no-step", [no_step, RECORDS[3], {"phase": "eval", "reward_mean": 1.0}])
    with caplog.at_level("WARNING", logger="longstraw_agents.app.plotting"):
        written = plot_run(run_dir)
    assert [p.name for p in written] == ["reward.png", "loss.png", "length.png"]  # from the line with a step
    assert "metrics.jsonl:1: skipped (a 'grpo' line without a step)" in caplog.text
    assert "metrics.jsonl:3: skipped (a 'eval' line without a step)" in caplog.text


def test_missing_or_malformed_metrics_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"metrics\.jsonl does not exist"):
        plot_run(tmp_path / "nowhere")
    run_dir = write_metrics(tmp_path / "run", RECORDS[:2])
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"phase": "grpo", "step": 3,\n')  # a line cut short
    with pytest.raises(ValueError, match=r"metrics\.jsonl:3: not JSON"):
        read_metrics(run_dir)
