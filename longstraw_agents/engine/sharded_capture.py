"""An extend under context parallelism whose compute is sharded (a capture): each rank evaluates only the chunks
of its own positions, layer by layer across them, and the ranks meet in a wavefront. docs/distributed.md writes the
schedule down; ``ShardedCapture`` is it."""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from longstraw_agents.models.base import LayerContext, PastBlock
from longstraw_agents.state import Arena, Block, ChunkRecord, LayerInputs, RecurrentState, State

from .kit import ExecutionKit, past_blocks
from .schedule import Run, capture_gathers, runs_of, wavefront_cells, waves
from .shards import RUNS_HEADER, ChunkOwners, StateShards, in_position_order, incoming_runs, outgoing_runs
from .tags import MessageKind, check_tag_bounds, message_tag

if TYPE_CHECKING:
    from .weights import ExpertRounds


@dataclass(frozen=True)
class _Message:
    """A message of the capture, named by the cell that takes it: layer ``layer``'s rows for ``run`` (the sender's
    rows before it), or the recurrent state before it."""

    run: Run
    layer: int
    rows: bool

    @property
    def tag(self) -> int:
        kind = MessageKind.CAPTURE_ROWS if self.rows else MessageKind.CAPTURE_RECURRENT
        return message_tag(kind, self.run.index, self.layer)


class _Shard:
    """This rank's part of a capture as it is computed: its runs' hidden states back to back (with their positions
    and rotations), each chunk's forward scratch, and the state entries it has written."""

    def __init__(
        self, h: Tensor, positions: Tensor, rope: tuple[Tensor, Tensor], arenas: list[Arena | None], chunks: int,
        layers: int,
    ):  # fmt: skip
        self.h, self.positions, self.rope, self.arenas = h, positions, rope, arenas
        self.scratch: list[dict[str, Any]] = [{} for _ in range(chunks)]  # across layers
        self.blocks: list[list[Block | None]] = [[None] * layers for _ in range(chunks)]
        self.recurrent: list[list[RecurrentState | None]] = [[None] * layers for _ in range(chunks)]


class ShardedCapture:
    """Each rank evaluates only the chunks of its own positions, a run (its consecutive chunks) at a time, and the
    ranks meet in a wavefront over cells ``(run, layer)`` (``wavefront_cells``) — what a cell needs of earlier
    positions arrives from the ranks that hold them:

    - a growing layer (attention, MLA + DSA index keys): each other rank holding rows before the run (of the parent,
      or of its own earlier runs of this extend) sends them once it has computed those runs' layer; the receiver
      attends to them as ordinary past blocks (one process's arithmetic) and drops them after the cell;
    - a recurrent layer (GatedDeltaNet): the state after the run before goes to the rank computing the run.

    A cell needs only cells a wavefront step earlier (the runs before it at its layer, its own run's layer below),
    so the critical path is ``layers + runs - 1`` steps of one run, not their product. With the cut in rank order
    (one run per rank) every message goes to a later rank and a rank computes layer by layer; with a balanced cut
    (``Ownership.cut``: rank r's runs r and 2N - 1 - r) its later run trails its first. A rank sends each peer its
    messages in the order the peer takes them (NCCL matches a pair's messages in posting order), each as soon as it
    and those before it are ready. A layer's weights are gathered once per wave of runs (``waves``: with a balanced
    cut, the ranks' first runs, then their later ones), whole on a rank from the step they are due to its cell.

    Afterwards the owners broadcast the recurrent states every rank's later work reads (the last, and the
    replicated walk's checkpoints); attention rows stay with their owners. Used where the new tokens are at least as
    many as the parent's (a capture: moving the earlier rows there costs no more than the rows computed) or as
    ``EngineConfig.sharded_extend_tokens``; a short extend (a turn, a branch) instead runs replicated with partials
    merged (``Attention.shards``), which moves only the new tokens' partials.

    An extend of a state with checkpoints (exact mode's capture, a long leaf walked chunk by chunk), with
    ``EngineConfig.wavefront_walk``, keeps this rank's layer inputs on the child state (``State.layer_inputs``) for
    the wavefront walk instead of sharing checkpoints: the walk back to the parent then runs sharded too."""

    def __init__(self, kit: ExecutionKit, shards: StateShards, state: State, ids: Tensor, chunk: int):
        self.kit, self.state, self.ids = kit, state, ids
        self.ownership, self.transport = shards.ownership, shards.transport
        self.base = state.num_tokens
        self.rounds = kit.rounds  # (expert parallelism: the MoE calls are rounds every rank takes part in)
        # (the wavefront walk computes with a gradient, which expert rounds do not carry: a replicated walk)
        self.keeps_inputs = kit.config.wavefront_walk and state.checkpoints > 0 and self.rounds is None
        balanced = kit.config.balanced_captures
        pieces = kit.pieces(state, ids.shape[0], chunk, sharded=True, balanced=balanced)
        self.pieces = [(self.base + lo, self.base + hi) for lo, hi, _ in pieces]
        chunks = ChunkOwners.of([owner for _, _, owner in pieces], self.ownership.rank)
        self.owners, self.mine = chunks.owners, chunks.mine
        self.runs = runs_of(self.owners)
        check_tag_bounds(len(self.runs), kit.num_layers)
        rank = self.ownership.rank
        self.my_runs = [run for run in self.runs if run.owner == rank]
        self.parent_holders = {c.owner for c in state.chunks}  # the ranks holding rows of the parent
        self.index = {j: k for k, j in enumerate(self.mine)}  # a chunk's index among this rank's
        self.rows: dict[int, slice] = {}  # a chunk's rows in this rank's hidden states (its runs back to back)
        for j in self.mine:
            at = self.rows[self.mine[self.index[j] - 1]].stop if self.index[j] else 0
            self.rows[j] = slice(at, at + self.pieces[j][1] - self.pieces[j][0])
        self.done: set[tuple[int, int]] = set()  # this rank's cells computed: (run index, layer)
        self.after: dict[tuple[int, int], tuple[Tensor, ...]] = {}  # a run's recurrent state, until it is sent
        self.staged: dict[tuple[int, int], list[Tensor]] = {}  # (layer, own runs before) -> that rows message
        self.outbox = {dst: collections.deque(self._messages(dst)) for dst in range(self.ownership.size) if dst != rank}
        # a layer's weights are gathered once per wave of runs (``capture_gathers``): (wave, layer) this rank computes
        self.gathers = collections.deque(capture_gathers(self.runs, kit.num_layers))
        wave_of = {run.index: w for w, wave in enumerate(waves(self.runs)) for run in wave}
        self.computes = {(wave_of[run.index], i) for run in self.my_runs for i in range(kit.num_layers)}

    def run(self, reserve: int) -> State:
        """The child state."""
        kit, adapter = self.kit, self.kit.adapter
        width = sum(b - a for a, b in (self.pieces[j] for j in self.mine))
        arenas = kit.arenas_for(self.state, width, kit.reserve_share(reserve))
        # every rank keeps inputs (empty without chunks), so that every rank picks the wavefront walk
        inputs = LayerInputs.empty(adapter.device, kit.layer_inputs_spacing, self.base) if self.keeps_inputs else None
        kit.announce([g.layer for g in self.gathers], ahead=0)  # (started as they fall due: ``_start_gathers``)
        with torch.no_grad(), self.rounds.dispatching() if self.rounds else contextlib.nullcontext():
            shard = _Shard(*self._embedded(), arenas, len(self.mine), kit.num_layers)
            if inputs is not None and self.mine:
                inputs.positions, inputs.rope = shard.positions, shard.rope
            self._post()  # (the parent's rows, sent before any computing)
            cells = wavefront_cells(self.runs, kit.num_layers, self.ownership.rank)
            if self.rounds is None:
                for run, i in cells:
                    self._start_gathers(run.index + i)
                    self._computed(shard, run, i, inputs)
            else:
                self._in_rounds(shard, cells, self.rounds)
            self._start_gathers(None)  # (a rank joins every gather, computing or not)
            assert not any(self.outbox.values())  # every message sent
            self.transport.flush()
        child = self._records(shard.blocks, shard.recurrent)
        if inputs is not None:
            inputs.final = shard.h if self.mine else None
            child = child.with_layer_inputs(inputs)
        return child

    def _computed(self, shard: _Shard, run: Run, i: int, inputs: LayerInputs | None) -> None:
        """Cell ``(run, i)`` computed with its layer whole, and the messages it readies posted."""
        with self.kit.gathered(i):
            self._cell(shard, run, i, inputs)
        self.done.add((run.index, i))
        self._post(shard.blocks)
        # a window of messages in flight (a cell's senders are at most a few wavefront steps ahead)
        self.transport.flush("rows", keep=8 * self.ownership.size**2)
        self.transport.flush("recurrent", keep=8 * self.ownership.size**2)

    def _in_rounds(self, shard: _Shard, cells: list[tuple[Run, int]], rounds: ExpertRounds) -> None:
        """Under expert parallelism: every rank walks every wavefront step, making at each as many MoE rounds as
        the rank with the most MoE calls in it (a call per chunk of a cell at a MoE layer), idle ones after its
        own cells."""
        steps = len(self.runs) + self.kit.num_layers - 1
        calls = [[0] * self.ownership.size for _ in range(steps)]
        for run in self.runs:
            for i in rounds.routed:
                calls[run.index + i][run.owner] += len(run.chunks)
        mine: dict[int, list[tuple[Run, int]]] = collections.defaultdict(list)
        for run, i in cells:
            mine[run.index + i].append((run, i))
        for step in range(steps):
            self._start_gathers(step)
            made = rounds.calls
            for run, i in mine[step]:
                self._computed(shard, run, i, None)
            assert rounds.calls - made == calls[step][self.ownership.rank]  # (a MoE call per chunk of a cell)
            for _ in range(max(calls[step]) - calls[step][self.ownership.rank]):
                rounds.idle(shard.h)

    def _start_gathers(self, step: int | None) -> None:
        """Start the gathers due by wavefront step ``step`` (None: every one left), in the order every rank starts
        them; one this rank computes nothing with is taken and freed at once. A rank thus holds a layer's weights
        from the step its wave first needs them to its own cell of that wave, never across the steps between its
        runs, and starts each gather before it can wait on anything a peer computes after that gather is due."""
        while self.gathers and (step is None or self.gathers[0].due <= step):
            gather = self.gathers.popleft()
            self.kit.start_gather()
            if (gather.wave, gather.layer) not in self.computes:
                with self.kit.gathered(gather.layer):
                    pass

    def _cell(self, shard: _Shard, run: Run, i: int, inputs: LayerInputs | None) -> None:
        """Layer ``i`` over ``run``'s chunks: what it reads of earlier positions received, its rows appended to the
        rank's arena (a growing layer) or the state after it kept for the next run (a recurrent one)."""
        adapter, h = self.kit.adapter, shard.h
        layer = adapter.layers[i]
        past = self._past(run, i, shard.blocks) if layer.mixer.grows else None
        carried = None if layer.mixer.grows else self._recurrent_before(run, i)
        if inputs is not None:
            scratch = {self.index[j]: shard.scratch[self.index[j]] for j in run.chunks}
            inputs.add_cell(i, self._run_rows(run), h, scratch, carried)
        for j in run.chunks:
            k, (a, _), rows = self.index[j], self.pieces[j], self.rows[j]
            ctx = LayerContext(past=list(past)) if past is not None else LayerContext(recurrent=carried)
            rope = (shard.rope[0][rows], shard.rope[1][rows])
            h[rows], new = adapter.run_layer(
                layer, h[rows], shard.positions[rows], rope, ctx, shard.scratch[k], self.kit.local_attention, a
            )
            if past is not None:
                arena = shard.arenas[i]
                assert arena is not None  # sized for this rank's rows
                shard.blocks[k][i] = written = arena.append(new)
                past.append(PastBlock(written.views(), None, a))
            else:
                carried = new
                if self._keeps(j):
                    shard.recurrent[k][i] = RecurrentState.owning(new)
        if carried is not None and run.index + 1 < len(self.runs):
            self.after[run.index, i] = carried

    def _embedded(self) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
        """This rank's runs embedded back to back: hidden states, positions and rotations (empty without chunks)."""
        parts = [self.kit.adapter.embed(self.ids[a - self.base : b - self.base], a) for a, b in self._spans()]
        if not parts:
            return self.kit.adapter.embed(self.ids[:0], self.base)
        h = torch.cat([p[0] for p in parts])
        positions = torch.cat([p[1] for p in parts])
        rope = (torch.cat([p[2][0] for p in parts]), torch.cat([p[2][1] for p in parts]))
        return h, positions, rope

    def _spans(self) -> list[tuple[int, int]]:
        """The positions of this rank's runs."""
        return [(self.pieces[run.chunks[0]][0], self.pieces[run.chunks[-1]][1]) for run in self.my_runs]

    def _run_rows(self, run: Run) -> slice:
        return slice(self.rows[run.chunks[0]].start, self.rows[run.chunks[-1]].stop)

    # --- what a cell reads ------------------------------------------------------------------------------------
    def _senders(self, run: Run) -> list[int]:
        """The ranks that send a growing layer's rows before ``run``: every other rank holding some (of the parent,
        or of its earlier runs)."""
        earlier = {r.owner for r in self.runs[: run.index]}
        return sorted((self.parent_holders | earlier) - {run.owner})

    def _past(self, run: Run, i: int, blocks: list[list[Block | None]]) -> list[PastBlock]:
        """Layer ``i``'s rows before ``run``: received from the ranks that hold them, this rank's own of the parent
        and of its earlier runs."""
        device = self.kit.adapter.device
        past = past_blocks(self._own_rows(i, self._runs_before(run), blocks), None)
        tag = _Message(run, i, rows=True).tag
        for src in self._senders(run):
            message = self.transport.recv(src, tag, device, on_host=RUNS_HEADER)
            past += [PastBlock(rows, None, start) for start, rows in incoming_runs(message)]
        return in_position_order(past)

    def _recurrent_before(self, run: Run, i: int) -> tuple[Tensor, ...] | None:
        """Layer ``i``'s recurrent state before ``run``: the parent's, or the run before's (another rank's)."""
        if run.index == 0:
            return self.state.recurrent(i).tensors if self.state.chunks else None  # type: ignore[union-attr]
        source = self.runs[run.index - 1].owner
        return self.transport.recv(source, _Message(run, i, rows=False).tag, self.kit.adapter.device)

    # --- what this rank sends ---------------------------------------------------------------------------------
    def _messages(self, dst: int) -> list[_Message]:
        """Every message this rank sends ``dst``, in the order ``dst`` takes them."""
        rank, messages = self.ownership.rank, []
        for run, i in wavefront_cells(self.runs, self.kit.num_layers, dst):
            if self.kit.adapter.layers[i].mixer.grows:
                if rank in self._senders(run):
                    messages.append(_Message(run, i, rows=True))
            elif run.index > 0 and self.runs[run.index - 1].owner == rank:
                messages.append(_Message(run, i, rows=False))
        return messages

    def _ready(self, message: _Message) -> bool:
        """Whether this rank has computed what ``message`` carries."""
        if not message.rows:
            return (message.run.index - 1, message.layer) in self.done
        return all((r.index, message.layer) in self.done for r in self.my_runs if r.index < message.run.index)

    def _post(self, blocks: list[list[Block | None]] | None = None) -> None:
        """Send each peer the messages now ready, in the order it takes them (none past one not ready yet). Rows
        of the parent alone (``parent_rows``, sent before any computing: not waited for in the cells' window)."""
        for dst, queue in self.outbox.items():
            while queue and self._ready(queue[0]):
                message = queue.popleft()
                if message.rows:
                    earlier = self._runs_before(message.run)
                    kind = "rows" if earlier else "parent_rows"
                    self.transport.send(self._staged_rows(message.layer, earlier, blocks), dst, message.tag, kind)
                else:
                    state = self.after.pop((message.run.index - 1, message.layer))
                    self.transport.send(state, dst, message.tag, "recurrent")

    def _runs_before(self, run: Run) -> int:
        """How many of this rank's runs come before ``run``."""
        return sum(1 for r in self.my_runs if r.index < run.index)

    def _staged_rows(self, i: int, earlier: int, blocks: list[list[Block | None]] | None) -> list[Tensor]:
        """This rank's rows of layer ``i`` of the parent and of its first ``earlier`` runs, as a message (views of its
        arenas; staged through the host once for every peer and run that reads them)."""
        if (i, earlier) not in self.staged:
            self.staged[i, earlier] = self.transport.stage(outgoing_runs(self._own_rows(i, earlier, blocks)))
        return self.staged[i, earlier]

    def _own_rows(self, i: int, earlier: int, blocks: list[list[Block | None]] | None) -> list[tuple[int, Block]]:
        """This rank's rows of layer ``i``, positioned: of the parent, and of its first ``earlier`` runs (computed
        in earlier cells)."""
        own = self.state.positioned_blocks(i)
        for j in (j for r in self.my_runs[:earlier] for j in r.chunks):
            block = blocks[self.index[j]][i] if blocks is not None else None
            assert block is not None  # (a cell or a message reads only runs computed before it)
            own.append((self.pieces[j][0], block))
        return own

    # --- the child --------------------------------------------------------------------------------------------
    def _records(self, blocks: list[list[Block | None]], recurrent: list[list[RecurrentState | None]]) -> State:
        """The child state; recurrent states another rank computed are broadcast by it where this rank's later work
        reads them (the last chunk's, and the checkpoints exact mode's replicated reverse walk starts from)."""
        kit, state = self.kit, self.state
        recurrent_layers = [i for i, layer in enumerate(kit.adapter.layers) if not layer.mixer.grows]
        current = state
        for j, (a, b) in enumerate(self.pieces):
            mine = self.owners[j] == self.ownership.rank
            nothing: list[RecurrentState | None] = [None] * kit.num_layers
            record_blocks = blocks[self.index[j]] if mine else [None] * kit.num_layers
            states = recurrent[self.index[j]] if mine else nothing
            needed = self._keeps(j)
            if recurrent_layers and needed:
                states = self._shared_recurrent(states, recurrent_layers, self.owners[j])
            # a chunk whose states no rank shares is marked not kept: a replicated walk recomputes them from the
            # nearest kept state instead of reading them as absent (position 0)
            kept = needed or not recurrent_layers
            record = ChunkRecord(a, b - a, tuple(record_blocks), tuple(states), kept=kept, owner=self.owners[j])
            current = current.append(record)
        return current

    def _keeps(self, j: int) -> bool:
        """Whether every rank keeps the recurrent states after piece ``j``: the last, and the checkpoints a
        replicated walk starts from (the wavefront walk reads no checkpoint of another rank)."""
        return j == len(self.pieces) - 1 or (
            not self.keeps_inputs and self.state.keeps_checkpoint(len(self.state.chunks) + j)
        )

    def _shared_recurrent(
        self, states: list[RecurrentState | None], layers: list[int], src: int
    ) -> list[RecurrentState | None]:
        mine = src == self.ownership.rank
        flat = [t for i in layers for t in states[i].tensors] if mine else None  # type: ignore[union-attr]
        received = self.transport.broadcast_tensors(flat, src, self.kit.adapter.device)
        if mine:
            return states
        out: list[RecurrentState | None] = [None] * self.kit.num_layers
        at = 0
        for i in layers:
            count = len(self.kit.adapter.layers[i].mixer.state_shapes())
            out[i] = RecurrentState(received[at : at + count])
            at += count
        return out
