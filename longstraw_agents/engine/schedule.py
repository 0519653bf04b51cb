"""The sharded schedules' rules, written once: how a sharded extend is cut over the cp ranks (``cut_runs``), its runs
(``runs_of``), the cells each rank computes in wavefront order (``wavefront_cells``; exact mode's walk back,
``walk_cells``), the waves a layer is gathered once per (``waves``), a capture's gathers (``capture_gathers``) and
a paced walk's events (``walk_events``, ``walk_schedule``).

The engine runs them (``sharded_capture``, ``wavefront``); the planner and the time model count with them
(``capture_layers_whole``, ``rows_read``, ``walk_holds``: what a rank holds at once, simulated over the schedule
itself, O(cp · layers)), so no plan restates a rule in a closed form of its own.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Sequence
from dataclasses import dataclass


def cut_runs(n: int, ranks: int, balanced: bool = True) -> list[tuple[int, int, int]]:
    """A sharded extend of ``n`` positions over ``ranks`` ranks: ``(lo, hi, owner)`` runs in position order, each
    rank ``n / ranks`` positions (within one; not rounded to chunks: a prompt of fewer chunks than ranks uses every
    rank). ``balanced``: cut in ``2 ranks`` parts, rank r computing the r-th and the (2 ranks - 1 - r)-th (as
    ring-flash-attn's zigzag and torch's context-parallel load balancer place them; the middle two are the last
    rank's, one run), so that every rank's attention work is about even; otherwise one part per rank in rank
    order."""
    parts = 2 * ranks if balanced else ranks
    bounds = [k * n // parts for k in range(parts + 1)]
    if not balanced:  # (the first ranks when some get nothing)
        spans = [(lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False) if hi > lo]
        return [(lo, hi, owner) for owner, (lo, hi) in enumerate(spans)]
    runs: list[tuple[int, int, int]] = []
    for k in range(parts):
        lo, hi, owner = bounds[k], bounds[k + 1], min(k, parts - 1 - k)
        if hi == lo:
            continue
        if runs and runs[-1][2] == owner:
            runs[-1] = (runs[-1][0], hi, owner)
        else:
            runs.append((lo, hi, owner))
    return runs


def shards_extend(n: int, before: int, least: int | None) -> bool:
    """Whether an extend of ``n`` tokens after ``before`` runs sharded over the cp ranks (where the extends may
    shard at all): when it is at least as long as what it extends (a capture: moving the earlier rows costs no more
    than computing the new ones replicated) or as ``least`` (``EngineConfig.sharded_extend_tokens``). The engine
    decides by it (``Engine.sharded``), and the planner plans by it (``PlanRequest.sharded_history``)."""
    return n > 0 and (n >= before or (least is not None and n >= least))


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


def walk_gather_order(runs: Sequence[Run], layers: int, every: int, paced: bool) -> list[int]:
    """The layers exact mode's wavefront walk gathers, in the order every rank posts them. Paced, as its events say
    (a segment's recomputed layers, each wave's gather of a layer). Otherwise per segment of ``every`` layers from
    the last, its top (whose block is open while the segment's inputs are recomputed), the layers below it
    ascending (the recomputation), then descending (the backward)."""
    if paced:
        order: list[int] = []
        for event in walk_events(runs, layers, every):
            if isinstance(event, SegmentRecompute):
                order += range(event.first, event.top)
            elif isinstance(event, WaveGather):
                order.append(event.layer)
        return order
    order = []
    for first in reversed(range(0, layers, every)):
        top = min(first + every, layers) - 1
        order += [top, *range(first, top), *range(top - 1, first - 1, -1)]
    return order


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


def chunk_runs(chunks: int, cp: int, balanced: bool) -> list[Run]:
    """The runs of a sharded extend of ``chunks`` chunks over ``cp`` ranks, cut as ``cut_runs`` cuts it."""
    return runs_of([owner for lo, hi, owner in cut_runs(chunks, cp, balanced) for _ in range(lo, hi)])


def _steady(cp: int) -> tuple[int, int]:
    """A cut and a depth at which the counts below have reached their most: two chunks a rank (one per run of a
    balanced cut) and 2cp + 2 layers (a rank's runs trail each other by at most 2cp - 1 steps). Callers cap the
    layer counts at the model's own."""
    return 2 * cp, 2 * cp + 2


@functools.cache
def capture_layers_whole(cp: int, rank: int, balanced: bool) -> int:
    """The most decoder layers a sharded capture holds whole at once on ``rank`` (taken, or gathered ahead), as
    the capture paces its gathers: before its cell at wavefront step s a rank starts every gather due by s, in
    ``capture_gathers``' order, freeing at once one it computes nothing with, and frees a layer after its cell."""
    chunks, layers = _steady(cp)
    runs = chunk_runs(chunks, cp, balanced)
    wave_of = {run.index: w for w, wave in enumerate(waves(runs)) for run in wave}
    computes = {(wave_of[run.index], i) for run in runs if run.owner == rank for i in range(layers)}
    coming, held, most = collections.deque(capture_gathers(runs, layers)), set(), 0
    for cell in [*wavefront_cells(runs, layers, rank), None]:  # (None: after the last, every gather left)
        step = None if cell is None else cell[0].index + cell[1]
        while coming and (step is None or coming[0].due <= step):
            gather = coming.popleft()
            held.add((gather.wave, gather.layer))
            most = max(most, len(held))
            if (gather.wave, gather.layer) not in computes:
                held.discard((gather.wave, gather.layer))
        if cell is not None:
            held.discard((wave_of[cell[0].index], cell[1]))
    return most


@functools.cache
def rows_read(cp: int, rank: int, balanced: bool) -> float:
    """The other ranks' rows a cell of ``rank`` reads at once, in shards (``n / cp`` positions): the most, over its
    runs, of the positions of other ranks' runs before the run."""
    chunks, _ = _steady(cp)
    runs = chunk_runs(chunks, cp, balanced)
    per_rank = chunks / cp
    return (
        max(sum(len(r.chunks) for r in runs[: run.index] if r.owner != rank) for run in runs if run.owner == rank)
        / per_rank
    )


@dataclass(frozen=True)
class WalkHolds:
    """What a rank holds at once in exact mode's paced walk (``walk_schedule``): decoder layers whole (started or
    taken), and layer gradients kept for their waves' reductions beside the cell's."""

    whole: int
    kept: int


@functools.cache
def walk_holds(cp: int, rank: int, every: int) -> WalkHolds:
    """``WalkHolds`` of ``rank`` in a balanced walk over sharded weights, segments of ``every`` layers, as
    ``LayerGather`` runs ``walk_schedule``: a recomputation gathers its layers one at a time, a wave's gather is
    held until the cell (freed at once on a rank with no run in the wave), a cell's gradient kept until its wave's
    reduction."""
    chunks, layers = _steady(cp)
    runs = chunk_runs(chunks, cp, True)
    wave_runs = waves(runs)
    started: set[int] = set()
    kept: set[int] = set()
    whole = most_kept = 0
    for item in walk_schedule(runs, layers, every, rank):
        if isinstance(item, SegmentRecompute):
            whole = max(whole, len(started) + 1)
        elif isinstance(item, WaveGather):
            started.add(item.layer)
            whole = max(whole, len(started))
            if not any(run.owner == rank for run in wave_runs[item.wave]):
                started.discard(item.layer)
        elif isinstance(item, WaveReduction):
            kept.discard(item.layer)
        else:
            most_kept = max(most_kept, len(kept))
            started.discard(item[1])
            kept.add(item[1])
    return WalkHolds(whole, most_kept)


@functools.cache
def walk_inputs_held(cp: int, rank: int, layers: int, every: int, paced: bool, balanced: bool = True) -> float:
    """The most recomputed layer inputs ``rank`` holds at once in exact mode's walk, in its rows (a run's entry
    counts its share of the rank's chunks), as ``WavefrontWalk`` keeps them: entering a segment of ``every`` layers
    recomputes the inputs of its layers above the first (whose kept input is a view), each freed by its cell. Paced
    (``walk_schedule``), a ``SegmentRecompute`` does so for all the rank's runs when the first run enters it, so a
    later run's inputs of the segment before are still held; otherwise each run recomputes as it enters."""
    runs = chunk_runs(2 * cp, cp, balanced)
    mine = [run for run in runs if run.owner == rank]
    share = {run.index: len(run.chunks) / sum(len(r.chunks) for r in mine) for run in mine}
    held: set[tuple[int, int]] = set()
    most = 0.0

    def enter(first: int, top: int, entering: Sequence[Run]) -> None:
        nonlocal most
        held.update((run.index, layer) for run in entering for layer in range(first + 1, top + 1))
        most = max(most, sum(share[index] for index, _ in held))

    schedule = walk_schedule(runs, layers, every, rank) if paced else walk_cells(runs, layers, rank)
    for item in schedule:
        if isinstance(item, SegmentRecompute):
            enter(item.first, item.top, mine)
        elif isinstance(item, tuple):
            run, i = item
            first = i - i % every
            if not paced and i == min(first + every, layers) - 1:  # (the run enters the segment at its top)
                enter(first, i, [run])
            held.discard((run.index, i))
    return most
