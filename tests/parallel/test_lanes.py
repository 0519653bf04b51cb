"""``parallel.lanes``: FSDP2 over every rank of a dp 2 x cp 2 mesh, each dp rank gathering and reducing a layer at
a time on its own schedule, served by the others (gloo CPU processes)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from lanes_worker import run
from launches import free_port

pytestmark = pytest.mark.distributed


def test_dp_ranks_gather_and_reduce_on_schedules_of_their_own(tmp_path) -> None:
    """dp rank 0 gathers layer 0 three times and reduces its whole gradient each time (its cp ranks hold the same
    one), then reduces its cp ranks' shares of one weight of layer 1 (1 and 2 times the value); dp rank 1 gathers
    only layer 1, once, for another weight. Every rank ends with the sums one process gets — 3x the value for layer
    0 and q_proj, 1x for o_proj — and no gradient for what no rank had one for; none ever held more than the
    prefetch window and the layer it computed."""
    mp.start_processes(run, args=(4, free_port(), str(tmp_path), {"dp": 2, "cp": 2}), nprocs=4, start_method="fork")
    for rank in range(4):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        grads, values = result["grads"], result["values"]
        for name, value in values.items():
            if name.startswith("model.layers.0."):
                expected = 3 * value
            elif name == "model.layers.1.self_attn.q_proj.weight":
                expected = 3 * value
            elif name == "model.layers.1.self_attn.o_proj.weight":
                expected = value
            else:
                assert grads[name] is None, (rank, name)
                continue
            torch.testing.assert_close(grads[name], expected, rtol=1e-12, atol=0, msg=f"rank {rank}: {name}")
        assert 1 <= result["most_gathered"] <= 2, rank
