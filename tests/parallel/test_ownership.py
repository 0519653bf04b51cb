"""Where the context-parallel ranks store new positions (parallel/context.py, ``BalancedOwnership``): a sharded
extend cut evenly (balanced in attention work, or in rank order for the wavefront walk), a replicated extend's
pieces to the rank holding the least of the path."""

from __future__ import annotations

import pytest

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
