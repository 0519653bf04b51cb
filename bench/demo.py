"""``make demo`` measured as README quotes it: the command itself, once per thread count, with the CPU time of
``make`` and everything it starts (user + system, as ``/usr/bin/time`` reports it), its wall-clock time and the
machine's load average around it, and the run's figures from ``runs/demo/metrics.jsonl`` (the warm start's loss,
the held-out reward before and after GRPO). Updates ``bench/results/demo.json`` (the runs of other thread counts
stay) and copies the 1-thread run's ``reward.png`` to ``bench/results/demo_reward.png`` (README shows it).

    python -m bench.demo [--threads 1 2] [--out bench/results/demo.json]

Each run replaces the one before it in ``runs/demo``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from longstraw_agents.app.plotting import EVAL, STEP, read_metrics

DEMO_DIR = Path("runs/demo")
RESULTS = Path("bench/results")
TARGET_RISE = 0.25
"""The demo's promise: held-out reward up by at least this much..."""
TARGET_CPU_MINUTES = 20.0
"""...within this many CPU-minutes of ``make demo`` (user + system, its children included)."""


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


WARM_START_FIGURES = ("stage", "steps", "loss_first", "loss_last", "seconds")


def run_figures(run_dir: Path) -> dict[str, Any]:
    """The warm start and the two held-out evaluations of a demo run, from its metrics records."""
    records = read_metrics(run_dir)
    warm_starts = [r for r in records if r.get("phase") == "warm_start"]
    evals = [r for r in records if r.get("phase") == EVAL]
    if not warm_starts or len(evals) != 2:
        raise ValueError(
            f"{run_dir}: not a finished demo run (a warm start and an evaluation before and after GRPO); found "
            f"{len(warm_starts)} warm start and {len(evals)} evaluation lines"
        )
    stages = [{k: w.get(k, "episodes") if k == "stage" else w[k] for k in WARM_START_FIGURES} for w in warm_starts]
    # a start stopped in its warm start (no checkpoint) and started again appended its stages anew: the last ones
    stages = stages[max(i for i, w in enumerate(stages) if w["stage"] == stages[0]["stage"]) :]
    before, after = (e["reward_mean"] for e in evals)
    return {  # the episodes' stage (the last) and the time of them all; each stage (drills first) apart
        "warm_start": {**stages[-1], "seconds": sum(w["seconds"] for w in stages), "stages": stages},
        "grpo_steps": sum(1 for r in records if r.get("phase") == STEP),
        "eval_episodes": evals[0]["episodes"],
        "reward_before": before,
        "reward_after": after,
        "rise": after - before,
    }


def measure(threads: int) -> dict[str, Any]:
    """Run ``make demo THREADS=threads`` (its output shown as it goes) and return what it took and reached."""
    command = ["make", "demo", f"THREADS={threads}"]
    load_before, cpu_before, started = os.getloadavg(), children_cpu_seconds(), time.perf_counter()
    subprocess.run(command, check=True)
    wall, cpu = time.perf_counter() - started, children_cpu_seconds() - cpu_before
    figures = run_figures(DEMO_DIR)
    return {
        "command": " ".join(command),
        "date": datetime.now(UTC).date().isoformat(),
        "cpu_minutes": cpu / 60,
        "wall_minutes": wall / 60,
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
        **figures,
        "meets_target": figures["rise"] >= TARGET_RISE and cpu / 60 <= TARGET_CPU_MINUTES,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=Path, default=RESULTS / "demo.json")
    args = parser.parse_args()
    runs: dict[str, Any] = json.loads(args.out.read_text())["runs"] if args.out.exists() else {}
    for threads in args.threads:
        runs[str(threads)] = result = measure(threads)
        if threads == 1:
            shutil.copyfile(DEMO_DIR / "reward.png", args.out.parent / "demo_reward.png")
        print(
            f"\nTHREADS={threads}: held-out {result['reward_before']:.3f} -> {result['reward_after']:.3f} "
            f"({result['rise']:+.3f}) in {result['cpu_minutes']:.1f} CPU-minutes ({result['wall_minutes']:.1f} min)"
        )
    import torch

    machine = {
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
    }
    target = {"rise": TARGET_RISE, "cpu_minutes": TARGET_CPU_MINUTES}
    args.out.write_text(json.dumps({"machine": machine, "target": target, "runs": runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
