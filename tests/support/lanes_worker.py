"""One rank of ``LaneGather``'s test (tests/parallel/test_lanes.py): dp 2 x cp 2, the two dp ranks (lanes) running
schedules of different shapes inside one block of the root unit. Writes each parameter's gradient after the block
(whole, or None), and the most layers this rank held whole at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from data_parallel_worker import join
from torch.distributed.tensor import DTensor

from longstraw_agents.models.presets import tiny_model
from longstraw_agents.parallel.lanes import LaneGather


def _half_square(params: list[torch.nn.Parameter], scale: float = 1.0) -> None:
    """A backward giving each of ``params`` the gradient ``scale`` x its value."""
    (scale * sum((p * p).sum() for p in params) / 2).backward()


def run(rank: int, world: int, port: int, out_dir: str, spec: dict[str, Any]) -> None:
    _, mesh = join(rank, world, port, spec)
    model = tiny_model("llama", dtype=torch.float64, seed=0)
    mesh.fully_shard(model)
    gather = mesh.sharding(model).weights
    assert isinstance(gather, LaneGather)
    layers: Any = model.model.layers
    with gather.gathered(None):
        if mesh.dp_rank == 0:
            for _ in range(3):  # layer 0 three times, each cp rank holding the group's whole gradient
                with gather.gathered(0):
                    _half_square(list(layers[0].parameters()))
            with gather.gathered(1, partial=True):  # each cp rank its share of q_proj's gradient: 1 and 2 times
                _half_square([layers[1].self_attn.q_proj.weight], scale=mesh.cp_rank + 1)
            gather.settle()
        else:
            with gather.gathered(1):  # once, o_proj only; nothing of layer 0
                _half_square([layers[1].self_attn.o_proj.weight])
    grads = {}
    for name, param in model.named_parameters():  # (every rank gathers every gradient: a collective)
        grad = param.grad
        grads[name] = None if grad is None else (grad.full_tensor() if isinstance(grad, DTensor) else grad).clone()
    values = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }
    result = {"grads": grads, "values": values, "most_gathered": gather.most_gathered}
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()
