"""FSDP2 over every rank of a (dp, cp) mesh with dp > 1, a decoder layer at a time: the dp ranks as lanes.

Each dp rank — a lane: its cp ranks, which compute in lockstep — trains its own groups, whose trees differ in shape,
so one lane gathers and reduces its layers a different number of times, in a different order, than another. A
gather or a reduction over the whole shard mesh is a collective, which every rank must post in the same order:
posted by each lane from its own schedule, they would not match. ``LaneGather`` gives every lane a communicator of
its own over the whole shard mesh (``LaneGroups``). A lane's ranks post its gathers and reductions there as its
schedule reaches them, as ``LayerGather`` does at dp = 1; every other rank serves them, from a thread per lane, in
the order the lane posts them — each announced by a control message (what comes: a gather or a reduction of which
unit, and which parameters had a gradient on the lane's ranks).

The data moves by all-to-all, not all-gather and reduce-scatter: a serving rank sends its shard of a gathered layer
to the lane's ranks and receives none of it, and receives only its own rows of a reduced gradient (summed over the
lane's ranks where it adds them into its shard). A lane's gather moves what a gather over the shard mesh moves into
its ranks, and nothing into the others'. What a served lane costs a rank: its shard of the layer, copied once per
lane rank for the send (1/dp of the layer), and its rows of a gradient.

A rank adds its own lane's reductions into its shards' gradients as they complete; the rows another lane reduced
to it are summed on the host by the thread serving that lane, in that lane's order, and added at the block's end,
lane after lane — every sum is taken in one order whatever the threads' timing (a resumed run gives the same
bits), and the device holds none of them meanwhile. A parameter no rank had a gradient for in any reduction of the
block, and none before it, keeps none (an expert no token chose), as in one process.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

from ..memory import host_placement
from .fsdp import LayerGather, add_into_shard, taken_gradient
from .fsdp_state import AllGather, lazy_init, packed_shard, unit_params

_log = logging.getLogger(__name__)
GATHER, REDUCE, PARTIAL, DONE = 1, 2, 3, 4  # what a control message announces
_HEADER = 2  # a control message: [kind, unit + 1 (0: the root), had a gradient per parameter...]


@dataclass(frozen=True)
class LaneGroups:
    """A communicator per lane (dp rank), each over every rank of the shard mesh, in the shard mesh's rank order:
    ``groups[l]`` carries lane ``l``'s gathers and reductions, ``members[l]`` its ranks (as ranks of that
    communicator), ``lane`` is this rank's."""

    groups: list[dist.ProcessGroup]
    members: list[list[int]]
    lane: int
    rank: int  # this rank's rank in every one of them (the shard mesh's)
    size: int

    _made: ClassVar[dict[tuple[Any, ...], LaneGroups]] = {}

    @classmethod
    def over(cls, shard_mesh: DeviceMesh, lanes: Sequence[Sequence[int]], role: str) -> LaneGroups:
        """The lane groups of ``role`` (one set per model: the policy's and the reference's serve at once) for the
        lanes ``lanes`` (global ranks, each lane's in its cp order) of ``shard_mesh`` (one dimension: dp x cp
        flattened). Made by every process of the job, in the same order (``new_group`` is a collective call)."""
        ranks = sorted(int(r) for r in shard_mesh.mesh.flatten().tolist())
        key = (id(dist.group.WORLD), role, tuple(ranks), tuple(tuple(int(r) for r in lane) for lane in lanes))
        if key not in cls._made:
            groups = [dist.new_group(ranks) for _ in lanes]
            me = dist.get_rank()
            mine = next(lane for lane, members in enumerate(key[3]) if me in members)
            # a communicator ranks its members in global rank order, and so does FSDP2's shard group, whose rank is a
            # shard's index (whatever the mesh's layout): the all-to-alls' splits follow it
            shard_rank = shard_mesh.get_group().rank()
            if ranks.index(me) != shard_rank:
                raise ValueError(f"rank {me} is rank {shard_rank} of FSDP2's shard group, not its rank-order place")
            members = [[ranks.index(r) for r in lane] for lane in key[3]]
            for group in groups:  # set up now, in one order on every process (NCCL's are made at a first use, and
                # the serving threads' first uses would come in any order)
                dist.all_reduce(torch.zeros(1, device=shard_mesh.device_type), group=group)
            cls._made[key] = cls(groups, members, mine, shard_rank, len(ranks))
        return cls._made[key]


class _LaneAllGather(AllGather):
    """FSDP2's all-gather of one unit (``FSDPModule.set_custom_all_gather``) for a rank of a lane: the control
    message, then this rank's shard to each of the lane's ranks, and every rank's into ``output`` (the layout of an
    all-gather over the shard mesh)."""

    def __init__(self, gather: LaneGather, layer: int | None):
        self.gather, self.layer = gather, layer

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        lanes = self.gather.lanes
        self.gather._post_control(GATHER, self.layer)
        return _send_shard(input_tensor, lanes, lanes.lane, output_tensor, async_op)


class LaneGather(LayerGather):
    """``LayerGather`` over a model sharded over every rank of a mesh with dp > 1 (``lanes``): this rank's lane
    gathers and reduces on its own communicator, and this rank serves the other lanes' from threads while a block of
    the root unit is open (``gathered(None)``: the step, a block of sampling) — every lane opens one, and leaves it
    once its own work is done and every other lane's has been served."""

    def __init__(self, model: nn.Module, replicas: int, lanes: LaneGroups, window: int | None = None):
        super().__init__(model, replicas, window)
        self.lanes = lanes
        units = [None, *range(len(self.units))]
        self._params = {layer: unit_params(self._unit(layer)) for layer in units}
        # each unit's shards by name, taken while every unit is sharded (the same objects however a unit is held
        # later: the serving threads read them while the step may hold the unit whole)
        self._shards = {layer: _sharded(self._registered(layer)) for layer in units}
        self._width = _HEADER + max(len(shards) for shards in self._shards.values())
        for layer in self._params:
            unit: Any = self._unit(layer)  # an FSDPModule
            unit.set_custom_all_gather(_LaneAllGather(self, layer))
        self._controls: list[tuple[dist.Work, Tensor, list[DTensor]]] = []  # posted here this block
        # lane -> id(shard) -> (shard, the rows that lane reduced to this rank, summed on the host: its thread's own)
        self._served: dict[int, dict[int, tuple[DTensor, Tensor]]] = {}
        self._before: dict[int, bool] = {}  # id(shard) -> whether it had a gradient when the block began
        self._anyone: dict[int, DTensor] = {}  # id(shard) -> shard, for those some rank had a gradient for
        self._lock = threading.Lock()
        self._servers: list[threading.Thread] = []
        self._failures: list[BaseException] = []
        self._failed: BaseException | None = None  # a block that raised: the communicators are out of step
        self._device = self._params[None][0].device  # where gathers and reductions compute (shards may be offloaded)

    @contextlib.contextmanager
    def gathered(self, layer: int | None, partial: bool = False, reduce: bool = True) -> Iterator[None]:
        if layer is not None or None in self._blocks:
            with super().gathered(layer, partial, reduce):
                yield
            return
        if self._failed is not None:
            raise RuntimeError(
                "a block of this model's weights failed earlier; its dp ranks' communicators are out of step"
            ) from self._failed
        self._serve_other_lanes()
        try:
            with super().gathered(None):
                yield
        except BaseException as failure:  # (the other lanes stop as for any failed rank: when it exits)
            self._failed = failure
            raise
        self._end_of_block()

    # --- this lane's reductions -------------------------------------------------------------------------------
    def _reduce(self, layer: int | None, whole: dict[str, nn.Parameter], partial: bool) -> None:
        """Layer ``layer``'s gradient to the shards: each parameter's rows to the rank holding them (all of them
        with ``partial``, zeros where this rank has none, asynchronously; else the ones with a gradient, every lane
        rank holding the same, waited for here)."""
        shards = self._shards[layer]
        had = [whole[name].grad is not None for name in shards]
        if not (partial or any(had)):  # (a frozen model's, or no gradient reached it: the lane's ranks agree)
            return
        self._post_control(PARTIAL if partial else REDUCE, layer, had, list(shards.values()))
        flight = []
        for (name, shard), has in zip(shards.items(), had, strict=True):
            param = whole[name]
            if not (has or partial):
                continue
            # (replicated: the lane's cp ranks each hold the whole gradient; partial: each its share)
            grad = taken_gradient(param, shard.dtype, 1 if partial else self.replicas)
            flight.append(_send_rows(grad, shard, self.lanes, self.lanes.lane, self._device, async_op=True))
        if partial:
            self._in_flight(flight)
        else:
            self._land(flight)

    def settle(self) -> None:
        """Wait for this lane's reductions in flight (which parameters keep no gradient is settled at the block's
        end, once every lane's reductions are in)."""
        self._land_all()

    def _land(self, flight: list[tuple[DTensor, Tensor, dist.Work]]) -> None:
        for shard, received, work in flight:
            work.wait()
            self._add(shard, _summed_rows(received, shard, len(self.lanes.members[self.lanes.lane])))

    def _add(self, shard: DTensor, rows: Tensor) -> None:
        add_into_shard(shard, rows, self.host)

    # --- control ----------------------------------------------------------------------------------------------
    def _post_control(
        self, kind: int, layer: int | None, had: Sequence[bool] = (), shards: Sequence[DTensor] = ()
    ) -> dist.Work:
        """Announce this lane's next operation on its communicator (every lane rank posts the same; the others'
        threads read it). With a reduction, which parameters had a gradient here: the maximum over the lane's ranks
        is which had one anywhere."""
        message = torch.zeros(self._width, dtype=torch.int64)
        message[0], message[1] = kind, 0 if layer is None else layer + 1
        message[_HEADER : _HEADER + len(had)] = torch.tensor(list(had), dtype=torch.int64)
        group = self.lanes.groups[self.lanes.lane]
        work = dist.all_reduce(message, op=dist.ReduceOp.MAX, group=group, async_op=True)
        if shards:  # (a reduction's: which parameters someone had a gradient for, read at the block's end)
            self._controls.append((work, message, list(shards)))
        return work

    def _end_of_block(self) -> None:
        """This lane is done: tell the others' threads, wait for this rank's to finish serving theirs, add what
        they received, and settle which parameters keep no gradient."""
        self._post_control(DONE, None).wait()  # (every rank has read it before this one may leave the job)
        for server in self._servers:
            server.join()
        self._servers.clear()
        if self._failures:
            self._failed, self._failures = self._failures[0], []
            raise RuntimeError("serving another lane's gathers and reductions failed") from self._failed
        self.settle()
        # the other lanes' rows last, lane after lane: every sum in one order whatever the timing (a resumed run
        # gives the same bits)
        for lane in sorted(self._served):
            for shard, rows in self._served[lane].values():
                self._add(shard, rows if self.host else rows.to(shard.to_local().device))
        self._served.clear()
        for work, message, shards in self._controls:
            work.wait()
            for shard, had in zip(shards, message[_HEADER:].tolist(), strict=False):
                if had:
                    self._anyone[id(shard)] = shard
        self._controls.clear()
        for layer_shards in self._shards.values():
            for shard in layer_shards.values():  # (zeros added for a partial reduction nobody had a gradient for)
                if not self._before[id(shard)] and id(shard) not in self._anyone:
                    shard.grad = None
        self._anyone.clear()

    # --- serving the other lanes ------------------------------------------------------------------------------
    def _serve_other_lanes(self) -> None:
        lazy_init(self.model)  # (a thread may serve a unit before this rank gathers one)
        self._before = {id(s): s.grad is not None for shards in self._shards.values() for s in shards.values()}
        modes = _get_current_dispatch_mode_stack()  # what watches the step's ops (a memory tracker) watches these
        ready = torch.cuda.Event() if self._device.type == "cuda" else None
        if ready is not None:
            ready.record()  # (the step's stream: what it wrote before the block, the threads' streams wait for)
        for lane in range(len(self.lanes.members)):
            if lane != self.lanes.lane:
                args = (lane, modes, ready)
                server = threading.Thread(target=self._serve, args=args, daemon=True, name=f"lane{lane}")
                server.start()
                self._servers.append(server)

    def _serve(self, lane: int, modes: Sequence[Any], ready: Any) -> None:
        """Serve lane ``lane`` until it is done. On a GPU on a stream of its own: on the step's, its work would
        queue behind the step's waits for its own lane's collectives, which may wait for this thread."""
        with contextlib.ExitStack() as stack:
            if ready is not None:
                torch.cuda.set_device(self._device)
                stream = torch.cuda.Stream(self._device)
                stream.wait_event(ready)
                stack.enter_context(torch.cuda.stream(stream))
            self._serving(lane, modes)

    def _serving(self, lane: int, modes: Sequence[Any]) -> None:
        group = self.lanes.groups[lane]
        for mode in modes:
            _push_mode(mode)
        try:
            with torch.no_grad():
                while True:
                    message = torch.zeros(self._width, dtype=torch.int64)
                    dist.all_reduce(message, op=dist.ReduceOp.MAX, group=group)
                    kind, unit, *had = message.tolist()
                    layer = None if unit == 0 else unit - 1
                    if kind == DONE:
                        return
                    if kind == GATHER:
                        _send_shard(packed_shard(self._params[layer]), self.lanes, lane, None, False)
                    else:
                        self._serve_reduction(lane, layer, had, partial=kind == PARTIAL)
        except BaseException as failure:  # (raised on the step's thread at the block's end; logged now, since the
            # lane it served waits for it until the process group's timeout)
            _log.exception("serving lane %d failed", lane)
            self._failures.append(failure)
        finally:
            for _ in modes:
                _pop_mode()

    def _serve_reduction(self, lane: int, layer: int | None, had: Sequence[int], partial: bool) -> None:
        """Receive this rank's rows of lane ``lane``'s reduction and sum them on the host, per shard."""
        sums = self._served.setdefault(lane, {})
        for (_, shard), has in zip(self._shards[layer].items(), had, strict=False):
            if not (has or partial):
                continue
            _, received, _ = _send_rows(None, shard, self.lanes, lane, self._device, async_op=False)
            rows = _summed_rows(received, shard, len(self.lanes.members[lane]))
            with host_placement():  # (summed in the order the lane reduced them; the device keeps none)
                on_host = rows.to("cpu", copy=True)
                if id(shard) in sums:
                    sums[id(shard)][1].add_(on_host)
                else:
                    sums[id(shard)] = (shard, on_host)
            if has:
                with self._lock:
                    self._anyone[id(shard)] = shard


def _sharded(parameters: dict[str, nn.Parameter]) -> dict[str, DTensor]:
    return {name: p for name, p in parameters.items() if isinstance(p, DTensor)}


def _send_shard(shard: Tensor, lanes: LaneGroups, lane: int, output: Tensor | None, async_op: bool) -> Any:
    """This rank's packed ``shard`` to each rank of ``lane``, on that lane's communicator; a rank of the lane gets
    every rank's into ``output`` (rank order; ``shard`` is its own slot there, so it is copied to be sent),
    another passes None and gets nothing."""
    members, n = lanes.members[lane], shard.numel()
    sends = [n if r in members else 0 for r in range(lanes.size)]
    receives = [n if output is not None else 0] * lanes.size
    into = output if output is not None else shard.new_empty(0)
    data = shard if output is None and len(members) == 1 else shard.repeat(len(members))
    return dist.all_to_all_single(into, data, receives, sends, group=lanes.groups[lane], async_op=async_op)


def _row_counts(shard: DTensor, size: int) -> list[int]:
    """Elements of each rank's rows of ``shard``'s parameter (dim 0 cut as ``torch.chunk`` cuts it)."""
    rows, per_row = shard.shape[0], math.prod(shard.shape[1:])
    step = -(-rows // size)
    return [max(0, min(step, rows - r * step)) * per_row for r in range(size)]


def _send_rows(
    grad: Tensor | None, shard: DTensor, lanes: LaneGroups, lane: int, device: torch.device, async_op: bool
) -> tuple[DTensor, Tensor, Any]:
    """A lane rank's gradient of ``shard``'s parameter, each rank's rows to it (dim 0 in rank order: the gradient
    as it lies), on lane ``lane``'s communicator; every rank receives its rows from each of the lane's ranks
    (``grad`` None on a rank of another lane)."""
    counts = _row_counts(shard, lanes.size)
    members = lanes.members[lane]
    mine = counts[lanes.rank]
    received = torch.empty(mine * len(members), dtype=shard.dtype, device=device)  # (offloaded shards: not theirs)
    sends = counts if grad is not None else [0] * lanes.size
    receives = [mine if r in members else 0 for r in range(lanes.size)]
    data = grad.contiguous().reshape(-1) if grad is not None else received.new_empty(0)
    work = dist.all_to_all_single(received, data, receives, sends, group=lanes.groups[lane], async_op=async_op)
    return shard, received, work


def _summed_rows(received: Tensor, shard: DTensor, senders: int) -> Tensor:
    """This rank's rows of a gradient as received from ``senders`` lane ranks, summed, in the shard's shape."""
    parts = received.reshape(senders, -1)
    return (parts[0] if senders == 1 else parts.sum(0)).reshape(shard.to_local().shape)
