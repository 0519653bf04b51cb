"""Context parallelism on CPU (gloo): per-rank state bytes, bytes each rank sends per GRPO step, and step time, for
cp = 1, 2, 4 — printed as ratios to cp = 1 (issue 14's bench; its schedule is the first one: replicated compute,
sharded state, so the time ratio shows the collectives' cost, not a speed-up).

Per-rank state: target <= 1.05 / N of one process's. Communication: each rank sends its attention partials
``(out, lse)`` once per layer and chunk (forward), its blocks' ``dq`` once per layer and chunk (backward), DSA
candidates, and — exact mode — a chunk's waiting state gradient from its owner; the analytic minimum printed beside
it is the partials' size (what any scheme that keeps K/V in place must move).

    python -m bench.distributed [--prompt 4096] [--family llama]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.parallel import ParallelMesh
from longstraw_agents.trainer import grpo_backward

RESULTS = Path(__file__).parent / "results"


def worker(rank: int, world: int, store: str, out: str, args: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    mesh = ParallelMesh.build(dp=1, cp=world)
    model = tiny_model(args["family"], vocab_size=2048)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 2048, (args["prompt"],), generator=gen)
    completions = [torch.randint(0, 2048, (16,), generator=gen) for _ in range(args["group"])]
    rewards = torch.rand(args["group"], generator=gen).tolist()
    shards = mesh.context_parallel(args["prompt"], args["chunk"]) if world > 1 else None
    engine = Engine(model, EngineConfig(chunk_size=args["chunk"]), shards=shards)
    state = engine.capture(prompt)
    recurrent = {id(r): r.nbytes for c in state.chunks for r in c.recurrent if r is not None}
    growing = state.nbytes - sum(recurrent.values())
    del state
    if shards is not None:
        shards.sent_bytes = dict.fromkeys(shards.sent_bytes, 0)
    start = time.perf_counter()
    grpo_backward(engine, prompt, completions, rewards, args["mode"], track_memory=False)
    seconds = time.perf_counter() - start
    sent = shards.sent_bytes if shards is not None else {}
    torch.save({"growing": growing, "seconds": seconds, "sent": sent}, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def run(world: int, args: dict) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(world, f"{tmp}/store", tmp, args), nprocs=world, start_method="spawn")
        return [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="llama")
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--mode", default="exact")
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--out", type=Path, default=RESULTS / "distributed.json")
    args = parser.parse_args()
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "ranks")}
    print(f"{args.family}, prompt {args.prompt}, chunk {args.chunk}, G={args.group}, {args.mode} mode, gloo on CPU")
    header = ("cp", "state/rank (max) KiB", "x 1/N of cp=1", "sent/rank MiB", "of it partials", "step s")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (3, 21, 14, 14, 15, 8), strict=True)))
    rows, base = [], None
    for world in args.ranks:
        ranks = run(world, settings)
        state = max(r["growing"] for r in ranks)
        sent = max(sum(r["sent"].values()) for r in ranks)
        partials = max(r["sent"].get("partials", 0) for r in ranks)
        seconds = max(r["seconds"] for r in ranks)
        base = base or {"state": state, "seconds": seconds}
        ratio = state / (base["state"] / world)
        rows.append({"cp": world, "state_bytes_max": state, "ratio_to_share": ratio, "sent_bytes_max": sent,
                     "partials_bytes": partials, "sent": [r["sent"] for r in ranks], "seconds": seconds})  # fmt: skip
        mib = (sent / 2**20, partials / 2**20)
        print(f"{world:>3} {state / 1024:>21.1f} {ratio:>14.3f} {mib[0]:>14.2f} {mib[1]:>15.2f} {seconds:>8.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": settings, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
