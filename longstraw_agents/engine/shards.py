"""Context parallelism as the engine sees it: two protocols, implemented by ``longstraw_agents.parallel``.

- ``Ownership`` says which rank stores each new position's state (recorded per chunk in the state);
- ``Transport`` carries the messages between the ranks: the collectives of replicated compute (``attention.Shards``:
  attention partials, top-k candidates, sums) and the point-to-point messages and broadcasts of the sharded
  schedules (a capture, exact mode's wavefront walk).

The engine holds no parallelism code beyond calling these (DESIGN.md, "Who may import whom").
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from longstraw_agents.attention import Shards
from longstraw_agents.models.base import PastBlock
from longstraw_agents.state import Block


class Ownership(Protocol):
    """Which rank of the group stores each new position's state (attention/MLA rows, DSA index keys: its owner
    only). The engine records every chunk's owner in its ``ChunkRecord``, so a state carries its own placement and
    siblings may be placed differently."""

    rank: int
    size: int

    def cut(self, n: int, balanced: bool = True) -> list[tuple[int, int, int]]:
        """A sharded extend (a capture) of ``n`` positions: ``(lo, hi, owner)`` offsets of contiguous runs in
        position order, each rank's positions about ``n / N``. ``balanced``: each rank's attention work about
        even too (a rank may get several runs); otherwise one run per rank in rank order."""
        ...

    def assign(self, held: Sequence[int], lengths: Sequence[int]) -> list[int]:
        """A replicated extend (a turn, a branch) of pieces of ``lengths`` positions after a path whose ranks hold
        ``held`` positions each: the owner of each piece (every rank of the group gets the same answer to the same
        calls in the same order; an answer may depend on the earlier calls')."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What the answers depend on of the earlier calls (a checkpoint's: a resumed run places as the
        uninterrupted one did, so that its partials merge in the same order)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Transport(Shards, Protocol):
    """Messages between the ranks of the group: ``Shards``' collectives plus point-to-point messages and broadcasts
    of tensors of any number, shapes and dtypes. Every collective is called by every rank in the same order."""

    def stage(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """``tensors`` as ``send`` would send them (host copies, where the transport stages messages through host
        memory): a message for several ranks, staged once."""
        ...

    def send(self, tensors: Sequence[Tensor], dst: int, tag: int, kind: str) -> None:
        """Start sending ``tensors`` to rank ``dst`` (``flush`` waits for the sends); ``kind`` names the payload.
        The tensors must not change until then."""
        ...

    def recv(self, src: int, tag: int, device: torch.device, on_host: int = 0) -> tuple[Tensor, ...]:
        """What rank ``src`` sent with ``tag``, on ``device`` but its first ``on_host`` tensors (metadata read on
        the host, e.g. ``outgoing_runs``' header: read from a device it would wait for the device)."""
        ...

    def flush(self, kind: str | None = None, keep: int = 0) -> None:
        """Wait for this rank's sends (of ``kind``; all but the last ``keep`` messages)."""
        ...

    def broadcast(self, tensor: Tensor, src: int) -> Tensor:
        """``tensor`` as rank ``src`` has it, on every rank (in place)."""
        ...

    def broadcast_tensors(self, tensors: Sequence[Tensor] | None, src: int, device: torch.device) -> tuple[Tensor, ...]:
        """Rank ``src``'s ``tensors`` on every rank (the others pass None)."""
        ...


class StateShards(Protocol):
    """What ``Engine(shards=...)`` takes: who stores which positions, and how the ranks talk."""

    @property
    def ownership(self) -> Ownership: ...

    @property
    def transport(self) -> Transport: ...


@dataclass(frozen=True)
class ChunkOwners:
    """Who stores each of a sequence of chunks: ``owners[j]`` for chunk j, ``mine`` the indices of this rank's,
    ``computing`` every rank owning any (ascending)."""

    owners: list[int]
    mine: list[int]
    computing: list[int]

    @classmethod
    def of(cls, owners: Sequence[int], rank: int) -> ChunkOwners:
        """The chunks of ``owners`` as rank ``rank`` sees them."""
        return cls(list(owners), [j for j, owner in enumerate(owners) if owner == rank], sorted(set(owners)))


@dataclass(frozen=True)
class Run:
    """A stretch of a sharded extend's consecutive chunks on one rank (the cut's runs, one rank's consecutive ones
    joined): at each layer, a cell of the wavefront — what one rank computes in one go."""

    index: int  # in position order among the extend's runs
    owner: int
    chunks: tuple[int, ...]  # indices of the extend's chunks


def runs_of(owners: Sequence[int]) -> list[Run]:
    """The runs of a sharded extend whose chunk j is stored (and computed) by ``owners[j]``."""
    runs: list[Run] = []
    for j, owner in enumerate(owners):
        if runs and runs[-1].owner == owner:
            runs[-1] = Run(runs[-1].index, owner, (*runs[-1].chunks, j))
        else:
            runs.append(Run(len(runs), owner, (j,)))
    return runs


def wavefront_cells(runs: Sequence[Run], layers: int, rank: int) -> list[tuple[Run, int]]:
    """Rank ``rank``'s cells ``(run, layer)`` in the order it computes them: by wavefront step (run index + layer;
    a cell reads the layer of the runs before it and its own run's layer below, both a step earlier), then by run.
    With one run per rank in rank order that is layer by layer; with two (a balanced cut) a rank's later run
    trails its first by the difference of their indices."""
    cells = [(run, i) for run in runs if run.owner == rank for i in range(layers)]
    return sorted(cells, key=lambda cell: (cell[0].index + cell[1], cell[0].index))


def walk_cells(runs: Sequence[Run], layers: int, rank: int) -> list[tuple[Run, int]]:
    """Rank ``rank``'s cells ``(run, layer)`` of exact mode's wavefront walk, in the order it walks them: by reverse
    wavefront step (a cell needs its run's layer above and the later runs' same layer, both a step earlier), then
    the later run first. In rank order that is layer by layer from the last; balanced, a rank's later run leads its
    first by the difference of their indices."""
    cells = [(run, i) for run in runs if run.owner == rank for i in range(layers)]
    return sorted(cells, key=lambda cell: (walk_step(runs, cell[0], cell[1], layers), -cell[0].index))


@dataclass(frozen=True)
class SegmentRecompute:
    """Exact mode's balanced walk over sharded weights, at wavefront step ``step`` (the first run reaching the
    segment's top): every rank recomputes the inputs of layers ``first + 1 .. top`` for each of its runs, gathering
    layers ``first .. top - 1`` one at a time."""

    step: int
    first: int
    top: int
    order = 1  # (within a step: after the reductions, before the gathers)


@dataclass(frozen=True)
class WaveGather:
    """Start layer ``layer``'s gather for the cells of wave ``wave`` (``waves``) of a balanced walk over sharded
    weights, at the step its first-walked run reaches the layer."""

    step: int
    layer: int
    wave: int
    order = 2


@dataclass(frozen=True)
class WaveReduction:
    """Reduce the gradient the cells of wave ``wave`` gave layer ``layer`` (each rank's share), the step after the
    wave's last-walked run walked it."""

    step: int
    layer: int
    wave: int
    order = 0


WalkEvent = SegmentRecompute | WaveGather | WaveReduction


def walk_events(runs: Sequence[Run], layers: int, every: int) -> list[WalkEvent]:
    """Exact mode's balanced walk over sharded weights (FSDP2: every gather and reduction a collective over the
    ranks): what every rank does besides its cells, in the one order every rank follows — by step, then reductions,
    a segment's recomputation, gathers (the later wave first). A wave's ranks reach a layer at different steps and
    the waves overlap, so each rank's own order of blocks differs; this order is everyone's. A rank holds a layer
    from its wave's gather to its cell (never across the steps between its runs), keeps the gradient of its cell on
    the whole copy until the wave's reduction, and recomputes every one of its runs' segments when the first run
    enters it (a later run holds those inputs until it gets there): a recomputation then never gathers a layer
    whose gather for a wave is in flight, and a wave's gather of a layer starts once the wave before reduced it."""
    last = len(runs) - 1
    events: list[WalkEvent] = []
    for first in range(0, layers, every):
        top = min(first + every, layers) - 1
        events.append(SegmentRecompute(layers - 1 - top, first, top))  # (a segment of one layer: its kept input)
    for w, wave in enumerate(waves(runs)):
        lead, tail = last - wave[-1].index, last - wave[0].index  # (its first- and last-walked runs)
        for i in range(layers):
            events.append(WaveGather(lead + layers - 1 - i, i, w))
            events.append(WaveReduction(tail + layers - i, i, w))
    return sorted(events, key=lambda e: (e.step, e.order, -getattr(e, "wave", 0)))


def walk_schedule(runs: Sequence[Run], layers: int, every: int, rank: int) -> list[tuple[Run, int] | WalkEvent]:
    """What ``rank`` does in a paced walk, in order: its cells (``walk_cells``), each after the events
    (``walk_events``) due by its step, and the events left at the end."""
    events = collections.deque(walk_events(runs, layers, every))
    schedule: list[tuple[Run, int] | WalkEvent] = []
    for run, i in walk_cells(runs, layers, rank):
        step = walk_step(runs, run, i, layers)
        while events and events[0].step <= step:
            schedule.append(events.popleft())
        schedule.append((run, i))
    return [*schedule, *events]


def walk_step(runs: Sequence[Run], run: Run, layer: int, layers: int) -> int:
    """The reverse wavefront step of cell ``(run, layer)`` of exact mode's walk."""
    return len(runs) - 1 - run.index + layers - 1 - layer


@dataclass(frozen=True)
class Gather:
    """One gather of a decoder layer's weights in a sharded capture: for the cells of one wave of runs (``waves``),
    due at the wavefront step of the first of them."""

    layer: int
    wave: int
    due: int


def waves(runs: Sequence[Run]) -> list[list[Run]]:
    """A sharded capture's runs in waves of consecutive runs, each holding at most one run of a rank: in rank order
    one wave; a balanced cut two (the ranks' first runs, then their later ones). A layer is gathered once per wave,
    so that no rank holds one across the wavefront steps between its runs."""
    grouped: list[list[Run]] = []
    for run in runs:
        if not grouped or any(other.owner == run.owner for other in grouped[-1]):
            grouped.append([])
        grouped[-1].append(run)
    return grouped


def capture_waves(owners: Sequence[int]) -> int:
    """How many times a sharded capture whose chunks are stored by ``owners`` gathers each layer (its ``waves``)."""
    return len(waves(runs_of(owners)))


def capture_gathers(runs: Sequence[Run], layers: int) -> list[Gather]:
    """Every gather of a sharded capture, in the order every rank posts them: by the step they are due, an earlier
    layer's later wave first (a rank that does not compute it frees it before the next is posted)."""
    gathers = [Gather(i, w, wave[0].index + i) for w, wave in enumerate(waves(runs)) for i in range(layers)]
    return sorted(gathers, key=lambda g: (g.due, -g.wave))


def in_position_order(blocks: list[PastBlock]) -> list[PastBlock]:
    """Past blocks as the mixers read them: by position (DSA's top-k breaks ties by it), whichever ranks sent them."""
    return sorted(blocks, key=lambda block: block.start)


RUNS_HEADER = 1  # a runs message's tensors read on the host: its header


def outgoing_runs(blocks: Sequence[tuple[int, Block]]) -> list[Tensor]:
    """Positioned ``blocks`` as a message: an int64 ``[runs, 2]`` tensor on the host of the (first position,
    length) of each run of consecutive positions in one arena, then each run's tensors — views of the arena (no
    copy; ``Transport.stage`` copies them to the host where messages travel through it). A rank's rows need not be
    contiguous in positions (its share of a capture and of later extends) and DSA selects keys by position;
    ``incoming_runs`` reads it."""
    runs: list[tuple[int, Block]] = []
    for position, block in blocks:
        if runs and runs[-1][0] + runs[-1][1].length == position and block.follows(runs[-1][1]):
            first, joined = runs[-1]
            runs[-1] = (first, Block(joined.arena, joined.lo, block.hi))
        else:
            runs.append((position, block))
    header = torch.tensor([[position, block.length] for position, block in runs], dtype=torch.int64).reshape(-1, 2)
    return [header, *(t.detach() for _, block in runs for t in block.views())]


def incoming_runs(message: Sequence[Tensor]) -> list[tuple[int, tuple[Tensor, ...]]]:
    """What ``outgoing_runs`` sent: ``(first position, rows)`` per run (received with ``on_host=RUNS_HEADER``)."""
    runs = message[0].tolist()
    per = (len(message) - 1) // max(len(runs), 1)  # the state's tensors
    return [(position, tuple(message[1 + k * per : 1 + (k + 1) * per])) for k, (position, _) in enumerate(runs)]
