"""The device mesh of a training job: ``dp`` (groups of a step split across ranks, gradients averaged over it) by
``cp`` (one prompt's state sharded across ranks), from ``torch.distributed.device_mesh``. Process groups are taken
from it explicitly — never the default world group by accident.

On several nodes one dimension spans them and the other stays inside each (``mesh_ranks``): by default dp spans the
nodes and a dp rank's cp ranks share one, since cp ranks exchange state rows at every layer (NVLink's bandwidth)
while dp ranks reduce gradients once a step (the network's)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from longstraw_agents.parallel.context import ContextParallel, PairChannels
from longstraw_agents.parallel.experts import ExpertExchange, check_experts_divide, experts_sharded
from longstraw_agents.parallel.fsdp import (
    HSDP_WITHOUT_CP,
    HSDP_WITHOUT_DP,
    LayerGather,
    WeightSharding,
    is_sharded,
    shard_model,
)
from longstraw_agents.parallel.lanes import LaneGather, LaneGroups

AcrossNodes = Literal["dp", "cp"]


def mesh_ranks(dp: int, cp: int, across_nodes: AcrossNodes = "dp") -> torch.Tensor:
    """The global ranks of the ``(dp, cp)`` mesh. Launchers number a node's processes consecutively, so the dimension
    whose groups are runs of consecutive ranks stays inside a node: cp's when dp spans the nodes (row-major, as
    ``init_device_mesh`` lays it out), dp's when cp does."""
    ranks = torch.arange(dp * cp, dtype=torch.int, device="cpu")  # whatever the default device
    return ranks.reshape(dp, cp) if across_nodes == "dp" else ranks.reshape(cp, dp).T


def inside_a_node(across_nodes: AcrossNodes) -> AcrossNodes:
    """The dimension whose groups stay inside a node when ``across_nodes`` spans them."""
    return "cp" if across_nodes == "dp" else "dp"


def straddles_nodes(dp: int, cp: int, across_nodes: AcrossNodes, per_node: int) -> bool:
    """Whether nodes of ``per_node`` processes cut a group of the dimension meant to stay inside a node: its groups
    may span whole nodes (cp larger than a node) or a node hold whole groups, but a group across a node boundary
    would send its frequent messages over the network."""
    size = cp if inside_a_node(across_nodes) == "cp" else dp
    return dp * cp > per_node and per_node % size != 0 and size % per_node != 0


@dataclass
class ParallelMesh:
    """``hsdp``: FSDP2 shards over each dp rank's cp ranks and replicates over dp (hybrid sharding) instead of
    sharding over every rank: a GPU holds 1/cp of the model, its gradient and optimizer state instead of 1/(dp·cp),
    and in exchange the engine gathers a layer at a time at dp > 1 too (no rank holds the whole model or its whole
    gradient), the replicas' gradients summed once at the step's end."""

    mesh: DeviceMesh
    hsdp: bool = False

    @classmethod
    def build(
        cls, dp: int, cp: int, device_type: str = "cpu", across_nodes: AcrossNodes = "dp", hsdp: bool = False
    ) -> ParallelMesh:
        """The ``(dp, cp)`` mesh over the initialised default process group (its size must be ``dp * cp``), laid out
        by ``mesh_ranks`` (``across_nodes``: the dimension that spans the nodes)."""
        world = dist.get_world_size()
        if dp * cp != world:
            raise ValueError(f"dp ({dp}) x cp ({cp}) must equal the number of processes ({world})")
        if hsdp and cp == 1:
            raise ValueError(HSDP_WITHOUT_CP)
        if hsdp and dp == 1:
            raise ValueError(HSDP_WITHOUT_DP)
        return cls(DeviceMesh(device_type, mesh_ranks(dp, cp, across_nodes), mesh_dim_names=("dp", "cp")), hsdp)

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("dp")

    @property
    def cp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("cp")

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    @property
    def cp_rank(self) -> int:
        return self.mesh.get_local_rank("cp")

    def context_parallel(self, host_staged: bool = False) -> ContextParallel:
        """The engine's state shards over this mesh's ``cp`` ranks (``host_staged``: ``GroupTransport``'s)."""
        return ContextParallel(self.cp_group, self.cp_channels, host_staged)

    @cached_property
    def cp_channels(self) -> PairChannels:
        """A communicator per ordered pair of cp ranks, for the wavefront's messages (made for every cp group)."""
        return PairChannels.over(self.mesh.mesh.tolist())  # rows of the (dp, cp) mesh: the cp groups

    @cached_property
    def shard_mesh(self) -> DeviceMesh:
        """The mesh parameters, gradients and optimizer state are sharded over: all ranks (dp x cp flattened), or
        with ``hsdp`` the (dp, cp) mesh itself, which FSDP2 reads as replicate over dp, shard over cp."""
        return self.mesh if self.hsdp else self.mesh["dp", "cp"]._flatten("dp_cp")

    def fully_shard(
        self,
        model: nn.Module,
        compute_dtype: torch.dtype | None = None,
        offload: bool = False,
        expert_parallel: bool = False,
    ) -> None:
        """Shard ``model``'s parameters with FSDP2 (``parallel.fsdp``) over ``shard_mesh``: each rank holds
        1/(dp·cp) of every parameter, of its gradient and of its optimizer state (1/cp with ``hsdp``).
        ``compute_dtype``: mixed precision (the shards stay the master weights; gathers cast them). ``offload``
        (``parallel.offload``): the shards, their gradients and the optimizer's state on the host.
        ``expert_parallel`` (``parallel.experts``): each cp rank holds whole experts of every MoE layer, never
        gathered (dp = 1, or with ``hsdp``: the experts are cut over the cp ranks)."""
        if expert_parallel:
            self._check_expert_parallel()
            check_experts_divide(model, self.mesh["cp"].size())
        shard_model(model, self.shard_mesh, compute_dtype, offload, experts=expert_parallel)

    def _check_expert_parallel(self) -> None:
        if self.mesh["dp"].size() > 1 and not self.hsdp:
            raise ValueError(
                "expert parallelism runs over a dp rank's cp ranks, which compute in lockstep: at dp > 1 it needs "
                "hsdp (sharded over dp x cp, each dp rank's MoE calls would not line up with the others')"
            )

    def sharding(self, model: nn.Module, role: str = "policy") -> WeightSharding:
        """How a step reaches ``model``'s weights on this mesh: sharded, the engine gathers a decoder layer at a time.
        At dp = 1 every rank of the shard mesh is a cp rank, computing in lockstep (``LayerGather``); so are each
        dp rank's with ``hsdp`` (a gather spans them only). Sharded over dp > 1 ranks, whose groups differ in shape
        (their trees, so their numbers of layer passes), each dp rank gathers on a communicator of its own, served
        by the others (``LaneGather``; ``role`` names the model's: the policy's and the reference's serve at
        once)."""
        replicas = self.mesh["cp"].size()
        if not is_sharded(model):
            return WeightSharding(model, None, replicas)
        dp = self.mesh["dp"].size()
        experts = None
        if experts_sharded(model):
            self._check_expert_parallel()
            experts = ExpertExchange.over(model, self.cp_group)
        if dp == 1 or self.hsdp:
            gather = LayerGather(model, replicas, experts=experts)
            return WeightSharding(model, gather, replicas, replicated=self.hsdp)
        lanes = LaneGroups.over(self.shard_mesh, self.mesh.mesh.tolist(), role)
        return WeightSharding(model, LaneGather(model, replicas, lanes), replicas)
