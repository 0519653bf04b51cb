"""Agent-shaped scale, scaled down: the README's target — a group of G = 8 members sharing 8K tokens, each growing
its own history to 1M tokens over 200 turns, on 8 GPUs — at 1/1000 of the length (8 shared tokens, 1,000-token
histories of 200 turns: a 4-token tool output and a 1-token answer each), measured on this CPU as ``longstraw
train`` runs a step (``GRPOTrainer``, FSDP2 over dp = 1 x cp ranks, AdamW, gloo), per rank beside the plan for the
same configuration and cp rank (``longstraw plan --history --turns``), for cp = 1, 2, 4 and both modes:

- peak/plan: each rank's measured peak (a ``MemoryTracker`` over the rank's whole process, from the model's
  construction on; the second step's) over the plan's (tests/test_planner_distributed.py holds both modes to 10 %
  on a smaller agent group);
- state max/mean: the captured state the ranks held at most, the largest over the mean (each member's history is
  spread over the ranks: a turn's pieces to the rank holding the least of the path);
- step s: the second step's wall time (the slowest rank; cp = 4 runs four processes on two cores).

    python -m bench.agent_scale [--ranks 1 2 4] [--modes detached exact]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from longstraw_agents import plan as planning
from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.memory import MemoryTracker
from longstraw_agents.models.presets import TINY_PRESETS, build_model
from longstraw_agents.parallel import ParallelMesh, Placement, parallelize
from longstraw_agents.parallel.roles import step_roles
from longstraw_agents.segmenter import Member
from longstraw_agents.trainer import GRPOConfig, GRPOTrainer
from longstraw_agents.trainer.group import Group, make_group

RESULTS = Path(__file__).parent / "results"
START = "spawn" if torch.cuda.is_initialized() else "fork"
# 1/1000 of the target: 8,192 shared tokens -> 8; 1M-token histories over 200 turns -> 1,000 (4 observed + 1 answer)
SHAPE = {"shared": 8, "history": 1000, "turns": 200, "answer": 1, "group": 8}
MODEL = {"layers": 2, "hidden": 64, "vocab_size": 256}
CHUNK = 64


def agent_members(
    prompt: torch.Tensor, history: int, turns: int, answer: int, group: int, vocab: int, gen: torch.Generator
) -> list[Member]:
    """``group`` members that share ``prompt`` and part at once, each growing a history of ``history`` tokens over
    ``turns`` turns: a tool output, then an ``answer``-token answer with loss."""
    turn, members = history // turns, []
    for k in range(group):
        own = torch.randint(0, vocab, (history,), generator=gen)
        own[0] = k  # the members part at once
        answers = (torch.arange(history) % turn) >= turn - answer
        mask = torch.cat([torch.zeros(len(prompt), dtype=torch.bool), answers])
        members.append(Member(torch.cat([prompt, own]).numpy(), mask.numpy()))
    return members


def agent_group(trainer: GRPOTrainer, shape: dict[str, int], seed: int) -> Group:
    """The shape's members (``agent_members``) after ``shared`` random tokens, with random rewards."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, MODEL["vocab_size"], (shape["shared"],), generator=gen)
    members = agent_members(
        prompt, shape["history"], shape["turns"], shape["answer"], shape["group"], MODEL["vocab_size"], gen
    )
    rewards = torch.rand(shape["group"], generator=gen).tolist()
    return make_group(members, rewards, trainer.config.loss)


def worker(rank: int, world: int, store: str, out: str, mode: str) -> None:
    """One rank: two steps on one agent group, the second measured (its peak from the model's construction on)."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    mesh = ParallelMesh.build(dp=1, cp=world) if world > 1 else None
    with MemoryTracker() as tracker:
        model = build_model(TINY_PRESETS["llama"](**MODEL), dtype=torch.float32, seed=0)
        policy: torch.nn.Module | Engine | Placement = model
        if mesh is not None:
            engine = Engine(model, EngineConfig(chunk_size=CHUNK), shards=mesh.context_parallel())
            policy = parallelize(engine, mesh=mesh, fsdp=True)
        config = GRPOConfig(G=SHAPE["group"], chunk_size=CHUNK, mode=mode)
        trainer = GRPOTrainer(policy, config)
        group = agent_group(trainer, SHAPE, seed=0)
        with step_roles(model, trainer.optimizer) as roles:
            tracker.roles = roles
            trainer.train_step([group])  # AdamW's state and FSDP2's gathered parameters are made here
            tracker.reset_peak()
            dist.barrier()
            began = time.perf_counter()
            trainer.train_step([group])
            dist.barrier()
            seconds = time.perf_counter() - began
    result = {"cp_rank": mesh.cp_rank if mesh is not None else 0, "peak": tracker.peak_bytes, "seconds": seconds}
    result |= {"state": tracker.role_peaks.get("captured state", 0), "roles": tracker.peak_roles}
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def plan(world: int, mode: str, cp_rank: int) -> planning.Plan:
    planning.NAMED_MODELS["bench-agent"] = lambda: TINY_PRESETS["llama"](**MODEL)
    request = planning.PlanRequest(
        model="bench-agent", context=SHAPE["shared"], group=SHAPE["group"], completion=SHAPE["answer"],
        history=SHAPE["history"], turns=SHAPE["turns"], gpus=world, cp=world, mode=mode, dtype=torch.float32,
        engine=EngineConfig(chunk_size=CHUNK), cp_rank=cp_rank,
    )  # fmt: skip
    return planning.plan_memory(request)


def measure(world: int, mode: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(world, f"{tmp}/store", tmp, mode), nprocs=world, start_method=START)
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(world)]
    for measured in ranks:
        planned = plan(world, mode, measured["cp_rank"])
        measured["planned"], measured["planned_categories"] = planned.subtotal, planned.categories
    states = [r["state"] for r in ranks]
    return {
        "cp": world,
        "mode": mode,
        "ranks": ranks,
        "peak_over_plan": [r["peak"] / r["planned"] for r in ranks],
        "state_max_over_mean": max(states) / (sum(states) / len(states)),
        "seconds": max(r["seconds"] for r in ranks),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--modes", nargs="+", default=["detached", "exact"], choices=["detached", "exact"])
    parser.add_argument(
        "--turns", type=int, default=SHAPE["turns"],
        help="turns of the 1,000-token histories (200: the target's; each is an extend and a replay of collectives "
        "per layer, slow on CPU: cp = 2 takes ~4 minutes a detached step)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS / "agent_scale.json")
    args = parser.parse_args()
    SHAPE["turns"] = args.turns  # (the workers are forked: they see it)
    rows = []
    print(f"{'mode':>9} {'cp':>3} {'peak/plan per rank':>26} {'state max/mean':>15} {'step s':>7}")
    for mode in args.modes:
        for world in args.ranks:
            row = measure(world, mode)
            rows.append(row)
            ratios = " ".join(f"{r:.3f}" for r in row["peak_over_plan"])
            print(f"{mode:>9} {world:>3} {ratios:>26} {row['state_max_over_mean']:>15.3f} {row['seconds']:>7.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"shape": SHAPE, "model": MODEL, "chunk": CHUNK, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
