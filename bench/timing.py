"""The time model (``longstraw_agents.plan.timing``) against measured phase times.

Each measured row of ``bench.gpu`` (capture, scoring, replay, decode, a detached and an exact step, and the walk
between them) gets the work the model counts for that phase of that configuration (``Schedule``), turned into
seconds by a profile:

- **measured op by op** where the run has them (``bench.ceilings``, per family: a layer-shaped matmul, the attention
  kernels on a chunk's block, the delta rule over a chunk, DSA's scores and top-k, a matrix-vector product, the host's
  latency per layer call on each path at a width of 64): no phase of a step is used, so **every row is held out**;
- **fitted** otherwise (an older record without micro-benchmarks: ``bench/results/gpu.json``, one H200): least
  squares at the shortest length, the longer lengths held out — what ``plan.hardware.H200_MEASURED`` holds.

Default: runs ``bench.gpu`` on this CPU first (fp32, three families of hidden 256 at 1K–8K positions, every phase;
rows in ``bench/results/phases_cpu.json``); ``--rows FILE`` evaluates a record already measured. Prints measured vs
modelled per row and the worst errors; writes ``bench/results/timing_<cpu|h200>.json``.

``--cp 2``: instead, each phase's share of an exact step at cp = 2 (gloo, one thread per rank, each family at 4,096
positions) beside the model's for the same schedule (``Schedule(sharded=False)``: the engine alone, no FSDP2), with
the rates micro-benchmarked at one thread and the link's measured bytes/s; ``bench/results/timing_cp2.json``.

    python -m bench.timing [--quick] [--rows bench/results/gpu.json] [--cp 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.ceilings import measure_profile
from bench.gpu import main as measure
from bench.gpu import parse_args as gpu_args
from bench.workloads import FAMILIES, Workload, build, engine_config, row_work, schedules
from longstraw_agents.engine import Engine
from longstraw_agents.parallel import ParallelMesh
from longstraw_agents.plan import H200_PRIOR, HardwareProfile, ModelWork, calibrate
from longstraw_agents.trainer import grpo_backward

RESULTS = Path(__file__).parent / "results"
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
    args.dtype, args.attention = settings["dtype"], settings.get("attention", "auto")
    return args


def evaluate(record: dict[str, Any]) -> tuple[dict[str, HardwareProfile], list[dict[str, Any]]]:
    """Each row with its modelled seconds: from its family's micro-benchmarked profile when the record has one
    (every row held out), else from a profile fitted at the shortest length (the longer ones held out)."""
    args = record_args(record)
    rows, dtype = record["rows"], getattr(torch, args.dtype)
    families = sorted({r["family"] for r in rows})
    models = {family: ModelWork.of(FAMILIES[family](args), dtype) for family in families}
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
            f"{e.attention:.2f}x / backward {e.attention_backward:.2f}x of it, delta rule {e.recurrent:.3f}x / "
            f"backward {e.of('recurrent_backward'):.3f}x, "
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
    three timings each (``quick``: ``bench.gpu``'s toy sizes, the smoke test of this script)."""
    if quick:
        return ["--quick", "--device", "cpu", "--dtype", "float32"]
    sizes = ["--hidden", "256", "--layers", "4", "--vocab", "8192", "--chunk", "512", "--group", "4"]
    sizes += ["--completion", "64", "--decode-tokens", "16", "--index-topk", "512", "--experts", "8"]
    sizes += ["--lengths", "1024", "4096", "8192", "--exact-at", "1024", "4096", "8192", "--repeats", "3"]
    return [*sizes, "--device", "cpu", "--dtype", "float32"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=Path, default=None, help="a record bench.gpu wrote, instead of measuring here")
    parser.add_argument("--quick", action="store_true", help="toy sizes: the smoke test of this script")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--cp", type=int, default=None, help="instead: each phase's share of an exact step at this cp")
    parser.add_argument("--families", nargs="+", choices=sorted(FAMILIES), default=sorted(FAMILIES), help="with --cp")
    options = parser.parse_args()
    start = time.perf_counter()
    if options.cp is not None:
        positions = 512 if options.quick else 4096
        results = [cp_shares(family, cpu_argv(options.quick), positions, options.cp) for family in options.families]
        report_cp(results)
        out = options.out or RESULTS / f"timing_cp{options.cp}.json"
        out.write_text(json.dumps({"device": "cpu", "results": results}, indent=1))
        print(f"wrote {out} ({time.perf_counter() - start:.0f} s)")
        return
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


# --- context parallelism: each phase's share of a step at cp = 2 ----------------------------------------------


def cp_worker(rank: int, world: int, store: str, out: str, family: str, argv: list[str], positions: int) -> None:
    """One cp rank (gloo, one thread): the slowest-rank times of a capture, a detached and an exact step (median of
    ``--repeats``), the link's bytes/s (a 32 MiB point-to-point message) and the rates this rank reaches."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    args = gpu_args(argv)
    torch.manual_seed(0)
    mesh = ParallelMesh.build(dp=1, cp=world)
    model = build(family, args, torch.device("cpu"))
    work = Workload.random(positions, args, torch.device("cpu"))
    shards = mesh.context_parallel()
    engine = Engine(model, engine_config(args), shards=shards)

    def timed(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(args.repeats):
            model.zero_grad(set_to_none=True)
            dist.barrier()
            began = time.perf_counter()
            fn()
            dist.barrier()
            times.append(time.perf_counter() - began)
        return statistics.median(times)

    def step(mode: str) -> Callable[[], object]:
        return lambda: grpo_backward(engine, work.prompt, work.completions, work.rewards, mode, track_memory=False)

    step("exact")()  # warm-up
    result = {
        "capture": timed(lambda: engine.capture(work.prompt[:-1])),
        "detached": timed(step("detached")),
        "exact": timed(step("exact")),
    }
    message = torch.zeros(1 << 23)  # 32 MiB
    dist.barrier()
    began = time.perf_counter()
    dist.send(message, 1) if rank == 0 else dist.recv(message, 0) if rank == 1 else None
    dist.barrier()
    result["link_bytes_per_s"] = message.numel() * message.element_size() / (time.perf_counter() - began)
    # the rates as each rank reaches them with the others measuring beside it (cores, caches and memory shared)
    result["profile"] = measure_profile(
        family, args, torch.device("cpu"), f"cpu, one thread, cp rank {rank}"
    ).model_dump()
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def cp_shares(family: str, argv: list[str], positions: int, world: int = 2) -> dict[str, Any]:
    """Measured and modelled seconds and shares of the capture, the branch replays and the walk in an exact step at
    cp = ``world`` (one thread per rank; the rates micro-benchmarked on every rank at once, the last rank's used)."""
    with tempfile.TemporaryDirectory() as tmp:
        spawn = (world, f"{tmp}/store", tmp, family, argv, positions)
        mp.start_processes(cp_worker, args=spawn, nprocs=world, start_method="fork")
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(world)]
    measured = {what: max(r[what] for r in ranks) for what in ("capture", "detached", "exact")}
    phases = {
        "capture": measured["capture"],
        "replay": measured["detached"] - measured["capture"],
        "walk": measured["exact"] - measured["detached"],
    }
    args = gpu_args(argv)
    profile = HardwareProfile(**ranks[-1]["profile"])  # the last rank's: the model charges its work
    profile = profile.model_copy(update={"link_bandwidth": min(r["link_bytes_per_s"] for r in ranks)})
    counted = ModelWork.of(FAMILIES[family](args), getattr(torch, args.dtype))
    schedule, _ = schedules(counted, positions, args, engine_config(args), gpus=world, cp=world, dp=1)
    modelled = {"capture": schedule.capture(), "replay": schedule.replay(), "walk": schedule.walk()}
    seconds = {name: profile.time(work) for name, work in modelled.items()}
    step_measured, step_modelled = sum(phases.values()), sum(seconds.values())
    rows = {
        name: {
            "measured_s": phases[name],
            "modelled_s": seconds[name],
            "measured_share": phases[name] / step_measured,
            "modelled_share": seconds[name] / step_modelled,
            "comm_s": profile.seconds(modelled[name])["comm"],
        }
        for name in phases
    }
    return {"family": family, "cp": world, "positions": positions, "phases": rows, "exact_step_s": step_measured,
            "modelled_exact_step_s": step_modelled, "link_bytes_per_s": profile.link_bandwidth}  # fmt: skip


def report_cp(results: list[dict[str, Any]]) -> None:
    print(f"\n{'family':<7} {'cp':>2} {'phase':<8} {'measured s':>10} {'model s':>8} {'share':>6} {'model share':>11}")
    for result in results:
        for name, row in result["phases"].items():
            print(
                f"{result['family']:<7} {result['cp']:>2} {name:<8} {row['measured_s']:>10.3f} "
                f"{row['modelled_s']:>8.3f} {row['measured_share']:>6.2f} {row['modelled_share']:>11.2f}"
            )
        print(
            f"{result['family']:<7} {result['cp']:>2} {'exact':<8} {result['exact_step_s']:>10.3f} "
            f"{result['modelled_exact_step_s']:>8.3f}  (link {result['link_bytes_per_s'] / 1e9:.2f} GB/s)"
        )


if __name__ == "__main__":
    main()
