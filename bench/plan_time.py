"""How long ``longstraw plan`` takes for each configuration README plans, with the planner's meta-op cache
(``longstraw_agents.plan.meta_cache``) and without it, and that both print the same plan.

Each plan runs in a fresh process (imports included, as a user runs it) at ``OMP_NUM_THREADS=1``; the figures are
the process's CPU seconds (user + system: on a shared machine the wall clock measures the neighbours) and, apart,
the seconds of ``plan_memory``'s measuring step. Writes ``bench/results/plan_time.json``.

    python -m bench.plan_time                 # every configuration, cache on and off
    python -m bench.plan_time --only on       # with the cache only
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
# README's `longstraw plan` lines that need no file of the reader's (its --config RUN.yaml and CONFIG.json lines)
CONFIGURATIONS = [
    "--model qwen3.6-27b --context 2.1M --gpus 8",
    "--model qwen3.6-27b --context 2.1M --group 8 --gpus 8 --gpu-mem 96GB --mode detached",
    "--context 2.1M --gpus 8 --offload",
    "--context 1M --gpus 16 --dp 2 --cp 8 --hsdp",
    "--context 2.1M --gpus 8 --time --hardware h20",
    "--mode exact --gpus 8 --walk replicated --longest",
    "--model glm-5.2 --context 2.1M --gpus 32 --chunk 1024 --optimizer none",
    "--model glm-5.2 --context 2.1M --gpus 32 --chunk 1024 --expert-parallel --offload",
    "--context 8192 --history 1M --turns 200 --group 8 --gpus 8 --mode detached",
    "--context 8192 --history 1M --turns 200 --group 8 --gpus 8 --mode exact --walk replicated --offload",
]


def _one(flags: str, cache: bool) -> None:
    """In this process: ``longstraw plan FLAGS``; prints one JSON line of its times and its output."""
    from longstraw_agents.cli import main
    from longstraw_agents.plan import PlanRequest, planner, probes

    probes.CACHE_META_OPS = cache
    measure = planner._measure
    measuring = [0.0]

    def timed(request: PlanRequest) -> object:
        start = time.process_time()
        try:
            return measure(request)
        finally:
            measuring[0] += time.process_time() - start

    planner._measure = timed  # type: ignore[assignment]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(["plan", *flags.split()])
    print(json.dumps({"measure_s": measuring[0], "output": printed.getvalue()}))


def timed_plan(flags: str, cache: bool) -> dict:
    """``flags`` planned in a fresh process: its CPU seconds, its measuring step's, and what it printed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    argv = [sys.executable, "-m", "bench.plan_time", "--one", flags, "--only", "on" if cache else "off"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"cpu_s": round(cpu, 1), "measure_s": round(result["measure_s"], 1), "output": result["output"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["on", "off"], help="time the planner with (on) or without the cache only")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # (the child process: one plan)
    args = parser.parse_args()
    if args.one is not None:
        _one(args.one, args.only != "off")
        return
    modes = [args.only == "on"] if args.only else [False, True]
    rows = []
    for flags in CONFIGURATIONS:
        times = {("cache" if cache else "no_cache"): timed_plan(flags, cache) for cache in modes}
        outputs = {t.pop("output") for t in times.values()}
        row = {"flags": flags, **times, "same_plan": len(outputs) == 1}
        print(json.dumps(row), flush=True)
        rows.append(row)
    RESULTS.mkdir(exist_ok=True)
    name = "plan_time.json" if args.only is None else f"plan_time_{args.only}.json"
    (RESULTS / name).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
