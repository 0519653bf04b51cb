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

On a GPU a step is captured in a CUDA graph and replayed (``Decoder(graphs=...)``, ``step_graph``): the step then
reads static buffers — the tokens, positions and session lengths, the session buffers at their full capacity
(masked), the stacked recurrent states — and updates them in place, one capture per shape class of the batch. The
eager step stays behind ``graphs=False``: the two give the same logits (tests/test_step_graph.py).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from longstraw_agents.models.base import FamilyAdapter
from longstraw_agents.models.batch import DecodeBatch, DecodeContext, DecodeGroup, PositionedBlock
from longstraw_agents.state import Block, State
from longstraw_agents.step_graph import CudaGraphStep, EagerStep, StepGraph
from longstraw_agents.token_ids import as_token_ids

from .engine import Engine
from .kit import ExecutionKit

# per model: whether its first capture was checked (``step_graph.host_syncs``; later ones are not), why its step was
# refused a capture, what was said about decoding it without graphs
_CHECKED: weakref.WeakSet[FamilyAdapter] = weakref.WeakSet()
_REFUSED: weakref.WeakKeyDictionary[FamilyAdapter, str] = weakref.WeakKeyDictionary()
_SAID: weakref.WeakKeyDictionary[FamilyAdapter, set[str]] = weakref.WeakKeyDictionary()


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

    graphs: run each step over static buffers, captured in a CUDA graph on a GPU and replayed (one launch a step
    instead of hundreds, ``step_graph``); None (default): where the engine's device is CUDA. False: the eager
    step, which sizes every step to the longest member and drops a leaving member's row at once (the reference the
    static step is tested against). On other devices True runs the static step eagerly. Families whose step
    cannot be captured (``FamilyAdapter.decode_graph_blocker``), context parallelism and sharded weights decode
    eagerly, which a RuntimeWarning says once per engine.

    Static steps run per *shape class* of the batch: its rows, the session buffers' capacity and the family's decode
    path (``FamilyAdapter.decode_regime``: DSA's selection turning sparse once a member sees more than its top-k).
    A class's first step runs eagerly and is captured, the later ones replay (``shape_classes`` counts them). A
    member that leaves keeps its row, fed but unread, until half of the rows are such: then the batch is compacted
    and a new class entered, so G members finishing one by one cost about log2(G) captures, not G. A session
    buffer that fills up doubles (a new class too); a sampler's ``reserve`` of its token limit avoids that.

    With context parallelism (an engine with ``shards``) every rank of the group makes the same calls in the same
    order: a step is computed on every rank (each reads the prefix and own positions it stores, the partial results
    merged over the ranks), and a leaving member's new positions are stored by one rank, the one holding the least
    of its path (``ExecutionKit.pieces``), as a replicated extend's are.
    """

    def __init__(self, engine: Engine, members: Sequence[Member], *, reserve: int = 0, graphs: bool | None = None):
        if not members:
            raise ValueError("a decoder needs at least one member")
        kit = engine.kit
        for member in members:
            _check_member(kit, member)
        self.kit, self.reserve = kit, reserve
        self.members = list(members)
        self.live = list(range(len(members)))  # the members in the batch, in the order ``step`` takes tokens
        self.device = kit.adapter.device
        self.graphs = _static_steps(kit, graphs)
        self.shape_classes = 0  # shape classes the static steps entered (on CUDA: graphs captured)
        self._rows = list(range(len(members)))  # the batch row of each live member
        self._prefixes, self._group_of = _groups(members)
        starts = [0 if self._group_of[k] < 0 else self._prefixes[self._group_of[k]].num_tokens for k in self.live]
        # what each growing layer reads of the state, per source: the prefixes' blocks, then (context parallelism)
        # each member's own blocks from before the session, those held here. In one process a member's own
        # positions are contiguous: they are loaded into its session buffers instead (one batched read per step,
        # not a kernel call per member)
        sources = [(prefix.positioned_blocks, 0) for prefix in self._prefixes]
        if kit.shards is not None:
            sources += [(m.state.positioned_blocks, start) for m, start in zip(members, starts, strict=True)]
        self._blocks = [
            [_views_after(blocks(i), start) for blocks, start in sources] if grows else []
            for i, grows in enumerate(self._grows())
        ]
        loaded = [m.state.num_tokens - start for m, start in zip(members, starts, strict=True)]
        self._loaded = loaded if kit.shards is None else [0] * len(members)  # own positions in the buffers
        self._stepped = [0] * len(members)  # tokens given to each member in this session
        capacity = max(self._loaded) + 1 + reserve
        self._session = [
            self._load_session(i, capacity, starts) if grows else () for i, grows in enumerate(self._grows())
        ]
        self._groups: tuple[list[int], tuple[DecodeGroup, ...]] | None = None
        self._recurrent = [() if grows else self._load_recurrent(i) for i, grows in enumerate(self._grows())]
        self._class: _ShapeClass | None = None  # the static step's current class

    # --- public ---------------------------------------------------------------------------------------------
    def step(self, tokens: Sequence[int] | Tensor) -> Tensor:
        """One token for each live member (in ``live`` order); returns their next-token logits ``[len(live), V]``."""
        if not self.live:
            raise ValueError("every member has left the decoder")
        adapter = self.kit.adapter
        ids = as_token_ids(tokens, vocab_size=adapter.vocab_size).to(self.device)
        if ids.shape[0] != len(self.live):
            raise ValueError(f"{len(self.live)} members in the batch but {ids.shape[0]} tokens")
        reach = max(self._position(k) for k in self.live) + 1
        adapter.check_reach(reach)
        regime = adapter.decode_regime(reach)
        lengths = [self._session_length(k) for k in self.live]
        if self._reserve_session(max(lengths) + 1):
            self._class = None  # the buffers moved
        if self._class is not None and self._class.inputs.regime != regime:
            self._class = None  # the family's decode path changes (e.g. DSA's selection turns sparse)
        with torch.no_grad():
            logits = self._static_step(ids, regime) if self.graphs else self._eager_step(ids, lengths, regime)
        for k in self.live:
            self._stepped[k] += 1
        return logits

    def leave(self, members: Sequence[int]) -> list[State]:
        """Take ``members`` (indices into the members given) out of the batch; returns their states, each covering
        every token it was given (the member's own state unchanged if it was given none)."""
        at = [self.live.index(k) for k in members]
        states = [self._state(k, self._rows[i]) for k, i in zip(members, at, strict=True)]
        self._remove(at)
        return states

    def _remove(self, at: list[int]) -> None:
        """Take the members at indices ``at`` of ``live`` out of the batch (the static step keeps their rows until
        half are such)."""
        rows, gone = [self._rows[i] for i in at], set(at)
        self.live = [k for i, k in enumerate(self.live) if i not in gone]
        self._rows = [row for i, row in enumerate(self._rows) if i not in gone]
        if not self.graphs:
            self._compact()
        elif self._class is not None:
            if 2 * len(self.live) <= self._class.rows:
                self._class = None  # compacted when the next class is entered
            else:
                self._class.retire(rows, self._rows)

    def drop(self, members: Sequence[int]) -> None:
        """Take ``members`` out of the batch without writing their new positions anywhere: a turn nothing continues
        (a server's answer), whose storage goes with the batch's buffers."""
        self._remove([self.live.index(k) for k in members])

    # --- the two steps --------------------------------------------------------------------------------------
    def _eager_step(self, ids: Tensor, lengths: list[int], regime: int) -> Tensor:
        """The step sized to this batch: session buffers read up to the longest member, new recurrent states kept
        as returned."""
        positions, session_start, session_lengths = self._row_inputs(self.live)
        slots = torch.arange(max(lengths) + 1, device=self.device)
        visible = slots < session_lengths[:, None] + 1  # the session's positions and the new one
        if self._groups is None:  # the batch's groups change only when members leave
            self._groups = self._batch_groups()
        present, groups = self._groups
        batch = DecodeBatch(positions, groups, session_start, session_lengths, visible, regime)
        runner = self.kit.weights.run if self.kit.weights is not None else None
        hidden, new = self.kit.adapter.decode(
            ids, batch, self._contexts(present), attention=self.kit.attention, runner=runner
        )
        self._recurrent = [() if grows else entry for grows, entry in zip(self._grows(), new, strict=True)]
        return self.kit.adapter.lm_head(hidden)

    def _static_step(self, ids: Tensor, regime: int) -> Tensor:
        """The step of the batch's shape class (entered first if needed): the tokens go into its static input, the
        class's step graph runs, the live rows of its output are returned (a copy: a replay overwrites it)."""
        if self._class is None:
            self._enter_shape_class(regime)
        shape = self._class
        assert shape is not None
        shape.feed(ids)
        logits = shape.graph()
        if shape.graph.refused is not None:  # not capturable: the eager step from now on (the graph said why)
            _REFUSED[self.kit.adapter] = shape.graph.refused
            self.graphs, self._class = False, None
            self._compact()
        return shape.live_rows_of(logits)

    def _enter_shape_class(self, regime: int) -> None:
        """Compact the batch to its live rows and make the class's static inputs and step graph."""
        self._compact()
        self._groups = self._batch_groups()
        present, groups = self._groups
        positions, session_start, session_lengths = self._row_inputs(self.live)
        capacity = next(b for buffers in self._session for b in buffers).shape[1] if any(self._grows()) else 1
        inputs = StepInputs(
            ids=torch.zeros_like(positions),
            positions=positions,
            session_start=session_start,
            session_lengths=session_lengths,
            alive=torch.ones_like(positions),
            slots=torch.arange(capacity, device=self.device),
            groups=groups,
            regime=regime,
        )
        contexts = self._contexts(present)
        adapter, attention = self.kit.adapter, self.kit.attention

        def step() -> Tensor:
            hidden, new = adapter.decode(inputs.ids, inputs.batch(), contexts, attention=attention)
            logits = adapter.lm_head(hidden)
            for context, entry in zip(contexts, new, strict=True):
                for held, value in zip(context.recurrent, entry, strict=True):
                    held.copy_(value)
            inputs.advance()
            return logits

        if self.device.type == "cuda":  # a model's first capture is checked (a failed one can break the context)
            graph: StepGraph = CudaGraphStep(step, self.device, check=adapter not in _CHECKED)
            _CHECKED.add(adapter)
        else:
            graph = EagerStep(step)
        self._class = _ShapeClass(inputs, graph)
        self.shape_classes += 1

    # --- internals ------------------------------------------------------------------------------------------
    def _grows(self) -> list[bool]:
        return [layer.mixer.grows for layer in self.kit.adapter.layers]

    def _position(self, k: int) -> int:
        """The position of member ``k``'s next token."""
        return self.members[k].state.num_tokens + self._stepped[k]

    def _session_length(self, k: int) -> int:
        """The positions member ``k`` holds in its session buffers."""
        return self._loaded[k] + self._stepped[k]

    def _row_inputs(self, members: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        """``members``' positions, session starts and session lengths ``[B]`` (one copy to the device)."""
        values = [
            [self._position(k) for k in members],
            [self.members[k].state.num_tokens - self._loaded[k] for k in members],
            [self._session_length(k) for k in members],
        ]
        positions, session_start, session_lengths = torch.tensor(values, dtype=torch.long, device=self.device)
        return positions, session_start, session_lengths

    def _contexts(self, present: list[int]) -> list[DecodeContext]:
        """Per layer: the present groups' blocks, the session buffers and the recurrent states of the batch."""
        return [
            DecodeContext([blocks[j] for j in present] if blocks else [], session, recurrent)
            for blocks, session, recurrent in zip(self._blocks, self._session, self._recurrent, strict=True)
        ]

    def _batch_groups(self) -> tuple[list[int], tuple[DecodeGroup, ...]]:
        """The groups of the rows in the batch, as sources of blocks (their indices) and rows: each prefix with
        members in the batch, then each member holding own positions here (a row's prefix before its own)."""
        rows: dict[int, list[int]] = {}
        for row, k in zip(self._rows, self.live, strict=True):
            if self._group_of[k] >= 0:
                rows.setdefault(self._group_of[k], []).append(row)
        first_own = len(self._prefixes)
        holds = self._blocks[self._grows().index(True)] if any(self._grows()) else []
        for row, k in zip(self._rows, self.live, strict=True):
            if len(holds) > first_own + k and holds[first_own + k]:
                rows[first_own + k] = [row]
        present = sorted(rows)
        return present, tuple(DecodeGroup(torch.tensor(rows[j], device=self.device)) for j in present)

    def _load_session(self, layer: int, capacity: int, starts: list[int]) -> tuple[Tensor, ...]:
        """Session buffers ``[B, capacity, *shape]`` of ``layer``, each member's first ``_loaded`` slots holding its
        own positions after its prefix (``starts``)."""
        adapter = self.kit.adapter
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

    def _reserve_session(self, length: int) -> bool:
        """Grow the session buffers (doubling) to hold ``length`` positions per member; whether they grew."""
        grew = False
        for i, buffers in enumerate(self._session):
            if buffers and buffers[0].shape[1] < length:
                grown = tuple(b.new_zeros((b.shape[0], 2 * length, *b.shape[2:])) for b in buffers)
                for new, old in zip(grown, buffers, strict=True):
                    new[:, : old.shape[1]] = old
                self._session[i], grew = grown, True
        return grew

    def _state(self, k: int, row: int) -> State:
        """Member ``k``'s state plus the positions it was given, as one chunk (row ``row`` of the buffers), stored
        by the rank that ``ExecutionKit.pieces`` names (every rank without context parallelism)."""
        state, n = self.members[k].state, self._stepped[k]
        if n == 0:
            return state
        kit = self.kit
        [(_, _, owner)] = kit.pieces(state, n, n)
        arenas = kit.arenas_for(state, n if kit.owns(owner) else 0, kit.reserve_share(self.reserve))
        lo = self._loaded[k]
        entries = [  # (``record`` copies a recurrent state out of the batch's tensor)
            tuple(b[row, lo : lo + n] for b in session) if session else tuple(t[row] for t in stacked)
            for session, stacked in zip(self._session, self._recurrent, strict=True)
        ]
        return state.append(kit.record(state.num_tokens, n, entries, arenas, owner))

    def _compact(self) -> None:
        """Keep only the live members' rows of the batch buffers, in ``live`` order."""
        size = next(t.shape[0] for buffers in (*self._session, *self._recurrent) for t in buffers)
        if self._rows == list(range(size)):
            return
        self._groups = None
        if self._rows:
            index = torch.tensor(self._rows, dtype=torch.long, device=self.device)
            self._session = [tuple(b.index_select(0, index) for b in session) for session in self._session]
            self._recurrent = [tuple(t.index_select(0, index) for t in stacked) for stacked in self._recurrent]
        self._rows = list(range(len(self._rows)))


@dataclass
class StepInputs:
    """A shape class's step inputs in static buffers, one row per batch row (``step_graph``): the step reads them
    and advances them in place, so a captured graph replays on the same memory.

    ids: the token each row is fed (rows whose member left are fed what they were last: their output is unread).
    positions, session_start, session_lengths: as ``DecodeBatch``'s.
    alive: 1 for a live row, 0 for a row whose member left (its position and session length stay put).
    slots: ``arange(capacity)`` of the session buffers: each step attends over all of them, masked.
    regime: the family's decode path the class's steps take (``DecodeBatch.regime``).
    """

    ids: Tensor
    positions: Tensor
    session_start: Tensor
    session_lengths: Tensor
    alive: Tensor
    slots: Tensor
    groups: tuple[DecodeGroup, ...]
    regime: int = 0

    def batch(self) -> DecodeBatch:
        """The step's ``DecodeBatch``: each row sees its session's positions and its new one."""
        visible = self.slots < self.session_lengths[:, None] + 1
        return DecodeBatch(self.positions, self.groups, self.session_start, self.session_lengths, visible, self.regime)

    def advance(self) -> None:
        """After a step: each live row one position further."""
        self.positions.add_(self.alive)
        self.session_lengths.add_(self.alive)


class _ShapeClass:
    """The static step of one shape class of a ``Decoder``'s batch: its inputs, its step graph and which rows are
    live."""

    def __init__(self, inputs: StepInputs, graph: StepGraph):
        self.inputs, self.graph = inputs, graph
        self.rows = int(inputs.ids.shape[0])
        self._live: Tensor | None = None  # the live rows, None while all are

    def feed(self, ids: Tensor) -> None:
        """The live rows' tokens into the static input."""
        if self._live is None:
            self.inputs.ids.copy_(ids)
        else:
            self.inputs.ids.index_copy_(0, self._live, ids)

    def live_rows_of(self, logits: Tensor) -> Tensor:
        return logits.clone() if self._live is None else logits.index_select(0, self._live)

    def retire(self, rows: list[int], live: list[int]) -> None:
        """Rows ``rows`` lost their members (``live``: the rows still live): their positions stop advancing and
        their session length goes to 0, so their writes stay inside their own first slot."""
        index = torch.tensor(rows, dtype=torch.long, device=self.inputs.alive.device)
        self.inputs.alive.index_fill_(0, index, 0)
        self.inputs.session_lengths.index_fill_(0, index, 0)
        self._live = torch.tensor(live, dtype=torch.long, device=index.device)


def decode_step(
    engine: Engine, members: Sequence[Member], tokens: Sequence[int] | Tensor, *, reserve: int = 0
) -> tuple[list[State], Tensor]:
    """One token for each member in one batched forward: their new states and next-token logits ``[B, V]``."""
    decoder = Decoder(engine, members, reserve=reserve, graphs=False)  # (a graph would never be replayed)
    logits = decoder.step(tokens)
    return decoder.leave(range(len(members))), logits


def _static_steps(kit: ExecutionKit, graphs: bool | None) -> bool:
    """Whether a decoder over ``kit`` runs static steps (``Decoder``'s ``graphs``): not where its step cannot be
    captured, which a RuntimeWarning says once per model."""
    adapter = kit.adapter
    if graphs is False or (graphs is None and adapter.device.type != "cuda"):
        return False
    if kit.shards is not None or kit.weights is not None:
        reason = "with context parallelism or sharded weights, a step gathers and merges over the ranks"
    elif adapter.decode_graph_blocker is not None:
        reason = f"the {adapter.family} family's step {adapter.decode_graph_blocker}"
    elif adapter in _REFUSED:
        return False  # (said when its capture was refused)
    else:
        return True
    said = _SAID.setdefault(adapter, set())
    if reason not in said:
        said.add(reason)
        warnings.warn(f"decoding runs without CUDA graphs: {reason}", RuntimeWarning, stacklevel=3)
    return False


def _check_member(kit: ExecutionKit, member: Member) -> None:
    state, prefix = member.state, member.prefix
    if not isinstance(state, State) or state.owner != id(kit.model) or state.num_layers != kit.num_layers:
        raise ValueError("a member's state was not made by this engine (Engine.capture / extend / a Decoder)")
    if state.num_tokens == 0:
        raise ValueError("a member's state is empty: capture at least one token before decoding")
    if prefix is not None and not holds_prefix(state, prefix):
        raise ValueError("a member's prefix is not an ancestor of its state")


def holds_prefix(state: State, prefix: State) -> bool:
    """Whether ``state`` descends from ``prefix`` and still holds its blocks: what a member's shared prefix must
    be. The same tokens captured again (a context edit resumed by a new capture) are not: their blocks differ."""
    if not prefix.chunks:
        return True
    # a child re-creates its parent's last record without the recurrent state; the blocks stay the same
    at, last = len(prefix.chunks) - 1, prefix.chunks[-1]
    return at < len(state.chunks) and state.chunks[at].blocks is last.blocks and state.chunks[at].end == last.end


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
