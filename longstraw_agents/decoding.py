"""Batched decoding over engine states: one forward per generated token for every member of a batch.

    decoder = Decoder(engine, [Member(fork, prefix=fork)] * 8, reserve=32)   # 8 members of one group
    logits = decoder.step(tokens)            # one token each, one forward; next-token logits [8, V]
    [state] = decoder.leave([3])             # member 3 is done: its state covers every token it was given
    decoder.drop([5])                        # member 5 is done and nothing continues it: no state is written

A member is an engine ``State`` plus the ``prefix`` it shares with its group (the state the group was forked from,
an ancestor of the member's). Members with the same prefix object form a group: each growing layer reads that
prefix once per step for the whole group (its queries stacked as the rows of one kernel call, see
``models.batch``) and each member's own earlier positions separately, straight from the state's blocks (nothing is
copied for a session). The positions decoded in the session are held in batch buffers and the recurrent states
stacked, so a step does no per-member work for them; a member's new positions are written to its state when it
leaves, exactly as ``Engine.extend`` writes a chunk (in place at its arena's fill mark, else into fresh storage with
``reserve`` extra room). The states stay ordinary engine states: ``Engine.extend`` continues them (tool turns), and
their logits equal those of stepping each member alone.

With context parallelism the ranks decode together, each reading the positions it stores (see ``Decoder``): a
member's path stays spread over the ranks as it grows, turn by turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from longstraw_agents.engine import Engine
from longstraw_agents.models.batch import DecodeBatch, DecodeContext, DecodeGroup, PositionedBlock
from longstraw_agents.state import Block, State
from longstraw_agents.token_ids import as_token_ids


@dataclass(frozen=True)
class Member:
    """A sequence to decode: its state, and the prefix state it shares with its group (None: no sharing)."""

    state: State
    prefix: State | None = None


class Decoder:
    """A decode session over ``members``: ``step`` feeds one token to every member still in the batch (one
    forward), ``leave`` takes members out and returns their states. Forward only (no autograd).

    reserve: extra positions allocated when a leaving member's positions go into fresh storage (as
    ``Engine.step``), so that its next turn's observation can be appended in place.

    With context parallelism (an engine with ``shards``) every rank of the group makes the same calls in the same
    order: a step is computed on every rank (each reads the prefix and own positions it stores, the partial results
    merged over the ranks), and a leaving member's new positions are stored by one rank, the one holding the least
    of its path (``Engine.pieces``), as a replicated extend's are.
    """

    def __init__(self, engine: Engine, members: Sequence[Member], *, reserve: int = 0):
        if not members:
            raise ValueError("a decoder needs at least one member")
        for member in members:
            _check_member(engine, member)
        self.engine, self.reserve = engine, reserve
        self.members = list(members)
        self.live = list(range(len(members)))  # member index of each batch row
        self.device = engine.adapter.device
        self._prefixes, self._group_of = _groups(members)
        starts = [0 if self._group_of[k] < 0 else self._prefixes[self._group_of[k]].num_tokens for k in self.live]
        # what each growing layer reads of the state, per source: the prefixes' blocks, then (context parallelism)
        # each member's own blocks from before the session, those held here. In one process a member's own
        # positions are contiguous: they are loaded into its session buffers instead (one batched read per step,
        # not a kernel call per member)
        sources = [(prefix.positioned_blocks, 0) for prefix in self._prefixes]
        if engine.shards is not None:
            sources += [(m.state.positioned_blocks, start) for m, start in zip(members, starts, strict=True)]
        self._blocks = [
            [_views_after(blocks(i), start) for blocks, start in sources] if grows else []
            for i, grows in enumerate(self._grows())
        ]
        self._positions = torch.tensor([m.state.num_tokens for m in members], dtype=torch.long, device=self.device)
        loaded = [m.state.num_tokens - start for m, start in zip(members, starts, strict=True)]
        self._loaded = loaded if engine.shards is None else [0] * len(members)  # own positions in the buffers
        self._session_start = self._positions - torch.tensor(self._loaded, dtype=torch.long, device=self.device)
        self._stepped = [0] * len(members)  # tokens given to each member in this session
        capacity = max(self._loaded) + 1 + reserve
        self._session = [
            self._load_session(i, capacity, starts) if grows else () for i, grows in enumerate(self._grows())
        ]
        self._groups: tuple[list[int], tuple[DecodeGroup, ...]] | None = None
        self._recurrent = [() if grows else self._load_recurrent(i) for i, grows in enumerate(self._grows())]

    # --- public ---------------------------------------------------------------------------------------------
    def step(self, tokens: Sequence[int] | Tensor) -> Tensor:
        """One token for each live member (in ``live`` order); returns their next-token logits ``[len(live), V]``."""
        if not self.live:
            raise ValueError("every member has left the decoder")
        adapter = self.engine.adapter
        ids = as_token_ids(tokens, vocab_size=adapter.vocab_size).to(self.device)
        if ids.shape[0] != len(self.live):
            raise ValueError(f"{len(self.live)} members in the batch but {ids.shape[0]} tokens")
        lengths = [self._loaded[k] + self._stepped[k] for k in self.live]
        self._reserve_session(max(lengths) + 1)
        session_lengths = torch.tensor(lengths, dtype=torch.long, device=self.device)
        slots = torch.arange(max(lengths) + 1, device=self.device)
        visible = slots < session_lengths[:, None] + 1  # the session's positions and the new one
        if self._groups is None:  # the batch's groups change only when members leave
            self._groups = self._batch_groups()
        present, groups = self._groups
        batch = DecodeBatch(self._positions, groups, self._session_start, session_lengths, visible)
        contexts = [
            DecodeContext([blocks[j] for j in present] if blocks else [], session, recurrent)
            for blocks, session, recurrent in zip(self._blocks, self._session, self._recurrent, strict=True)
        ]
        with torch.no_grad():
            runner = self.engine.weights.run if self.engine.weights is not None else None
            hidden, new = adapter.decode(ids, batch, contexts, attention=self.engine.attention, runner=runner)
            logits = adapter.lm_head(hidden)
        self._recurrent = [() if grows else entry for grows, entry in zip(self._grows(), new, strict=True)]
        self._positions = self._positions + 1
        for k in self.live:
            self._stepped[k] += 1
        return logits

    def leave(self, members: Sequence[int]) -> list[State]:
        """Take ``members`` (indices into the members given) out of the batch; returns their states, each covering
        every token it was given (the member's own state unchanged if it was given none)."""
        rows = [self.live.index(k) for k in members]
        states = [self._state(k, row) for k, row in zip(members, rows, strict=True)]
        leaving = set(rows)
        self._compact([row for row in range(len(self.live)) if row not in leaving])
        return states

    def drop(self, members: Sequence[int]) -> None:
        """Take ``members`` out of the batch without writing their new positions anywhere: a turn nothing continues
        (a server's answer), whose storage goes with the batch's buffers."""
        leaving = {self.live.index(k) for k in members}
        self._compact([row for row in range(len(self.live)) if row not in leaving])

    # --- internals ------------------------------------------------------------------------------------------
    def _grows(self) -> list[bool]:
        return [layer.mixer.grows for layer in self.engine.adapter.layers]

    def _batch_groups(self) -> tuple[list[int], tuple[DecodeGroup, ...]]:
        """The groups of the rows in the batch, as sources of blocks (their indices) and rows: each prefix with
        members in the batch, then each member holding own positions here (a row's prefix before its own)."""
        rows: dict[int, list[int]] = {}
        for row, k in enumerate(self.live):
            if self._group_of[k] >= 0:
                rows.setdefault(self._group_of[k], []).append(row)
        first_own = len(self._prefixes)
        holds = self._blocks[self._grows().index(True)] if any(self._grows()) else []
        for row, k in enumerate(self.live):
            if len(holds) > first_own + k and holds[first_own + k]:
                rows[first_own + k] = [row]
        present = sorted(rows)
        return present, tuple(DecodeGroup(torch.tensor(rows[j], device=self.device)) for j in present)

    def _load_session(self, layer: int, capacity: int, starts: list[int]) -> tuple[Tensor, ...]:
        """Session buffers ``[B, capacity, *shape]`` of ``layer``, each member's first ``_loaded`` slots holding its
        own positions after its prefix (``starts``)."""
        adapter = self.engine.adapter
        buffers = tuple(
            torch.zeros((len(self.members), capacity, *shape), dtype=adapter.dtype, device=self.device)
            for shape in adapter.layers[layer].mixer.state_shapes()
        )
        for row, (member, start) in enumerate(zip(self.members, starts, strict=True)):
            if self._loaded[row]:
                at = 0
                for _, views in _views_after(member.state.positioned_blocks(layer), start):
                    for buffer, view in zip(buffers, views, strict=True):
                        buffer[row, at : at + view.shape[0]] = view
                    at += views[0].shape[0]
        return buffers

    def _load_recurrent(self, layer: int) -> tuple[Tensor, ...]:
        """The members' recurrent states of ``layer`` stacked ``[B, ...]``."""
        states = [member.state.recurrent(layer) for member in self.members]
        assert all(s is not None for s in states)  # only an empty state (refused) has none
        return tuple(torch.stack(parts) for parts in zip(*(s.tensors for s in states if s is not None), strict=True))

    def _reserve_session(self, length: int) -> None:
        """Grow the session buffers (doubling) to hold ``length`` positions per member."""
        for i, buffers in enumerate(self._session):
            if buffers and buffers[0].shape[1] < length:
                grown = tuple(b.new_zeros((b.shape[0], 2 * length, *b.shape[2:])) for b in buffers)
                for new, old in zip(grown, buffers, strict=True):
                    new[:, : old.shape[1]] = old
                self._session[i] = grown

    def _state(self, k: int, row: int) -> State:
        """Member ``k``'s state plus the positions it was given, as one chunk (row ``row`` of the buffers), stored
        by the rank that ``Engine.pieces`` names (every rank without context parallelism)."""
        state, n = self.members[k].state, self._stepped[k]
        if n == 0:
            return state
        engine = self.engine
        [(_, _, owner)] = engine.pieces(state, n, n)
        arenas = engine.arenas_for(state, n if engine.owns(owner) else 0, engine.reserve_share(self.reserve))
        lo = self._loaded[k]
        entries = [  # (``record`` copies a recurrent state out of the batch's tensor)
            tuple(b[row, lo : lo + n] for b in session) if session else tuple(t[row] for t in stacked)
            for session, stacked in zip(self._session, self._recurrent, strict=True)
        ]
        return state.append(engine.record(state.num_tokens, n, entries, arenas, owner))

    def _compact(self, keep: list[int]) -> None:
        """Keep only batch rows ``keep`` (in order)."""
        if len(keep) == len(self.live):
            return
        self.live = [self.live[row] for row in keep]
        self._groups = None
        if not keep:
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self._session = [tuple(b.index_select(0, index) for b in session) for session in self._session]
        self._recurrent = [tuple(t.index_select(0, index) for t in stacked) for stacked in self._recurrent]
        self._positions = self._positions.index_select(0, index)
        self._session_start = self._session_start.index_select(0, index)


def decode_step(
    engine: Engine, members: Sequence[Member], tokens: Sequence[int] | Tensor, *, reserve: int = 0
) -> tuple[list[State], Tensor]:
    """One token for each member in one batched forward: their new states and next-token logits ``[B, V]``."""
    decoder = Decoder(engine, members, reserve=reserve)
    logits = decoder.step(tokens)
    return decoder.leave(range(len(members))), logits


def _check_member(engine: Engine, member: Member) -> None:
    state, prefix = member.state, member.prefix
    if not isinstance(state, State) or state.owner != id(engine.model) or state.num_layers != engine.num_layers:
        raise ValueError("a member's state was not made by this engine (Engine.capture / extend / a Decoder)")
    if state.num_tokens == 0:
        raise ValueError("a member's state is empty: capture at least one token before decoding")
    if prefix is not None and prefix.chunks:
        # a child re-creates its parent's last record without the recurrent state; the blocks stay the same
        at, last = len(prefix.chunks) - 1, prefix.chunks[-1]
        if at >= len(state.chunks) or state.chunks[at].blocks is not last.blocks or state.chunks[at].end != last.end:
            raise ValueError("a member's prefix is not an ancestor of its state")


def _groups(members: Sequence[Member]) -> tuple[list[State], list[int]]:
    """The distinct non-empty prefixes (in order of first appearance) and each member's group (-1: none)."""
    index: dict[int, int] = {}
    prefixes: list[State] = []
    group_of = []
    for member in members:
        prefix = member.prefix
        if prefix is None or prefix.num_tokens == 0:
            group_of.append(-1)
            continue
        if id(prefix) not in index:
            index[id(prefix)] = len(prefixes)
            prefixes.append(prefix)
        group_of.append(index[id(prefix)])
    return prefixes, group_of


def _views_after(blocks: list[tuple[int, Block]], start: int) -> list[PositionedBlock]:
    """The views of ``blocks`` (with the position each starts at, in order) past position ``start``, with theirs."""
    return [
        (max(position, start), Block(block.arena, block.lo + max(0, start - position), block.hi).views())
        for position, block in blocks
        if position + block.length > start
    ]
