"""Context parallelism on CPU (gloo): per-rank state, time, communication and the wavefront's critical path, for
cp = 1, 2, 4 — printed as ratios to cp = 1 (the schedule is docs/distributed.md's).

- state/rank: the attention state a rank holds after the capture (target <= 1.05 / N of one process's);
- capture (cut balanced: rank r computes the r-th and the (2N - 1 - r)-th of 2N parts), the same capture cut in rank
  order (``EngineConfig.balanced_captures: false``), detached step, exact step (its capture, and so its wavefront
  walk, balanced) and the exact step in rank order: wall seconds (the slowest rank), and the speed-up over cp = 1;
  capture idle: the largest fraction of each capture a rank spent waiting for messages (balanced | in rank order);
- sent/rank per exact step (balanced), by kind — ``rows`` (a capture's and the walk's earlier rows to later ranks),
  ``state_grad`` (their K/V gradient back, GatedDeltaNet state gradients), ``recurrent`` (states broadcast after the
  capture), ``partials``/``dq`` (the replicated branch replays' merges), ``param_grads`` (the walk's parameter
  gradient, summed over cp) — and the rank order's rows against the analytic minimum for moving rows to the later
  ranks:
  ``sum_s rows_s * (later computing ranks)`` per growing layer, twice (capture and walk); the walk sends the rows
  of the layers it recomputes once more (a receiver holds one layer's rows at a time);
- the exact walk's critical path in cell steps: its wall time over the mean time of one (run, layer) cell (a
  layer of backward over a run's chunks), against ``runs + layers - 1`` (a perfect wavefront: 2N - 1 runs of half
  a shard balanced) and ``runs x layers`` (the naive order); idle: the largest fraction of the walk a rank spent
  waiting for messages (balanced | in rank order).

Then the training step as ``longstraw train`` runs it (``GRPOTrainer``, FSDP2 over dp = 1 x cp ranks, AdamW), per
rank, for every cp > 1 (``sharded``):

- the bytes of every collective of one step, by kind — all-gathers (FSDP2's weights), reduce-scatters (their
  gradients), all-reduces, broadcasts, point-to-point sends (rows, partials, state gradients) — counted as NCCL's
  tests count bus bytes (an all-gather or reduce-scatter of S bytes over N ranks moves S (N - 1) / N per rank, an
  all-reduce twice that), beside the analytic minimum of FSDP's schedule: each weight gathered once for the
  forward and once for the backward, each gradient reduce-scattered once (``2 P (N - 1) / N`` and ``P (N - 1) / N``);
- each rank's measured peak (a ``MemoryTracker`` over the rank's whole process, by role: ``parallel.roles``) beside
  ``longstraw plan``'s figure for the same configuration and cp rank.

On this machine's 2 cores, cp = 4 runs four processes on two cores: its times include the oversubscription.

    python -m bench.distributed [--prompt 4096] [--family llama] [--layers 8]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import PretrainedConfig

from longstraw_agents import plan as planning
from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.engine.wavefront import WavefrontWalk
from longstraw_agents.memory import MemoryTracker
from longstraw_agents.models.presets import TINY_PRESETS, build_model, tiny_model
from longstraw_agents.parallel import ParallelMesh, parallelize
from longstraw_agents.parallel.discipline import Op, read_logs, record_to
from longstraw_agents.parallel.roles import step_roles
from longstraw_agents.trainer import GRPOConfig, GRPOTrainer, grpo_backward

RESULTS = Path(__file__).parent / "results"
# fork: the ranks skip re-importing torch (seconds each on busy cores); spawn once CUDA is initialised here
START = "spawn" if torch.cuda.is_initialized() else "fork"


class WalkTimer:
    """Times exact mode's wavefront walk on this rank and the compute of each of its (layer) steps — the step's
    duration less what it spent waiting for messages — by wrapping the walk's methods (a bench-only probe: the
    engine keeps no timings)."""

    def __init__(self) -> None:
        self.walk_s, self.waited_s = 0.0, 0.0
        self.steps: list[float] = []
        self.pending = 0.0  # a step's segment recompute (``_input``), added to the step that follows it
        walk = WavefrontWalk
        walk.run = self._timing(walk.run, whole=True)  # type: ignore[method-assign]
        walk._input = self._timing(walk._input, pending=True)  # type: ignore[method-assign]
        walk._backward_growing = self._timing(walk._backward_growing)  # type: ignore[method-assign]
        walk._backward_recurrent = self._timing(walk._backward_recurrent)  # type: ignore[method-assign]

    def _timing(self, method, whole: bool = False, pending: bool = False):
        timer = self

        def timed(walk, *args):
            began, waited = time.perf_counter(), walk.transport.waited_s
            try:
                return method(walk, *args)
            finally:
                spent, idle = time.perf_counter() - began, walk.transport.waited_s - waited
                if whole:
                    timer.walk_s += spent
                    timer.waited_s += idle
                elif pending:
                    timer.pending += spent - idle
                elif walk.my_runs:
                    timer.steps.append(spent - idle + timer.pending)
                    timer.pending = 0.0

        return timed


def worker(rank: int, world: int, store: str, out: str, args: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    mesh = ParallelMesh.build(dp=1, cp=world)
    model = tiny_model(args["family"], vocab_size=2048, layers=args["layers"])
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 2048, (args["prompt"],), generator=gen)
    completions = [torch.randint(0, 2048, (16,), generator=gen) for _ in range(args["group"])]
    rewards = torch.rand(args["group"], generator=gen).tolist()
    shards = mesh.context_parallel() if world > 1 else None
    engine = Engine(model, EngineConfig(chunk_size=args["chunk"]), shards=shards)
    result: dict[str, Any] = {}

    def timed(fn) -> float:
        dist.barrier()
        began = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - began

    def idle(fn) -> tuple[float, float]:
        """``fn``'s time, and the fraction of it this rank waited for messages (none on one rank)."""
        waited = shards.transport.waited_s if shards is not None else 0.0
        spent = timed(fn)
        return spent, ((shards.transport.waited_s - waited) / spent if shards is not None else 0.0)

    state = engine.capture(prompt)  # warm-up, and the state's size
    recurrent = {id(r): r.nbytes for c in state.chunks for r in c.recurrent if r is not None}
    result["growing"] = state.nbytes - sum(recurrent.values())
    del state
    result["capture"], result["capture_idle"] = idle(lambda: engine.capture(prompt))
    in_order = Engine(model, EngineConfig(chunk_size=args["chunk"], balanced_captures=False), shards=shards)
    result["capture_in_order"], result["capture_in_order_idle"] = idle(lambda: in_order.capture(prompt))
    result["detached"] = timed(
        lambda: grpo_backward(engine, prompt, completions, rewards, "detached", track_memory=False)
    )
    timer = WalkTimer()
    if shards is not None:
        shards.transport.sent_bytes = dict.fromkeys(shards.transport.sent_bytes, 0)
    result["exact"] = timed(lambda: grpo_backward(engine, prompt, completions, rewards, "exact", track_memory=False))
    result["sent"] = dict(shards.transport.sent_bytes) if shards is not None else {}
    result["walk_s"], result["walk_waited_s"] = timer.walk_s, timer.waited_s
    result["walk_step_s"] = timer.steps
    timer.walk_s, timer.waited_s = 0.0, 0.0
    if shards is not None:
        shards.transport.sent_bytes = dict.fromkeys(shards.transport.sent_bytes, 0)
    result["exact_in_order"] = timed(
        lambda: grpo_backward(in_order, prompt, completions, rewards, "exact", track_memory=False)
    )
    result["walk_in_order_s"], result["walk_in_order_waited_s"] = timer.walk_s, timer.waited_s
    result["sent_in_order"] = dict(shards.transport.sent_bytes) if shards is not None else {}
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def run(world: int, args: dict) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(world, f"{tmp}/store", tmp, args), nprocs=world, start_method=START)
        return [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(world)]


STEPS = ("capture", "capture_in_order", "detached", "exact", "exact_in_order")


def row_minimum(state_bytes: float, world: int) -> float:
    """Bytes the busiest sender must move for rows to reach every later rank, capture and walk: rank 0 sends its
    shard (1/N of the state) to N - 1 ranks, twice (no rank can keep every earlier row between the two)."""
    return 2 * state_bytes / world * (world - 1)


def row_schedule(state_bytes: float, world: int, layers: int) -> float:
    """What the schedule sends (every layer grows, as in llama): the minimum, plus the rows of the layers the walk
    recomputes (those below the top of each segment of ceil(sqrt(L)) layers) sent once more."""
    every = math.ceil(math.sqrt(layers))
    recomputed = sum(min(first + every, layers) - 1 - first for first in range(0, layers, every))
    return row_minimum(state_bytes, world) * (1 + recomputed / layers / 2)


def summarise(world: int, ranks: list[dict], base: dict | None, layers: int) -> dict:
    state = max(r["growing"] for r in ranks)
    sent = [r["sent"] for r in ranks]
    row = {"cp": world, "state_bytes_max": state, "sent": sent}
    for what in STEPS:
        row[what] = max(r[what] for r in ranks)
    for what in ("capture_idle", "capture_in_order_idle"):
        row[what] = max(r[what] for r in ranks)
    row["sent_bytes_max"] = max((sum(s.values()) for s in sent), default=0)
    # (the schedule's minimum counts the rank order's rows: each earlier row to each later rank)
    row["rows_bytes_max"] = max((r["sent_in_order"].get("rows", 0) for r in ranks), default=0)
    row["rows_bytes_balanced_max"] = max((s.get("rows", 0) for s in sent), default=0)
    if base is not None:
        row["state_ratio_to_share"] = state / (base["state_bytes_max"] / world)
        row["row_minimum_bytes"] = row_minimum(base["state_bytes_max"], world)
        row["row_schedule_bytes"] = row_schedule(base["state_bytes_max"], world, layers)
        for what in STEPS:
            row[f"{what}_speedup"] = base[what] / row[what]
    walk = max(r["walk_s"] for r in ranks)
    steps = [s for r in ranks for s in r["walk_step_s"]]
    if world > 1 and walk > 0 and steps:
        mean_step = sum(steps) / len(steps)
        row["walk_s"] = walk
        row["critical_path_steps"] = walk / mean_step
        row["idle_max"] = max(r["walk_waited_s"] / r["walk_s"] for r in ranks if r["walk_s"] > 0)
        row["idle_in_order_max"] = max(r["walk_in_order_waited_s"] / r["walk_in_order_s"] for r in ranks)
        runs = 2 * world - 1
        row["wavefront_steps"], row["naive_steps"] = runs + layers - 1, runs * layers
    return row


# --- the training step on the mesh: collectives and each rank's peak --------------------------------------------

MODE = "detached"
VOCAB_SIZE = 2048


def step_model_config(args: dict) -> PretrainedConfig:
    return TINY_PRESETS[args["family"]](vocab_size=VOCAB_SIZE, layers=args["layers"])


def sharded_worker(rank: int, world: int, store: str, out: str, args: dict) -> None:
    """One rank: a trainer whose model FSDP2 shards over a ``(dp, cp)`` mesh (``args["mesh"]``; dp = 1 x cp = world
    by default), two steps on one group per dp rank (each its own prompt); the second is measured (its collectives
    recorded, its peak tracked from the model's construction on)."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    dp, cp, hsdp = args.get("mesh", (1, world, False))
    mesh = ParallelMesh.build(dp=dp, cp=cp, hsdp=hsdp)
    with MemoryTracker() as tracker:
        model = build_model(step_model_config(args), dtype=torch.float32, seed=0)
        shards = mesh.context_parallel() if cp > 1 else None
        engine = Engine(model, EngineConfig(chunk_size=args["chunk"]), shards=shards)
        placement = parallelize(engine, mesh=mesh, fsdp=True)
        trainer = GRPOTrainer(placement, GRPOConfig(G=args["group"], chunk_size=args["chunk"], mode=MODE))
        gen = torch.Generator().manual_seed(mesh.dp_rank)
        prompt = torch.randint(0, VOCAB_SIZE, (args["prompt"],), generator=gen)
        completions = [torch.randint(0, VOCAB_SIZE, (16,), generator=gen) for _ in range(args["group"])]
        group = trainer.group_from_completions(prompt, completions, torch.rand(args["group"], generator=gen).tolist())
        with step_roles(model, trainer.optimizer) as roles:
            tracker.roles = roles
            trainer.train_step([group])  # AdamW's state and FSDP2's gathered parameters are made here
            tracker.reset_peak()
            with record_to(Path(out) / "collectives"):
                trainer.train_step([group])
    result = {"cp_rank": mesh.cp_rank, "peak": tracker.peak_bytes, "roles": tracker.peak_roles}
    result["parameters"] = sum(p.numel() * p.element_size() for p in model.parameters())  # (the rank's shards)
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def bus_bytes(op: Op) -> float:
    """What one collective or message moves per rank, as NCCL's tests count it (``busbw``)."""
    ranks = len(op.communicator.ranks)
    share = (ranks - 1) / ranks
    tensors = op.outputs if op.kind == "allgather" and op.outputs else op.inputs or op.outputs
    size = sum(math.prod(shape) * getattr(torch, dtype.removeprefix("torch.")).itemsize for shape, dtype in tensors)
    if op.kind == "allgather":
        return size * share if op.outputs else size * (ranks - 1)  # (functional: only the input is recorded)
    if op.kind == "reduce_scatter":
        return size * share
    if op.kind == "allreduce":
        return 2 * size * share
    return float(size)  # broadcast, send, recv


def collective_bytes(log_dir: Path) -> dict[int, dict[str, float]]:
    """Per global rank, the bus bytes of its recorded calls by kind (receives are the peers' sends: not counted)."""
    (world,) = read_logs(log_dir)
    totals: dict[int, dict[str, float]] = {}
    for rank, ops in world.items():
        kinds = totals.setdefault(rank, {})
        for op in ops:
            if op.kind not in ("recv", "barrier"):
                kinds[op.kind] = kinds.get(op.kind, 0.0) + bus_bytes(op)
    return totals


def sharded_step(world: int, args: dict) -> dict:
    """The measured step on ``world`` ranks (``args["mesh"]``: its ``(dp, cp, hsdp)``; dp = 1 x cp = world by
    default) beside the analytic minimum and the plan."""
    dp, cp, hsdp = args.get("mesh", (1, world, False))
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(sharded_worker, args=(world, f"{tmp}/store", tmp, args), nprocs=world, start_method=START)
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(world)]
        sent = collective_bytes(Path(tmp) / "collectives")
    parameters = sum(p.numel() for p in build_model(step_model_config(args)).parameters()) * 4  # fp32
    shard_ranks = cp if hsdp else world
    share = (shard_ranks - 1) / shard_ranks
    planning.NAMED_MODELS["bench-step"] = lambda: step_model_config(args)
    rows = []
    for rank, measured in enumerate(ranks):
        request = planning.PlanRequest(
            model="bench-step", context=args["prompt"], group=args["group"], completion=16, gpus=world, dp=dp, cp=cp,
            hsdp=hsdp, mode=MODE, dtype=torch.float32, engine=EngineConfig(chunk_size=args["chunk"]),
            cp_rank=measured["cp_rank"],
        )  # fmt: skip
        plan = planning.plan_memory(request)
        rows.append({"rank": rank, "sent": sent[rank], "peak": measured["peak"], "roles": measured["roles"],
                     "planned": plan.subtotal, "planned_categories": plan.categories})  # fmt: skip
    minimum = {"allgather": 2 * parameters * share, "reduce_scatter": parameters * share}
    if hsdp:  # the replicas' gradient shards, all-reduced once
        minimum["allreduce"] = 2 * parameters / shard_ranks * (dp - 1) / dp
    return {"cp": cp, "dp": dp, "hsdp": hsdp, "parameter_bytes": parameters, "minimum": minimum, "ranks": rows}


# dp > 1 on 4 ranks: each dp rank gathering for itself (parallel.lanes), and HSDP
MESHES = [(2, 2, False), (2, 2, True)]


def print_mesh(result: dict) -> None:
    """A dp > 1 row: the bytes of the gathers and reductions together (all-to-alls where each dp rank gathers for
    itself; FSDP2's all-gathers and reduce-scatters, and the replicas' all-reduce, with HSDP) beside FSDP's
    minimum, the control messages and the other messages apart."""
    minimum = sum(result["minimum"].values())
    for row in result["ranks"]:
        sent = row["sent"]
        weights = sum(sent.get(k, 0.0) for k in ("allgather", "reduce_scatter", "alltoall"))
        weights += sent.get("allreduce", 0.0) if result["hsdp"] else 0.0
        other = sum(v for k, v in sent.items() if k not in ("allgather", "reduce_scatter", "alltoall", "allreduce"))
        other += 0.0 if result["hsdp"] else sent.get("allreduce", 0.0)  # (lanes: control messages, merges)
        mesh = f"{result['dp']}x{result['cp']}{' hsdp' if result['hsdp'] else ' lanes'}"
        cells = (
            mesh, row["rank"], f"{weights / 2**20:.2f} ({weights / minimum:.1f}x)", f"{other / 2**20:.2f}",
            f"{row['peak'] / 2**20:.2f}", f"{row['planned'] / 2**20:.2f}", f"{row['peak'] / row['planned']:.3f}",
        )  # fmt: skip
        print(" ".join(f"{c:>{w}}" for c, w in zip(cells, MESH_WIDTHS, strict=True)))


MESH_HEADER = ("mesh", "rank", "weights+grads MiB (x min)", "other MiB", "peak MiB", "plan MiB", "peak/plan")
MESH_WIDTHS = (12, 4, 25, 9, 9, 9, 9)


def print_sharded(result: dict) -> None:
    minimum = result["minimum"]
    for row in result["ranks"]:
        sent = row["sent"]
        gathers = sent.get("allgather", 0) / minimum["allgather"]
        reductions = sent.get("reduce_scatter", 0) / minimum["reduce_scatter"]
        others = sum(v for k, v in sent.items() if k not in ("allgather", "reduce_scatter"))
        cells = (
            result["cp"], row["rank"], f"{sent.get('allgather', 0) / 2**20:.2f} ({gathers:.1f}x)",
            f"{sent.get('reduce_scatter', 0) / 2**20:.2f} ({reductions:.1f}x)", f"{others / 2**20:.2f}",
            f"{row['peak'] / 2**20:.2f}", f"{row['planned'] / 2**20:.2f}", f"{row['peak'] / row['planned']:.3f}",
        )  # fmt: skip
        print(" ".join(f"{c:>{w}}" for c, w in zip(cells, SHARDED_WIDTHS, strict=True)))


SHARDED_HEADER = (
    "cp",
    "rank",
    "all-gather MiB (x min)",
    "reduce-scatter MiB",
    "other MiB",
    "peak MiB",
    "plan MiB",
    "peak/plan",
)
SHARDED_WIDTHS = (3, 4, 22, 19, 9, 9, 9, 9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="llama")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--out", type=Path, default=RESULTS / "distributed.json")
    args = parser.parse_args()
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "ranks")}
    print(
        f"{args.family} ({args.layers} layers), prompt {args.prompt}, chunk {args.chunk}, G={args.group}, gloo on CPU"
    )
    header = ("cp", "state/rank x 1/N", "capture", "in rank order", "detached", "exact", "in rank order")
    header += ("sent MiB", "rows/min", "path steps", "walk idle", "capture idle")
    widths = (3, 17, 13, 13, 13, 13, 13, 9, 9, 18, 12, 12)
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)))
    rows: list[dict] = []
    for world in args.ranks:
        row = summarise(world, run(world, settings), rows[0] if rows else None, args.layers)
        rows.append(row)
        speed = [f"{row[w]:.2f}s" + (f" {row[w + '_speedup']:.2f}x" if len(rows) > 1 else "") for w in STEPS]
        ratio = f"{row.get('state_ratio_to_share', 1.0):.3f}"
        rows_min = f"{row['rows_bytes_max'] / row['row_minimum_bytes']:.2f}" if row.get("row_minimum_bytes") else "-"
        path = (
            f"{row['critical_path_steps']:.1f} ({row['wavefront_steps']}|{row['naive_steps']})"
            if "walk_s" in row
            else "-"
        )
        idle = f"{row['idle_max']:.2f} | {row['idle_in_order_max']:.2f}" if "idle_max" in row else "-"
        capture_idle = f"{row['capture_idle']:.2f} | {row['capture_in_order_idle']:.2f}"
        cells = (world, ratio, *speed, f"{row['sent_bytes_max'] / 2**20:.2f}", rows_min, path, idle, capture_idle)
        print(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))
    print(f"\nthe training step (GRPOTrainer, FSDP2 over dp = 1 x cp, AdamW, {MODE}), per rank:")
    print(" ".join(f"{h:>{w}}" for h, w in zip(SHARDED_HEADER, SHARDED_WIDTHS, strict=True)))
    sharded = []
    for world in (w for w in args.ranks if w > 1):
        sharded.append(sharded_step(world, settings))
        print_sharded(sharded[-1])
    meshes = []
    if 4 in args.ranks:
        print("\nthe same step at dp > 1 (each dp rank its own group), per rank:")
        print(" ".join(f"{h:>{w}}" for h, w in zip(MESH_HEADER, MESH_WIDTHS, strict=True)))
        for dp, cp, hsdp in MESHES:
            meshes.append(sharded_step(dp * cp, settings | {"mesh": (dp, cp, hsdp)}))
            print_mesh(meshes[-1])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": settings, "rows": rows, "sharded": sharded, "meshes": meshes}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
