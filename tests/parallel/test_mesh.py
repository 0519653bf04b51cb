"""parallel/mesh.py: how the ``(dp, cp)`` mesh lays global ranks over nodes. Launchers number a node's processes
consecutively, so the dimension laid out on consecutive ranks stays inside a node; the mesh is built over torch's
fake process group (one process playing each rank in turn: the groups each rank gets, without processes)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from longstraw_agents.parallel.mesh import AcrossNodes, ParallelMesh, mesh_ranks, straddles_nodes


def test_dp_across_nodes_keeps_each_dp_ranks_cp_ranks_consecutive() -> None:
    assert mesh_ranks(2, 4, "dp").tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]  # nodes of 4: one dp rank each


def test_cp_across_nodes_keeps_the_dp_ranks_consecutive() -> None:
    assert mesh_ranks(2, 4, "cp").tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]  # nodes of 2: one cp rank of each dp rank


@pytest.mark.parametrize(
    ("dp", "cp", "across", "per_node", "straddles"),
    [
        (4, 2, "dp", 4, False),  # a node holds two whole cp groups
        (2, 8, "dp", 4, False),  # a cp group spans two whole nodes
        (2, 3, "dp", 4, True),  # ranks 3 and 4-5 of a cp group are on two nodes
        (3, 2, "cp", 4, True),  # dp groups of 3 on nodes of 4
        (2, 3, "dp", 6, False),  # one node: nothing to straddle
    ],
)
def test_a_group_meant_to_stay_inside_a_node_may_not_straddle_two(dp, cp, across, per_node, straddles) -> None:
    assert straddles_nodes(dp, cp, across, per_node) is straddles


@pytest.mark.parametrize(("across", "cp_groups"), [("dp", [[0, 1], [2, 3]]), ("cp", [[0, 2], [1, 3]])])
def test_each_rank_gets_the_groups_of_the_layout(across: AcrossNodes, cp_groups: list[list[int]]) -> None:
    """2 nodes of 2 processes, dp 2 x cp 2: each rank's cp and dp groups, and the FSDP shard group over all."""
    dp_groups = [list(column) for column in zip(*cp_groups, strict=True)]
    for rank in range(4):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
        try:
            mesh = ParallelMesh.build(2, 2, "cpu", across)
            assert mesh.mesh.mesh.tolist() == mesh_ranks(2, 2, across).tolist()
            (cp_group,) = [g for g in cp_groups if rank in g]
            (dp_group,) = [g for g in dp_groups if rank in g]
            assert dist.get_process_group_ranks(mesh.cp_group) == cp_group
            assert dist.get_process_group_ranks(mesh.dp_group) == dp_group
            assert (mesh.cp_rank, mesh.dp_rank) == (cp_group.index(rank), dp_group.index(rank))
            assert sorted(mesh.shard_mesh.mesh.tolist()) == [0, 1, 2, 3]
        finally:
            dist.destroy_process_group()
