"""The time model (``longstraw_agents.timing``) against measured phase times: calibrated on one configuration,
validated on the held-out ones.

Each measured row of ``bench.gpu.measure_phases`` (capture, scoring, replay, decode, a detached and an exact step
and the walk between them) gets the work the model counts for that phase of that configuration
(``Schedule``); ``calibrate`` fits the efficiencies to the rows of one configuration (the calibration family at its
shortest length), and every other row is predicted from them — other lengths, other families.

- default (this CPU): measures the rows here first (fp32, three families at small sizes, one process);
- ``--rows bench/results/gpu.json``: the rows a GPU run measured (``bench/gpu.sh``), rebuilt from its arguments;
  the fitted profile is what ``longstraw_agents.timing.H200_MEASURED`` holds.

Prints measured vs predicted per row and the worst held-out errors; writes ``bench/results/timing_<device>.json``.

    python -m bench.timing [--quick] [--rows bench/results/gpu.json] [--calibrate-on hybrid]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bench.gpu import FAMILIES, build, measure_phases
from bench.gpu import parse_args as gpu_args
from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.planner import PlanRequest
from longstraw_agents.timing import (
    CPU_UNMEASURED,
    H200_PRIOR,
    HardwareProfile,
    ModelWork,
    Schedule,
    Work,
    calibrate,
    total,
)

RESULTS = Path(__file__).parent / "results"
STEPS = {
    "capture": ("capture",),
    "scoring": ("scoring",),
    "replay": ("replay",),
    "decode": ("rollout",),
    "detached_step": ("capture", "replay"),
    "exact_step": ("capture", "replay", "walk"),
    "walk": ("walk",),
}
KEPT = ("matmul", "memory")  # measured directly on the device: a large bf16 matmul, a device-to-device copy
MEASURED = ("capture", "scoring", "replay", "decode", "detached_step", "exact_step")  # not differences


def row_work(row: dict[str, Any], model: ModelWork, args: argparse.Namespace) -> Work:
    """The work the time model counts for a measured row (one process; the prompt is the row's context plus the
    token each completion starts from)."""
    engine = EngineConfig(chunk_size=args.chunk, max_score_elements=args.max_score_elements)
    request = PlanRequest(
        model="tiny-llama", context=row["positions"] + 1, group=args.group, completion=args.completion, gpus=1,
        dtype=model.dtype, engine=engine, mode="exact",
    )  # fmt: skip
    schedule = Schedule(request, model)
    decoding = Schedule(replace(request, completion=args.decode_tokens), model)
    phases = {
        "capture": schedule.capture,
        "scoring": schedule.scoring,
        "replay": schedule.replay,
        "walk": schedule.walk,
        "rollout": decoding.rollout,
    }
    return total(phases[name]() for name in STEPS[row["phase"]])


def predicted_rows(
    rows: list[dict[str, Any]], args: argparse.Namespace, prior: HardwareProfile, device: str
) -> tuple[HardwareProfile, list[dict[str, Any]]]:
    """Fit ``prior`` to the rows at the shortest length (every family: each class of work is exercised by some
    family); every row with its prediction and ratio, the longer lengths held out."""
    dtype = getattr(torch, args.dtype)
    families = sorted({r["family"] for r in rows})
    models = {family: ModelWork.of(FAMILIES[family](args), dtype, args.chunk) for family in families}
    works = [row_work(r, models[r["family"]], args) for r in rows]
    shortest = min(r["positions"] for r in rows)
    chosen = [
        (w, r["seconds"])
        for r, w in zip(rows, works, strict=True)
        if r["positions"] == shortest and r["phase"] in MEASURED
    ]
    name = f"{device}, {', '.join(families)} at {shortest} positions ({len(chosen)} phases)"
    profile = calibrate(prior, chosen, name=name, keep=KEPT)
    out = []
    for r, w in zip(rows, works, strict=True):
        predicted = profile.time(w)
        held_out = r["positions"] != shortest
        out.append({**r, "predicted_s": predicted, "ratio": predicted / r["seconds"], "held_out": held_out})
    return profile, out


def report(rows: list[dict[str, Any]], profile: HardwareProfile) -> dict[str, Any]:
    print(f"\nprofile fitted on {profile.measured_on}:")
    e = profile.efficiency
    print(
        f"  efficiencies matmul {e.matmul:.3f}, attention {e.attention:.3f}, recurrent {e.recurrent:.3f}, "
        f"memory {e.memory:.3f}; {1e6 * profile.launch_s:.1f} us per layer call"
    )
    print(f"{'family':<7} {'positions':>9} {'phase':<14} {'measured s':>10} {'model s':>9} {'model/meas':>10}  fitted")
    for r in rows:
        print(
            f"{r['family']:<7} {r['positions']:>9} {r['phase']:<14} {r['seconds']:>10.3f} {r['predicted_s']:>9.3f} "
            f"{r['ratio']:>10.2f}  {'held out' if r['held_out'] else 'on these'}"
        )
    summary = {}
    for kind, phases in (("steps", ("detached_step", "exact_step")), ("phases", MEASURED)):
        errors = [abs(r["ratio"] - 1) for r in rows if r["held_out"] and r["phase"] in phases]
        summary[f"held_out_{kind}_worst_error"] = max(errors) if errors else None
        summary[f"held_out_{kind}"] = len(errors)
    print(
        f"held-out one-process steps: worst error {100 * (summary['held_out_steps_worst_error'] or 0):.0f} % "
        f"({summary['held_out_steps']} steps); every held-out measured phase: worst "
        f"{100 * (summary['held_out_phases_worst_error'] or 0):.0f} % ({summary['held_out_phases']})"
    )
    return summary


def fit_rows(record: dict[str, Any]) -> tuple[HardwareProfile, list[dict[str, Any]]]:
    """The H200 profile fitted to a GPU run's record (``bench/gpu.py``'s JSON), and its rows with predictions."""
    settings = record["args"]
    args = gpu_args([])
    for key in ("hidden", "layers", "vocab", "experts", "index_topk", "group", "completion", "decode_tokens"):
        setattr(args, key, int(settings[key]))
    args.chunk, args.max_score_elements = int(settings["chunk"]), int(settings["max_score_elements"])
    args.dtype = settings["dtype"]
    return predicted_rows(record["rows"], args, H200_PRIOR, record["device"])


def measure_here(args: argparse.Namespace) -> list[dict[str, Any]]:
    device = torch.device(args.device)
    rows = []
    for family in args.families:
        model = build(family, args, device)
        engine = Engine(model, EngineConfig(chunk_size=args.chunk, max_score_elements=args.max_score_elements))
        measure_phases(model, engine, 2 * args.chunk, argparse.Namespace(**{**vars(args), "exact_at": []}))  # warm
        for positions in args.lengths:
            rows += measure_phases(model, engine, positions, args)
    return rows


def cpu_args(quick: bool) -> argparse.Namespace:
    """Small models this CPU measures in a few minutes: every phase of three families at three lengths."""
    sizes = ["--hidden", "256", "--layers", "4", "--vocab", "8192", "--chunk", "512", "--group", "4"]
    sizes += ["--completion", "64", "--decode-tokens", "16", "--index-topk", "512", "--experts", "8"]
    sizes += ["--lengths", "1024", "4096", "8192", "--exact-at", "1024", "4096", "8192"]
    if quick:
        sizes += ["--lengths", "256", "512", "--exact-at", "256", "512", "--chunk", "128", "--hidden", "64"]
    return gpu_args([*sizes, "--device", "cpu", "--dtype", "float32"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=Path, default=None, help="a GPU run's JSON (bench/gpu.sh) instead of CPU rows")
    parser.add_argument("--quick", action="store_true", help="toy sizes: the smoke test of this script")
    parser.add_argument("--out", type=Path, default=None)
    options = parser.parse_args()
    start = time.perf_counter()
    if options.rows is not None:
        record = json.loads(options.rows.read_text())
        device = record["device"]
        profile, predicted = fit_rows(record)
    else:
        args = cpu_args(options.quick)
        device = "cpu"
        torch.manual_seed(0)
        profile, predicted = predicted_rows(measure_here(args), args, CPU_UNMEASURED, device)
    summary = report(predicted, profile)
    name = "h200" if options.rows is not None else "cpu"
    out = options.out or RESULTS / f"timing_{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"device": device, "profile": profile.model_dump(), "summary": summary, "rows": predicted}
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
