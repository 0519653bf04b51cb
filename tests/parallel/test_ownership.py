"""Where the context-parallel ranks store new positions (parallel/context.py, ``BalancedOwnership``): a sharded
extend cut evenly (balanced in attention work, or in rank order for the wavefront walk), a replicated extend's
pieces to the rank holding the least of the path."""

from __future__ import annotations

import collections

import pytest

from longstraw_agents.engine.schedule import runs_of, walk_cells
from longstraw_agents.parallel import BalancedOwnership


@pytest.mark.parametrize(("n", "ranks"), [(61, 2), (61, 4), (3, 4), (16, 4), (1, 8), (5, 4), (9, 8), (17, 8)])
def test_a_sharded_extend_is_cut_evenly_in_rank_order(n: int, ranks: int) -> None:
    runs = BalancedOwnership(0, ranks).cut(n, balanced=False)
    assert [owner for *_, owner in runs] == list(range(len(runs)))  # the wavefront walk's order
    assert runs[0][0] == 0 and runs[-1][1] == n and all(a[1] == b[0] for a, b in zip(runs, runs[1:], strict=False))
    widths = [hi - lo for lo, hi, _ in runs]
    assert max(widths) - min(widths) <= 1 and len(runs) == min(n, ranks)
    assert BalancedOwnership(0, ranks).cut(0, balanced=False) == []


@pytest.mark.parametrize(("n", "ranks"), [(61, 2), (61, 4), (3, 4), (16, 4), (1, 8), (5, 4), (9, 8), (160, 8)])
def test_a_balanced_cut_gives_rank_r_the_r_th_and_the_mirrored_part(n: int, ranks: int) -> None:
    """2N parts, rank r's the r-th and the (2N - 1 - r)-th (the middle two one run): positions within two of
    even, and every rank's attention pairs (the positions before each of its own, summed) even to a part's."""
    runs = BalancedOwnership(1, ranks).cut(n)
    assert runs[0][0] == 0 and runs[-1][1] == n and all(a[1] == b[0] for a, b in zip(runs, runs[1:], strict=False))
    assert all(a[2] != b[2] for a, b in zip(runs, runs[1:], strict=False))  # one rank's consecutive parts joined
    held, pairs = [0] * ranks, [0] * ranks
    for lo, hi, owner in runs:
        held[owner] += hi - lo
        pairs[owner] += sum(range(lo, hi))
    assert max(held) - min(held) <= 2
    if n >= 2 * ranks:
        assert [owner for *_, owner in runs] == [*range(ranks), *reversed(range(ranks - 1))]
        part = -(-n // (2 * ranks))
        assert max(pairs) - min(pairs) <= 2 * part * part + n


def test_replicated_pieces_go_to_the_rank_holding_the_least_of_the_path() -> None:
    ownership = BalancedOwnership(1, 3)
    assert ownership.assign([10, 4, 4], [5, 5, 5]) == [1, 2, 1]  # ties: the rank given the least, then the lower
    held = [20, 20, 21]
    for turn in range(200):  # a member's history, turn by turn
        lengths = [7, 3] if turn % 3 else [16, 16, 2]
        for owner, length in zip(ownership.assign(held, lengths), lengths, strict=True):
            held[owner] += length
    assert max(held) - min(held) <= 16  # within a piece of even


def test_members_alike_put_their_turns_on_different_ranks() -> None:
    """G members forked from one evenly cut prompt hold the same of each path: their turns must not all land on the
    lowest rank (it would hold G turns more than the others), but spread by what each rank was given so far."""
    ownership = BalancedOwnership(0, 4)
    owners = [ownership.assign([10, 10, 10, 10], [6])[0] for _ in range(8)]
    assert owners == [0, 1, 2, 3, 0, 1, 2, 3]


def _walked(ranks: int, balanced: bool, layers: int = 6) -> tuple[list[float], float]:
    """Exact mode's walk of a cut of ``64 ranks`` positions (``walk_cells``), simulated: each rank walks its cells
    in order, a cell once its run's layer above and every later run's same layer are walked, a cell taking its run's
    work — per position the positions before it (attention, in units of the cut) plus a quarter (the other
    layers). Each rank's work, and when the last cell ends; fails where a rank would wait on a cell walked after its
    own (a deadlock)."""
    n = 64 * ranks
    runs = runs_of([owner for lo, hi, owner in BalancedOwnership(0, ranks).cut(n, balanced) for _ in range(lo, hi)])
    cost = {run.index: sum(position / n + 0.25 for position in run.chunks) for run in runs}  # (a chunk a position)
    order = {rank: collections.deque(walk_cells(runs, layers, rank)) for rank in range(ranks)}
    free, ends = [0.0] * ranks, {}  # when each rank is free; each cell's end
    while any(order.values()):
        walked = False
        for rank, queue in order.items():
            while queue:
                run, i = queue[0]
                needs = [(run.index, i + 1)] if i + 1 < layers else []
                needs += [(later.index, i) for later in runs[run.index + 1 :]]
                if any(cell not in ends for cell in needs):
                    break
                queue.popleft()
                free[rank] = max([free[rank], *(ends[cell] for cell in needs)]) + cost[run.index]
                ends[run.index, i] = free[rank]
                walked = True
        assert walked, "every rank waits on a cell no rank can walk"
    work = [sum(cost[run.index] for run in runs if run.owner == rank) * layers for rank in range(ranks)]
    return work, max(ends.values())


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_the_wavefront_walk_of_a_balanced_cut_is_balanced_and_faster_than_rank_order(ranks: int) -> None:
    """The walk of a balanced cut meets every dependency, each rank's work within 10 % of the mean (rank order: the
    last rank's up to twice it), and ends sooner than rank order's walk."""
    work, ends = _walked(ranks, balanced=True)
    in_order, in_order_ends = _walked(ranks, balanced=False)
    assert max(work) / (sum(work) / ranks) <= 1.1
    assert max(in_order) / (sum(in_order) / ranks) > 1.3
    assert ends < in_order_ends
