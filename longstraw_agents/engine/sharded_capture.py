"""An extend under context parallelism whose compute is sharded (a capture): each rank evaluates only the chunks
of its own positions, layer by layer across them, and the ranks meet in a wavefront. docs/distributed.md writes the
schedule down; ``ShardedCapture`` is it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from longstraw_agents.models.base import LayerContext, PastBlock
from longstraw_agents.state import Block, ChunkRecord, RecurrentState, State

from .shards import RUNS_HEADER, ChunkOwners, StateShards, in_position_order, incoming_runs, outgoing_runs
from .wavefront import LayerInputs

if TYPE_CHECKING:
    from .engine import Engine


class ShardedCapture:
    """Each rank evaluates only the chunks of its own positions, layer by layer across them (holding its shard's
    hidden states between layers), and the ranks meet in a wavefront — what layer i needs of earlier positions
    arrives from the ranks that hold them:

    - a growing layer (attention, MLA + DSA index keys): every rank that holds earlier rows of the layer (from the
      parent state, or computed in this extend) sends them to each later rank that computes here, once it has
      computed its own; the parent's rows held by a later rank go to the earlier computing ranks before the
      capture starts (they are state, not results: waiting for them would hold every rank to the last); the
      receiver attends to them as ordinary past blocks (one process's arithmetic) and drops them after the layer;
    - a recurrent layer (GatedDeltaNet): the state after a rank's last chunk goes to the rank computing the next
      chunk.

    Every message computed here goes from a lower rank to a higher one, so rank r finishes layer i after rank r-1
    did: the critical path is ``layers + ranks - 1`` layer steps of one shard, not their product. Afterwards the owners
    broadcast the recurrent states every rank's later work reads (the last, and the replicated walk's checkpoints);
    attention rows stay with their owners. Used where the new tokens are at least as many as the parent's (a
    capture: moving the earlier rows there costs no more than the rows computed) or as
    ``EngineConfig.sharded_extend_tokens``; a short extend (a turn, a branch)
    instead runs replicated with partials merged (``Attention.shards``), which moves only the new tokens' partials.

    An extend of a state with checkpoints (exact mode's capture, a long leaf walked chunk by chunk), with
    ``EngineConfig.wavefront_walk``, keeps this rank's layer inputs on the child state (``State.layer_inputs``) for
    the wavefront walk instead of sharing checkpoints: the walk back to the parent then runs sharded too."""

    def __init__(self, engine: Engine, shards: StateShards, state: State, ids: Tensor, chunk: int):
        self.engine, self.state, self.ids = engine, state, ids
        self.ownership, self.transport = shards.ownership, shards.transport
        self.base = state.num_tokens
        pieces = engine.pieces(state, ids.shape[0], chunk, sharded=True)
        self.pieces = [(self.base + lo, self.base + hi) for lo, hi, _ in pieces]
        chunks = ChunkOwners.of([owner for _, _, owner in pieces], self.ownership.rank)
        self.owners, self.mine, self.computing = chunks.owners, chunks.mine, chunks.computing
        # the ranks holding rows of the parent, and of the parent or this extend once it is done
        self.parent_holders = {c.owner for c in state.chunks}
        self.holders = self.parent_holders | set(self.computing)
        self.keeps_inputs = engine.config.wavefront_walk and state.checkpoints > 0

    def run(self, reserve: int) -> State:
        """The child state."""
        engine, adapter = self.engine, self.engine.adapter
        mine = [self.pieces[j] for j in self.mine]
        width = sum(b - a for a, b in mine)
        arenas = engine.arenas_for(self.state, width, engine.reserve_share(reserve))
        blocks: list[list[Block | None]] = [[None] * engine.num_layers for _ in mine]
        recurrent: list[list[RecurrentState | None]] = [[None] * engine.num_layers for _ in mine]
        # every rank keeps inputs (empty without chunks), so that every rank picks the wavefront walk
        inputs = (
            LayerInputs.empty(adapter.device, engine.layer_inputs_spacing, self.base) if self.keeps_inputs else None
        )
        kept_after = [self._keeps(j) for j in self.mine]  # chunks whose states are kept
        engine.announce(range(engine.num_layers))  # every rank gathers every layer, in order
        self._post_parent_rows()
        with torch.no_grad():
            if mine:
                lo = mine[0][0]
                h, positions, rope = adapter.embed(self.ids[lo - self.base : mine[-1][1] - self.base], lo)
                scratch: list[dict[str, Any]] = [{} for _ in mine]  # each chunk's forward scratch, across layers
                if inputs is not None:
                    inputs.positions, inputs.rope = positions, rope
            for i, layer in enumerate(adapter.layers):
                if layer.mixer.grows:
                    past = self._earlier_rows(i) if mine else []
                else:
                    carried = self._recurrent_before(i)
                if mine and inputs is not None:
                    inputs.add_layer(i, h, scratch, None if layer.mixer.grows else carried)
                with engine.gathered(i):  # every rank, computing or not (a collective with sharded weights)
                    for k, (a, b) in enumerate(mine):
                        rows = slice(a - lo, b - lo)
                        ctx = LayerContext(past=list(past)) if layer.mixer.grows else LayerContext(recurrent=carried)
                        h[rows], new = adapter.run_layer(
                            layer, h[rows], positions[rows], (rope[0][rows], rope[1][rows]), ctx, scratch[k],
                            engine.local_attention, a,
                        )  # fmt: skip
                        if layer.mixer.grows:
                            arena = arenas[i]
                            assert arena is not None  # sized for this rank's rows
                            written = arena.append(new)
                            blocks[k][i] = written
                            past.append(PastBlock(written.views(), None, a))
                        else:
                            carried = new
                            if kept_after[k]:
                                recurrent[k][i] = RecurrentState.owning(new)
                self._pass_on(i, layer.mixer.grows, blocks, carried if not layer.mixer.grows and mine else None)
                # a window of messages in flight: the later ranks trail by up to N - 1 layers in the wavefront
                for kind in ("rows", "recurrent"):
                    self.transport.flush(kind, keep=self.ownership.size**2)
            self.transport.flush()
        child = self._records(blocks, recurrent)
        if inputs is not None:
            inputs.final = h if mine else None
            child = child.with_layer_inputs(inputs)
        return child

    def _earlier_rows(self, i: int) -> list[PastBlock]:
        """Layer ``i``'s rows before this rank's chunks: received from the ranks that hold them (the earlier ranks'
        of the parent and this extend, the later ranks' of the parent), and this rank's own of the parent."""
        rank, past = self.ownership.rank, []
        for src in sorted(self.holders - {rank}):
            if src < rank or src in self.parent_holders:
                message = self.transport.recv(src, i, self.engine.adapter.device, on_host=RUNS_HEADER)
                past += [PastBlock(rows, None, start) for start, rows in incoming_runs(message)]
        past += self.engine.past_blocks(self.state.positioned_blocks(i), None)  # this rank's own, earlier
        return in_position_order(past)

    def _post_parent_rows(self) -> None:
        """Start sending this rank's rows of the parent, every growing layer in order, to the earlier ranks that
        compute here (views of its arenas; staged through the host, a host copy of the rank's share of the
        state)."""
        rank = self.ownership.rank
        earlier = [dst for dst in self.computing if dst < rank]
        if rank not in self.parent_holders or not earlier:
            return
        for i, layer in enumerate(self.engine.adapter.layers):
            if layer.mixer.grows:
                rows = self.transport.stage(outgoing_runs(self.state.positioned_blocks(i)))
                for dst in earlier:
                    self.transport.send(rows, dst, i, "parent_rows")

    def _recurrent_before(self, i: int) -> tuple[Tensor, ...] | None:
        """Layer ``i``'s recurrent state before this rank's first chunk: the parent's, or the previous rank's."""
        if not self.mine:
            return None
        if self.mine[0] == 0:
            return self.state.recurrent(i).tensors if self.state.chunks else None  # type: ignore[union-attr]
        return self.transport.recv(self.owners[self.mine[0] - 1], i, self.engine.adapter.device)

    def _pass_on(
        self, i: int, grows: bool, blocks: list[list[Block | None]], carried: tuple[Tensor, ...] | None
    ) -> None:
        """Send what later ranks need of layer ``i``: this rank's rows, or the recurrent state after its chunks."""
        rank = self.ownership.rank
        if grows:
            if rank not in self.holders:
                return
            own = self.state.positioned_blocks(i)
            starts = [self.pieces[j][0] for j in self.mine]
            own += [(a, row[i]) for a, row in zip(starts, blocks, strict=True) if row[i] is not None]  # type: ignore[misc]
            rows = self.transport.stage(outgoing_runs(own))  # staged once for every destination
            for dst in self.computing:
                if dst > rank:
                    self.transport.send(rows, dst, i, "rows")
        elif carried is not None and self.mine[-1] + 1 < len(self.pieces):
            self.transport.send(carried, self.owners[self.mine[-1] + 1], i, "recurrent")

    def _records(self, blocks: list[list[Block | None]], recurrent: list[list[RecurrentState | None]]) -> State:
        """The child state; recurrent states another rank computed are broadcast by it where this rank's later work
        reads them (the last chunk's, and the checkpoints exact mode's replicated reverse walk starts from)."""
        engine, state = self.engine, self.state
        recurrent_layers = [i for i, layer in enumerate(engine.adapter.layers) if not layer.mixer.grows]
        current, k = state, 0
        for j, (a, b) in enumerate(self.pieces):
            mine = self.owners[j] == self.ownership.rank
            nothing: list[RecurrentState | None] = [None] * engine.num_layers
            record_blocks = blocks[k] if mine else [None] * engine.num_layers
            states = recurrent[k] if mine else nothing
            needed = self._keeps(j)
            if recurrent_layers and needed:
                states = self._shared_recurrent(states, recurrent_layers, self.owners[j])
            # a chunk whose states no rank shares is marked not kept: a replicated walk recomputes them from the
            # nearest kept state instead of reading them as absent (position 0)
            kept = needed or not recurrent_layers
            record = ChunkRecord(a, b - a, tuple(record_blocks), tuple(states), kept=kept, owner=self.owners[j])
            current = current.append(record)
            k += mine
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
        received = self.transport.broadcast_tensors(flat, src, self.engine.adapter.device)
        if mine:
            return states
        out: list[RecurrentState | None] = [None] * self.engine.num_layers
        at = 0
        for i in layers:
            count = len(self.engine.adapter.layers[i].mixer.state_shapes())
            out[i] = RecurrentState(received[at : at + count])
            at += count
        return out
