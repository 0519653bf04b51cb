"""Expert parallelism on CPU (gloo): the prompt's capture of the MoE family with each cp rank holding 1/cp of every
MoE layer's experts (``parallel.experts``), two ways, beside one process holding them all:

- replicated (the default, ``parallel.expert_dispatch: false``): every rank computes every chunk, attending to the
  positions it stores (partials merged), its experts' share of every token, the shares added by an all-reduce per
  MoE call;
- dispatched (``parallel.expert_dispatch: true``): the capture sharded (each rank its own chunks, a wavefront over
  the ranks), every MoE call a round of all-to-alls sending each token to its experts' ranks and the outputs back.

Printed per cp: the capture's wall seconds (the slowest rank) and its speed-up over one process, and the bytes each
rank sent per capture by kind (all-reduces counted twice, as NCCL's bus bytes; all-to-alls, the rows the sharded
capture sends, FSDP2's gathers of the rest of each layer). Equal to one process either way (the suite checks it:
tests/trainer/test_data_parallel.py). On this machine's 2 cores, cp = 4 runs four processes on two cores: its
times include the oversubscription.

    python -m bench.experts [--prompt 4096] [--hidden 128] [--layers 4]
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

from bench.distributed import START, collective_bytes
from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.models.presets import TINY_PRESETS, build_model
from longstraw_agents.parallel import ParallelMesh
from longstraw_agents.parallel.discipline import record_to

RESULTS = Path(__file__).parent / "results"
VOCAB = 2048
WAYS = {"replicated": False, "dispatched": True}  # way -> EngineConfig.sharded_extends


def _model(args: dict) -> torch.nn.Module:
    config = TINY_PRESETS["glm_moe_dsa"](vocab_size=VOCAB, hidden=args["hidden"], layers=args["layers"])
    return build_model(config, dtype=torch.float32, seed=0)


def _prompt(args: dict) -> torch.Tensor:
    return torch.randint(0, VOCAB, (args["prompt"],), generator=torch.Generator().manual_seed(0))


def one_process(args: dict) -> float:
    """The capture's seconds in one process (one thread, as each rank runs), after a warm-up."""
    torch.set_num_threads(1)
    engine, prompt = Engine(_model(args), EngineConfig(chunk_size=args["chunk"])), _prompt(args)
    engine.capture(prompt)
    began = time.perf_counter()
    engine.capture(prompt)
    return time.perf_counter() - began


def worker(rank: int, world: int, store: str, out: str, args: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    mesh = ParallelMesh.build(dp=1, cp=world)
    model = _model(args)
    mesh.fully_shard(model, expert_parallel=True)
    weights = mesh.sharding(model).weights
    prompt, result = _prompt(args), {}
    for way, sharded in WAYS.items():
        config = EngineConfig(chunk_size=args["chunk"], sharded_extends=sharded)
        engine = Engine(model, config, shards=mesh.context_parallel(), weights=weights)
        with weights.gathered(None):  # (the root unit: embeddings, final norm, LM head)
            engine.capture(prompt)  # warm-up
            dist.barrier()
            began = time.perf_counter()
            with record_to(Path(out) / way):
                engine.capture(prompt)
            dist.barrier()
            result[way] = time.perf_counter() - began
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def run(world: int, args: dict) -> dict:
    """Per way: the slowest rank's capture seconds and each rank's bytes sent by kind."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(world, f"{tmp}/store", tmp, args), nprocs=world, start_method=START)
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(world)]
        sent = {way: collective_bytes(Path(tmp) / way) for way in WAYS}
    return {way: {"seconds": max(r[way] for r in ranks), "sent": sent[way]} for way in WAYS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--out", type=Path, default=RESULTS / "experts.json")
    args = parser.parse_args()
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "ranks")}
    alone = one_process(settings)
    print(f"glm_moe_dsa (hidden {args.hidden}, {args.layers} layers, 8 experts top-2), prompt {args.prompt}, chunk "
          f"{args.chunk}, gloo on CPU; one process: {alone:.2f} s")  # fmt: skip
    print(f"{'cp':>3} {'way':>11} {'capture':>16} {'sent MiB per rank, by kind (max over ranks)':>46}")
    rows = []
    for world in args.ranks:
        result = run(world, settings)
        for way, measured in result.items():
            kinds = sorted({kind for sent in measured["sent"].values() for kind in sent})
            most = {kind: max(sent.get(kind, 0.0) for sent in measured["sent"].values()) for kind in kinds}
            shown = ", ".join(f"{kind} {nbytes / 2**20:.2f}" for kind, nbytes in most.items())
            seconds = measured["seconds"]
            print(f"{world:>3} {way:>11} {seconds:>7.2f}s {alone / seconds:>6.2f}x  {shown}")
            rows.append({"cp": world, "way": way, "seconds": seconds, "speedup": alone / seconds, "sent": most})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": settings, "one_process_s": alone, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
