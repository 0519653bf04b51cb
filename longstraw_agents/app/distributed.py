"""A run's place in a ``torchrun`` / ``accelerate launch`` job (``TrainConfig.parallel``).

Who does what:

- every process trains: the dp ranks on their own share of each step's groups, the cp ranks of one dp rank on the
  same groups (their prompt state sharded);
- the first cp rank of each dp rank rolls out that rank's share (its own task seeds and sampling seed) and
  broadcasts the groups to its cp peers;
- exactly one process, global rank 0 (the *writer*), writes the run directory: ``config.json``, the SQLite store
  (WAL does not span machines: the other dp ranks' groups are gathered to it), ``metrics.jsonl`` (a step's record
  covers every dp rank's groups) and the checkpoint's shared files. Every rank runs the warm start (waiting for the
  writer's could outlast the collective timeout) and then takes the writer's weights, so all start GRPO from the
  same policy.

With one process none of this applies and the run is what it always was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from longstraw_agents.app.config import ConfigError, ParallelSpec
from longstraw_agents.parallel import ParallelMesh
from longstraw_agents.parallel.launch import failing_clearly, init_from_env, world_size
from longstraw_agents.trainer import StepMetrics

T = TypeVar("T")


@dataclass
class Ranks:
    """This process's ranks; ``mesh`` is None for a one-process run."""

    mesh: ParallelMesh | None = None
    owns_process_group: bool = False
    timeout_s: float = 0.0

    @classmethod
    def join(cls, spec: ParallelSpec, device_type: str) -> Ranks:
        """Check ``dp * cp`` against the launcher's ``WORLD_SIZE``, join the process group and build the mesh."""
        world = world_size()
        if spec.dp * spec.cp != world:
            raise ConfigError(
                f"parallel.dp ({spec.dp}) x parallel.cp ({spec.cp}) must equal the number of processes "
                f"(WORLD_SIZE={world}); launch with torchrun --nproc-per-node {spec.dp * spec.cp}, or set "
                f"parallel.dp and parallel.cp so that their product is {world}"
            )
        if world == 1:
            return cls()
        owns = init_from_env(spec.timeout_s)
        return cls(ParallelMesh.build(spec.dp, spec.cp, device_type), owns, spec.timeout_s)

    @property
    def rank(self) -> int:
        return 0 if self.mesh is None else dist.get_rank()

    @property
    def dp_rank(self) -> int:
        return 0 if self.mesh is None else self.mesh.dp_rank

    @property
    def dp(self) -> int:
        return 1 if self.mesh is None else self.mesh.mesh["dp"].size()

    @property
    def cp(self) -> int:
        return 1 if self.mesh is None else self.mesh.mesh["cp"].size()

    @property
    def writes(self) -> bool:
        """The one process that writes the run directory and the store."""
        return self.rank == 0

    @property
    def rolls_out(self) -> bool:
        """The first cp rank of each dp rank samples; its cp peers receive the groups."""
        return self.mesh is None or self.mesh.cp_rank == 0

    def share(self, items: Sequence[T]) -> list[T]:
        """This dp rank's share of a step's items (tasks): every dp-th one, starting at its dp rank."""
        return list(items[self.dp_rank :: self.dp])

    def to_cp_peers(self, obj: T) -> T:
        """``obj`` of the first cp rank, on every cp rank of this dp rank."""
        if self.mesh is None or self.cp == 1:
            return obj
        box: list[Any] = [obj]
        dist.broadcast_object_list(box, group_src=0, group=self.mesh.cp_group)
        return box[0]

    def from_writer(self, obj: T) -> T:
        """The writer's ``obj``, on every process."""
        if self.mesh is None:
            return obj
        box: list[Any] = [obj]
        dist.broadcast_object_list(box, src=0)  # all processes, deliberately: a fact of the whole run
        return box[0]

    def to_writer(self, obj: T) -> list[T] | None:
        """Every dp rank's ``obj``, in dp-rank order, on the writer (None elsewhere). Only the first cp rank of each
        dp rank takes part: the writer's dp group is theirs."""
        if self.mesh is None:
            return [obj]
        if not self.rolls_out:
            return None
        gathered: list[Any] = [None] * self.dp if self.writes else []
        dist.gather_object(obj, gathered if self.writes else None, group_dst=0, group=self.mesh.dp_group)
        return gathered if self.writes else None

    def same_weights(self, model: torch.nn.Module) -> None:
        """Give every process the writer's parameters and buffers (after the warm start, which every rank ran: one
        policy for the whole job, not several that might differ in their last bits)."""
        if self.mesh is None:
            return
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)  # all processes, deliberately: the whole job starts from one policy

    def failing_clearly(self, what: Callable[[], str]) -> AbstractContextManager[None]:
        """A rank that dies or hangs inside the block: a ``RankFailure`` on the others (``parallel.launch``)."""
        return contextlib.nullcontext() if self.mesh is None else failing_clearly(what, self.timeout_s)

    def barrier(self) -> None:
        if self.mesh is not None:
            dist.barrier()

    def close(self) -> None:
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()


def merged_step_metrics(parts: Sequence[StepMetrics], groups: Sequence[int], summed: bool) -> StepMetrics:
    """One step's metrics over every dp rank's groups (``groups``: each rank's group count) from the ranks' own.

    Rewards' mean and (population) std pool every member; token counts are summed and peak bytes maxed; the loss is
    the step's: the group-weighted mean of the ranks' (group normalisation) or their sum (batch normalisation, where
    each rank's loss is its share of one batch loss); the KL, a mean, is group-weighted; seconds is the slowest
    rank's; gradient norm and learning rate are the same on every rank; ``iterations`` are the first rank's."""
    first = parts[0]
    total = sum(groups)  # online groups all have group_size members: weighting by groups weighs by members
    weights = [n / total for n in groups]
    reward_mean = sum(w * p.reward_mean for w, p in zip(weights, parts, strict=True))
    second = sum(w * (p.reward_std**2 + p.reward_mean**2) for w, p in zip(weights, parts, strict=True))
    peaks = [p.peak_bytes for p in parts if p.peak_bytes is not None]
    return dataclasses.replace(
        first,
        loss=_combine([p.loss for p in parts], weights, summed),
        reward_mean=reward_mean,
        reward_std=math.sqrt(max(second - reward_mean**2, 0.0)),
        loss_tokens=sum(p.loss_tokens for p in parts),
        unique_tokens=sum(p.unique_tokens for p in parts),
        forward_tokens=sum(p.forward_tokens for p in parts),
        seconds=max(p.seconds for p in parts),
        peak_bytes=max(peaks) if peaks else None,
        kl=None if any(p.kl is None for p in parts) else _combine([p.kl or 0.0 for p in parts], weights, False),
    )


def _combine(values: Sequence[float], weights: Sequence[float], summed: bool) -> float:
    return sum(values) if summed else sum(w * v for w, v in zip(weights, values, strict=True))
