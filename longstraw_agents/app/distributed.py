"""A run's place in a ``torchrun`` / ``accelerate launch`` job (``TrainConfig.parallel``).

Who does what:

- every process trains: the dp ranks on their own share of each step's groups, the cp ranks of one dp rank on the
  same groups (their prompt state sharded);
- the first cp rank of each dp rank rolls out that rank's share (its own task seeds and sampling seed: it runs the
  environments, its cp peers computing the engine's share with it, ``parallel.sampling``) and broadcasts the groups
  to its cp peers;
- exactly one process, global rank 0 (the *writer*), writes the run directory: ``config.json``, the SQLite store
  (WAL does not span machines: the other dp ranks' groups are gathered to it), ``metrics.jsonl`` (a step's record
  covers every dp rank's groups) and the checkpoint's shared files. Every rank runs the warm start (waiting for the
  writer's could outlast the collective timeout) and then takes the writer's weights, so all start GRPO from the
  same policy.

On several nodes (``torchrun --nnodes``, ``accelerate launch --num_machines``) the same holds with global ranks;
``parallel.across_nodes`` says which mesh dimension spans the nodes (``parallel.mesh``). Every process must see the
run directory, one shared filesystem: checked before any step (``Ranks.share_directory``).

With one process none of this applies and the run is what it always was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import secrets
import tempfile
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from longstraw_agents.app.config import ConfigError, ParallelSpec
from longstraw_agents.parallel import ParallelMesh
from longstraw_agents.parallel.launch import (
    Place,
    Roster,
    Timeouts,
    bound_collectives,
    describe,
    failing_clearly,
    init_from_env,
    processes_per_node,
    world_size,
)
from longstraw_agents.parallel.mesh import inside_a_node, mesh_ranks, straddles_nodes
from longstraw_agents.trainer import StepMetrics

T = TypeVar("T")


@dataclass
class Ranks:
    """This process's ranks; ``mesh`` is None for a one-process run. ``roster``: every process of the job and where
    it runs, when this process joined the job (None when the process group already existed)."""

    mesh: ParallelMesh | None = None
    roster: Roster | None = None
    collective_timeout_s: float = 0.0

    @classmethod
    def join(cls, spec: ParallelSpec, device_type: str) -> Ranks:
        """Check the layout against the launcher's processes (``check_layout``), join the process group (every
        node's processes, or a ``RankFailure`` naming those that did not join within ``parallel.timeout_s``), start
        this process's heartbeat and build the mesh."""
        check_layout(spec)
        if world_size() == 1:
            return cls()
        roster = init_from_env(Timeouts(spec.timeout_s, spec.heartbeat_every_s, spec.collective_timeout_s))
        with failing_clearly("building the device mesh", spec.collective_timeout_s, roster):
            mesh = ParallelMesh.build(spec.dp, spec.cp, device_type, spec.across_nodes, spec.hsdp)
        return cls(mesh, roster, spec.collective_timeout_s)

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
        """The first cp rank of each dp rank runs the rollouts (its cp peers follow its sampler, and receive the
        groups)."""
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
        """A rank that dies or hangs inside the block: a ``RankFailure`` on the others naming the processes that
        are gone (``parallel.launch``)."""
        if self.mesh is None:
            return contextlib.nullcontext()
        return failing_clearly(what, self.collective_timeout_s, self.roster)

    def bound_collectives(self) -> None:
        """Every process group made so far times out after ``parallel.collective_timeout_s`` (torch gives the
        groups made after the default one its own default): called once the run's groups are made."""
        if self.mesh is not None:
            bound_collectives(self.collective_timeout_s)

    def share_directory(self, directory: Path) -> None:
        """Make the run directory (the writer) and check that every process sees that same directory and may write
        in it, before any step: every rank writes its checkpoint shards there, so on several nodes it must be one
        shared filesystem mounted at the same path. A ``ConfigError`` on every process names the nodes that do not
        see it (the writer removes the directory again if it made it)."""
        made = self.writes and not directory.exists()
        if self.writes:
            directory.mkdir(parents=True, exist_ok=True)
        if self.mesh is None:
            return
        mark = directory / SHARED_MARK
        token = secrets.token_hex(8) if self.writes else ""
        if self.writes:
            mark.write_text(token)
        token, writers = self.from_writer((token, str(directory.resolve())))
        problem = directory_problem(directory, token)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (Place.here(), problem))  # all processes: the whole job needs the directory
        if self.writes:
            mark.unlink()
        failed = [(place, text) for place, text in everyone if text is not None]
        if not failed:
            return
        if made:
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise ConfigError(
            f"output_dir {directory} must be one directory that every node sees (a shared filesystem mounted at the "
            f"same path: every rank writes its checkpoint shards into it), but {len(failed)} of the {len(everyone)} "
            f"processes do not see rank 0's {writers}: "
            + "; ".join(f"{describe(places)}: {text}" for text, places in _by_problem(failed))
        )

    def barrier(self) -> None:
        if self.mesh is not None:
            dist.barrier()

    def close(self) -> None:
        """Leave the job: this process's heartbeat stops (marked as left: the others do not take it for dead) and
        its process group is destroyed."""
        if self.roster is None:
            return
        self.roster.close()
        if dist.is_initialized():
            dist.destroy_process_group()


SHARED_MARK = ".longstraw-shared"
"""A file the writer puts in the run directory at start (holding a random token) for every process to find."""


def directory_problem(directory: Path, token: str) -> str | None:
    """Why this process does not see the writer's run ``directory`` (whose ``SHARED_MARK`` holds ``token``) or may
    not write in it; None when it does."""
    where = directory.resolve()
    if not where.is_dir():
        return f"{where} does not exist there"
    try:
        found = (where / SHARED_MARK).read_text()
    except FileNotFoundError:
        found = None
    except OSError as err:
        return f"cannot read {where}: {err.strerror}"
    if found != token:
        return f"{where} is another directory there (without the mark rank 0 just wrote into its own)"
    try:
        with tempfile.NamedTemporaryFile(dir=where, prefix=".longstraw-write-check-"):
            pass
    except OSError as err:
        return f"cannot write in {where}: {err.strerror}"
    return None


def _by_problem(failed: Sequence[tuple[Place, str]]) -> list[tuple[str, list[Place]]]:
    """The processes with each problem (a node's processes share theirs), in the order of their first rank."""
    grouped: dict[str, list[Place]] = {}
    for place, text in failed:
        grouped.setdefault(text, []).append(place)
    return list(grouped.items())


def check_layout(spec: ParallelSpec) -> None:
    """``parallel.dp * parallel.cp`` is the launcher's number of processes (``WORLD_SIZE``; 1 without a launcher),
    and the mesh's groups that stay inside a node fit its nodes (``LOCAL_WORLD_SIZE`` processes each): a
    ``ConfigError`` naming the settings otherwise. ``train`` checks it before joining, ``train --check`` too."""
    world = world_size()
    if spec.dp * spec.cp != world:
        launcher = ", without a launcher" if world == 1 else ""
        raise ConfigError(
            f"parallel.dp ({spec.dp}) x parallel.cp ({spec.cp}) must equal the number of processes "
            f"(WORLD_SIZE={world}{launcher}); launch with torchrun --nproc-per-node {spec.dp * spec.cp}, or set "
            f"parallel.dp and parallel.cp so that their product is {world}"
        )
    if world > 1:
        _check_nodes(spec, processes_per_node())


def describe_layout(spec: ParallelSpec) -> str:
    """The run's processes, mesh, sharding and timeouts as ``train --check`` shows them (on the launch
    ``check_layout`` passed)."""
    world = spec.dp * spec.cp
    if world == 1:
        return "one process (no launcher)"
    per_node = processes_per_node()
    nodes = f"{world // per_node} nodes of {per_node}" if per_node < world else "one node"
    across = f", {spec.across_nodes} across the nodes" if per_node < world else ""
    mesh = mesh_ranks(spec.dp, spec.cp, spec.across_nodes).tolist()
    if not spec.fsdp:
        weights = "weights whole on every process"
    elif spec.hsdp:
        weights = f"FSDP2 over each dp rank's {spec.cp} cp ranks, replicated over dp (hsdp)"
    else:
        weights = f"FSDP2 over all {world} ranks"
    return (
        f"dp {spec.dp} x cp {spec.cp} = {world} processes on {nodes}; mesh (a row per dp rank: its cp ranks) "
        f"{mesh}{across}; {weights}; a process without a heartbeat for {spec.timeout_s:g} s (one every "
        f"{spec.heartbeat_every_s:g} s) is dead, a collective waits up to {spec.collective_timeout_s:g} s"
    )


def _check_nodes(spec: ParallelSpec, per_node: int) -> None:
    """The mesh's groups that stay inside a node (``parallel.across_nodes``) fit the nodes."""
    if straddles_nodes(spec.dp, spec.cp, spec.across_nodes, per_node):
        inside = inside_a_node(spec.across_nodes)
        size = getattr(spec, inside)
        raise ConfigError(
            f"parallel.{inside} ({size}) does not fit nodes of {per_node} processes (LOCAL_WORLD_SIZE): with "
            f"parallel.across_nodes={spec.across_nodes} each {inside} group must stay inside a node (or span whole "
            f"nodes); make parallel.{inside} divide the processes per node, or launch {size} (or a multiple) per node"
        )


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
        sequence_tokens=sum(p.sequence_tokens for p in parts),
        forward_tokens=sum(p.forward_tokens for p in parts),
        seconds=max(p.seconds for p in parts),
        peak_bytes=max(peaks) if peaks else None,
        kl=None if any(p.kl is None for p in parts) else _combine([p.kl or 0.0 for p in parts], weights, False),
    )


def _combine(values: Sequence[float], weights: Sequence[float], summed: bool) -> float:
    return sum(values) if summed else sum(w * v for w, v in zip(weights, values, strict=True))
