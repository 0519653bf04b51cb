"""Engine state (state.py): append-only arenas, blocks, immutable states that share storage, recurrent checkpoints,
exact byte counts, and the lazily allocated state gradient."""

from __future__ import annotations

import pytest
import torch

from longstraw_agents.state import Arena, Block, ChunkRecord, RecurrentState, State, StateGrad, leaf_into

SHAPES = ((2, 3), (2, 3))  # K and V of 2 heads x 3 dims per position


def arena(capacity: int) -> Arena:
    return Arena(SHAPES, capacity, torch.float64, torch.device("cpu"))


def values(n: int, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((n, 2, 3), fill, dtype=torch.float64), torch.full((n, 2, 3), -fill, dtype=torch.float64)


def record(start: int, blocks: list[Block | None], recurrent: list[RecurrentState | None]) -> ChunkRecord:
    length = next(b.length for b in blocks if b is not None)
    return ChunkRecord(start, length, tuple(blocks), tuple(recurrent))


def test_an_arena_appends_at_its_fill_mark_only() -> None:
    a = arena(5)
    first = a.append(values(2, 1.0))
    assert (first.lo, first.hi, a.filled) == (0, 2, 2)
    assert a.can_append(2, 3) and not a.can_append(2, 4) and not a.can_append(1, 1)
    second = a.append(values(3, 2.0))
    assert second.follows(first) and not first.follows(second)
    torch.testing.assert_close(second.views()[0], torch.full((3, 2, 3), 2.0, dtype=torch.float64))
    assert a.nbytes == 2 * 5 * 6 * 8
    with pytest.raises(RuntimeError, match="full"):
        a.append(values(1, 3.0))


def test_a_child_state_shares_its_parents_tensors_and_merges_adjacent_blocks() -> None:
    a = arena(8)
    rec0 = RecurrentState((torch.zeros(4, dtype=torch.float64),))
    parent = State((), num_layers=2).append(record(0, [a.append(values(3, 1.0)), None], [None, rec0]))
    rec1 = RecurrentState((torch.ones(4, dtype=torch.float64),))
    child = parent.append(record(3, [a.append(values(2, 2.0)), None], [None, rec1]))
    assert parent.num_tokens == 3 and child.num_tokens == 5 and len(child) == 5
    [merged] = child.blocks(0)  # one view over both chunks: attention reads one block
    assert (merged.lo, merged.hi) == (0, 5) and merged.arena is a
    assert [(b.lo, b.hi) for b in child.blocks(0, upto=1)] == [(0, 3)]  # the part before chunk 1
    assert child.recurrent(1) is rec1 and parent.recurrent(1) is rec0
    with pytest.raises(ValueError, match="checkpoints=True"):  # the parent's last recurrent state was dropped
        child.recurrent(1, after_chunk=0)
    assert child.nbytes == a.nbytes + rec1.nbytes  # arena storage once, the recurrent state kept


def test_blocks_back_to_back_in_an_arena_stay_apart_when_their_positions_are_not() -> None:
    """Context parallelism: a rank appends its pieces of a chain to one arena while other ranks hold the positions
    between them; each piece keeps its own position, and every chunk records its owner."""
    a = arena(8)
    state = State((), num_layers=1).append(record(0, [a.append(values(2, 1.0))], [None]))
    state = state.append(ChunkRecord(2, 3, (None,), (None,), owner=1))  # another rank's piece
    state = state.append(record(5, [a.append(values(2, 2.0))], [None]))
    assert [(position, b.lo, b.hi) for position, b in state.positioned_blocks(0)] == [(0, 0, 2), (5, 2, 4)]
    assert state.positions_held(2) == [4, 3]


def test_a_state_with_checkpoints_keeps_every_chunks_recurrent_state() -> None:
    recs = [RecurrentState((torch.full((4,), float(k), dtype=torch.float64),)) for k in range(3)]
    a = arena(6)
    state = State((), num_layers=2, checkpoints=True)
    for k, rec in enumerate(recs):
        state = state.append(record(2 * k, [a.append(values(2, float(k))), None], [None, rec]))
    assert [state.recurrent(1, after_chunk=k) for k in range(3)] == recs
    assert state.nbytes == a.nbytes + sum(r.nbytes for r in recs)


def test_siblings_get_their_own_blocks_and_never_see_each_other() -> None:
    a = arena(8)
    root = State((), num_layers=1).append(record(0, [a.append(values(2, 1.0))], [None]))
    first = root.append(record(2, [a.append(values(2, 2.0))], [None]))
    assert not a.can_append(2, 2)  # the first child wrote at the fill mark: a sibling needs fresh storage
    b = arena(4)
    second = root.append(record(2, [b.append(values(2, 3.0))], [None]))
    assert [(blk.arena, blk.lo, blk.hi) for blk in second.blocks(0)] == [(a, 0, 2), (b, 0, 2)]
    assert [(blk.lo, blk.hi) for blk in first.blocks(0)] == [(0, 4)]
    torch.testing.assert_close(first.blocks(0)[0].views()[0][2:], torch.full((2, 2, 3), 2.0, dtype=torch.float64))


def test_state_grad_allocates_lazily_and_releases_per_arena() -> None:
    a = arena(4)
    block = a.append(values(3, 1.0))
    grad = StateGrad()
    assert grad.nbytes == 0 and grad.existing_block_grads(block) is None
    k_grad, v_grad = grad.block_grads(block)
    assert k_grad.shape == (3, 2, 3) and grad.nbytes == a.nbytes and not k_grad.any()
    rec = RecurrentState((torch.zeros(5, dtype=torch.float64),))
    assert grad.existing_recurrent_grads(rec) is None
    grad.recurrent_grads(rec)
    assert grad.nbytes == a.nbytes + rec.nbytes
    grad.release_arena(a)
    grad.release_recurrent(rec)
    assert grad.nbytes == 0


def test_leaf_into_adds_the_gradient_into_its_buffer_and_frees_its_own() -> None:
    view = torch.arange(6, dtype=torch.float64).view(2, 3)
    buffer = torch.ones(2, 3, dtype=torch.float64)
    leaf = leaf_into(view, buffer)
    (leaf * 2.0).sum().backward()
    (leaf * 3.0).sum().backward()
    torch.testing.assert_close(buffer, torch.full((2, 3), 6.0, dtype=torch.float64))  # 1 + 2 + 3
    assert leaf.grad is None and leaf.data_ptr() == view.data_ptr()  # no copy of the state, no lasting .grad
