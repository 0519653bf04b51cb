"""Context parallelism (parallel/context.py) on 2 and 4 gloo processes: capture, extend, logits and GRPO gradients
in exact and detached mode equal one process (fp64, tiny models of every family), with shard boundaries inside a
GatedDeltaNet block and DSA's top-k drawing keys from several shards; each rank holds its share of the state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from context_parallel_worker import OVERRIDES, run

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(("world", "shard_size"), [(2, 40), (4, 16)])
def test_sharded_state_gives_the_results_of_one_process(tmp_path: Path, world: int, shard_size: int) -> None:
    mp.start_processes(
        run, args=(world, str(tmp_path / "store"), str(tmp_path), shard_size), nprocs=world, start_method="spawn"
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    assert all(r["many_tensors"] == 0.0 for r in ranks)  # broadcast and point to point of 40 tensors
    for family in OVERRIDES:
        for result in ranks:  # every rank computes the same (replicated) results
            checked = ("logits", "extend", "resumed", "exact", "detached", "short_exact", "replicated_exact")
            for what in (*checked, "shared_turn_exact", "shared_turn_loss"):
                assert result[f"{family}/{what}"] <= 1e-10, (family, what, result[f"{family}/{what}"])
        # compute is sharded: each rank evaluated every layer of its own chunks only, once
        for result in ranks:
            assert result[f"{family}/layer_runs"] == result[f"{family}/layers"] * result[f"{family}/own_chunks"]
        assert sum(r[f"{family}/own_chunks"] for r in ranks) == ranks[0][f"{family}/chunks"]
        for result in ranks:  # the exact walk too: a rank's layer evaluations (its chunks, the shared branches) fall
            # below one process's (every chunk twice): the replicated walk would run more than one process
            assert result[f"{family}/exact_layer_runs"] < result[f"{family}/exact_single_layer_runs"]
            # (EngineConfig.wavefront_walk=False: the replicated walk, every rank recomputing every chunk)
            assert result[f"{family}/replicated_exact_layer_runs"] > result[f"{family}/exact_layer_runs"]
        for result in ranks:  # what the planner counts for the wavefront walk (hybrids add a state per layer)
            planned, kept = result[f"{family}/planned_layer_inputs"], result[f"{family}/layer_inputs"]
            assert planned <= kept <= planned * 1.05 + 65536, (family, planned, kept)
        # the trainer spreads each group's shared context evenly: the tree's root, the prompt's first 60 tokens
        assert ranks[0][f"{family}/fitted_shard"] == -(-60 // world)
        held = [r[f"{family}/growing_bytes"] for r in ranks]
        total, chunk = ranks[0][f"{family}/single_growing_bytes"], ranks[0][f"{family}/chunk_bytes"]
        assert sum(held) == total  # every position's state is stored once, by its owner
        assert max(held) <= max(total / world, shard_size * total / 61) + chunk  # a rank holds its shard (+- a chunk)
