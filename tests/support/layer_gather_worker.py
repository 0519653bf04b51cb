"""One rank of ``LayerGather``'s failure test (tests/parallel/test_fsdp.py): a block that raises after its layer
accumulated a gradient. Writes whether any reduction ran, what the layer and its shards hold afterwards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from data_parallel_worker import join

from longstraw_agents.models.presets import tiny_model
from longstraw_agents.parallel import fsdp
from longstraw_agents.parallel.fsdp import LayerGather


def run(rank: int, world: int, port: int, out_dir: str, spec: dict[str, Any]) -> None:
    _, mesh = join(rank, world, port, spec)
    model = tiny_model("llama", dtype=torch.float64, seed=0)
    mesh.fully_shard(model)
    reductions: list[str] = []
    reduce = fsdp._reduce_into_shards

    def recording(*args: Any) -> None:
        reductions.append("reduce")
        reduce(*args)

    fsdp._reduce_into_shards = recording  # (this forked process's own module)
    gather = LayerGather(model, replicas=world)
    layer: Any = model.model.layers[0]
    try:
        with gather.gathered(0):
            sum(p.sum() for p in layer.parameters()).backward()
            raise RuntimeError("a failure inside the block")
    except RuntimeError:
        pass
    with gather.gathered(1):  # a block that ends normally still reduces
        sum(p.sum() for p in model.model.layers[1].parameters()).backward()
    result = {
        "reductions": reductions,
        "whole_grads": [p.grad is not None for p in gather._whole[0].values()],
        "shard_grads": [p.grad is not None for p in layer.parameters()],
        "gathered_now": sorted(k for k in gather._gathered if k is not None),
    }
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()
