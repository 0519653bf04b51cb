"""The time model (``longstraw_agents.timing``) against measured phase times.

Each measured row of ``bench.gpu`` (capture, scoring, replay, decode, a detached and an exact step, and the walk
between them) gets the work the model counts for that phase of that configuration (``Schedule``), turned into
seconds by a profile:

- **measured op by op** where the run has them (``bench.ceilings``, per family: a layer-shaped matmul, the attention
  kernels on a chunk's block, the delta rule over a chunk, DSA's scores and top-k, a matrix-vector product, the host's
  latency per layer call on each path at a width of 64): no phase of a step is used, so **every row is held out**;
- **fitted** otherwise (an older record without micro-benchmarks: ``bench/results/gpu.json``, one H200): least
  squares at the shortest length, the longer lengths held out — what ``longstraw_agents.timing.H200_MEASURED`` holds.

Default: runs ``bench.gpu`` on this CPU first (fp32, three families of hidden 256 at 1K–8K positions, every phase;
rows in ``bench/results/phases_cpu.json``); ``--rows FILE`` evaluates a record already measured. Prints measured vs
modelled per row and the worst errors; writes ``bench/results/timing_<cpu|h200>.json``.

    python -m bench.timing [--quick] [--rows bench/results/gpu.json] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bench.gpu import FAMILIES
from bench.gpu import main as measure
from bench.gpu import parse_args as gpu_args
from longstraw_agents.engine import EngineConfig
from longstraw_agents.planner import PlanRequest
from longstraw_agents.timing import H200_PRIOR, HardwareProfile, ModelWork, Schedule, Work, calibrate, total

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
KEPT = ("matmul", "memory")  # in a fit: kept at what a large bf16 matmul and a device copy reach on the device
MEASURED = ("capture", "scoring", "replay", "decode", "detached_step", "exact_step")  # not differences
WHOLE_STEPS = ("detached_step", "exact_step")


def record_args(record: dict[str, Any]) -> argparse.Namespace:
    """The measured configuration (``bench.gpu``'s arguments) of a record."""
    settings = record["args"]
    args = gpu_args([])
    for key in ("hidden", "layers", "vocab", "experts", "index_topk", "group", "completion", "decode_tokens"):
        setattr(args, key, int(settings[key]))
    args.chunk, args.max_score_elements = int(settings["chunk"]), int(settings["max_score_elements"])
    args.dtype = settings["dtype"]
    return args


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


def evaluate(record: dict[str, Any]) -> tuple[dict[str, HardwareProfile], list[dict[str, Any]]]:
    """Each row with its modelled seconds: from its family's micro-benchmarked profile when the record has one
    (every row held out), else from a profile fitted at the shortest length (the longer ones held out)."""
    args = record_args(record)
    rows, dtype = record["rows"], getattr(torch, args.dtype)
    families = sorted({r["family"] for r in rows})
    models = {family: ModelWork.of(FAMILIES[family](args), dtype, args.chunk) for family in families}
    works = [row_work(r, models[r["family"]], args) for r in rows]
    setup = record.get("setup", {})
    if all("profile" in setup.get(family, {}) for family in families):
        profiles = {family: HardwareProfile(**setup[family]["profile"]) for family in families}
        held_out = [True] * len(rows)
    else:
        shortest = min(r["positions"] for r in rows)
        samples = [
            (w, r["seconds"])
            for r, w in zip(rows, works, strict=True)
            if r["positions"] == shortest and r["phase"] in MEASURED
        ]
        name = f"{record['device']}, {', '.join(families)} at {shortest} positions ({len(samples)} phases)"
        fitted = calibrate(H200_PRIOR, samples, name=name, keep=KEPT)
        profiles = dict.fromkeys(families, fitted)
        held_out = [r["positions"] != shortest for r in rows]
    out = []
    for r, w, held in zip(rows, works, held_out, strict=True):
        modelled = profiles[r["family"]].time(w)
        out.append({**r, "predicted_s": modelled, "ratio": modelled / r["seconds"], "held_out": held})
    return profiles, out


def report(rows: list[dict[str, Any]], profiles: dict[str, HardwareProfile]) -> dict[str, Any]:
    for family, profile in profiles.items():
        e = profile.efficiency
        print(
            f"{family}: {profile.measured_on}\n  matmul {profile.peak_flops * e.matmul / 1e12:.3f} TFLOP/s, attention "
            f"{e.attention:.2f}x / backward {e.attention_backward:.2f}x of it, delta rule {e.recurrent:.3f}x, "
            f"memory {profile.memory_bandwidth * e.memory / 1e9:.0f} GB/s; per layer call: chunk "
            f"{1e6 * profile.launch_s:.0f} us, branch {1e6 * profile.branch_call_s:.0f} us, decoding step "
            f"{1e6 * profile.decode_call_s:.0f} us; {1e9 * profile.selection_s:.2f} ns per index score"
        )
    print(f"{'family':<7} {'positions':>9} {'phase':<14} {'measured s':>10} {'model s':>9} {'model/meas':>10}")
    for r in rows:
        print(
            f"{r['family']:<7} {r['positions']:>9} {r['phase']:<14} {r['seconds']:>10.3f} {r['predicted_s']:>9.3f} "
            f"{r['ratio']:>10.2f}{'' if r['held_out'] else '  (fitted on)'}"
        )
    summary: dict[str, Any] = {}
    for kind, phases in (("steps", WHOLE_STEPS), ("phases", MEASURED)):
        ratios = [r["ratio"] for r in rows if r["held_out"] and r["phase"] in phases]
        summary[f"held_out_{kind}"] = len(ratios)
        summary[f"held_out_{kind}_ratios"] = [min(ratios), max(ratios)] if ratios else None
    steps, phases = summary["held_out_steps_ratios"], summary["held_out_phases_ratios"]
    print(
        f"held-out one-process steps: model/measured {steps[0]:.2f}-{steps[1]:.2f} ({summary['held_out_steps']}); "
        f"every held-out measured phase: {phases[0]:.2f}-{phases[1]:.2f} ({summary['held_out_phases']})"
    )
    return summary


def cpu_argv(quick: bool) -> list[str]:
    """Models this CPU measures in a few minutes: every phase of three families at three lengths, the median of
    three timings each (``quick``: toy sizes, the smoke test of this script)."""
    if quick:
        sizes = ["--hidden", "64", "--layers", "4", "--vocab", "1024", "--chunk", "128", "--group", "2"]
        sizes += ["--completion", "8", "--decode-tokens", "4", "--index-topk", "32", "--experts", "8"]
        sizes += ["--lengths", "256", "512", "--exact-at", "256", "--repeats", "1"]
    else:
        sizes = ["--hidden", "256", "--layers", "4", "--vocab", "8192", "--chunk", "512", "--group", "4"]
        sizes += ["--completion", "64", "--decode-tokens", "16", "--index-topk", "512", "--experts", "8"]
        sizes += ["--lengths", "1024", "4096", "8192", "--exact-at", "1024", "4096", "8192", "--repeats", "3"]
    return [*sizes, "--device", "cpu", "--dtype", "float32"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=Path, default=None, help="a record bench.gpu wrote, instead of measuring here")
    parser.add_argument("--quick", action="store_true", help="toy sizes: the smoke test of this script")
    parser.add_argument("--out", type=Path, default=None)
    options = parser.parse_args()
    start = time.perf_counter()
    if options.rows is not None:
        record = json.loads(options.rows.read_text())
    else:
        torch.manual_seed(0)
        phases_out = (options.out or RESULTS / "timing_cpu.json").with_name("phases_cpu.json")
        record = measure([*cpu_argv(options.quick), "--out", str(phases_out)])
    profiles, rows = evaluate(record)
    summary = report(rows, profiles)
    out = options.out or RESULTS / f"timing_{'cpu' if record['device'] == 'cpu' else 'h200'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    profile_dumps = {family: profile.model_dump() for family, profile in profiles.items()}
    result = {"device": record["device"], "profiles": profile_dumps, "summary": summary, "rows": rows}
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
