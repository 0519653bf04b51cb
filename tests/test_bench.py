"""The benchmarks run end to end at toy sizes (their figures are measured by `make bench`, not asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def run_module(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_engine_bench_prints_ratios_and_saves_per_turn_times(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    args = ["--context", "48", "--turn", "4", "--turns", "4", "--repeats", "1", "--chunk", "16", "--out", str(out)]
    stdout = run_module("bench.engine", "--families", "llama", "qwen3_5", "glm_moe_dsa", *args)
    assert "speedup" in stdout and "append ms by turn index" in stdout
    results = json.loads(out.read_text())["results"]
    for family in ("llama", "qwen3_5", "glm_moe_dsa"):
        assert len(results[family]["append_ms"]) == 4
        assert abs(results[family]["bytes_ratio"] - 1.0) < 1e-9  # measured state bytes/token == analytic


def test_ablation_prints_cosines() -> None:
    stdout = run_module("bench.ablation", "--lengths", "8", "--groups", "1")
    row = stdout.strip().splitlines()[-1].split()
    assert row[0] == "8" and -1.0 <= float(row[1]) <= 1.0
