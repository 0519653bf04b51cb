"""Exact mode's reverse walk over a sharded capture, compute sharded: a wavefront over (rank, layer) that reads the
layer inputs the capture kept (``LayerInputs``). docs/distributed.md writes the schedule down."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from longstraw_agents.models.base import LayerContext, PastBlock
from longstraw_agents.state import Block, State, StateGrad

from .shards import RUNS_HEADER, ChunkOwners, StateShards, in_position_order, incoming_runs, outgoing_runs

# The most bytes of parameter gradient flattened for one sum over ranks (DDP's default bucket, 25 MiB): one flat
# copy of a whole model's gradient would hold a second gradient at once.
GRADIENT_BUCKET_BYTES = 25 * 2**20

if TYPE_CHECKING:
    from .engine import ChunkLoss, Engine


@dataclass(eq=False)
class LayerInputs:
    """What a sharded capture keeps on a rank for exact mode's wavefront walk: the input hidden states ``[n, hidden]``
    of the rank's chunks at every ``every``-th layer (the walk recomputes the layers between), each chunk's forward
    scratch before every layer (DSA's selection), the recurrent state before each of the rank's runs (recurrent
    layers), and the last layer's output: ``L / every + 1`` hidden vectors per position of the shard."""

    positions: Tensor
    rope: tuple[Tensor, Tensor]
    every: int = 1
    base: int = 0  # the first position of the extend whose inputs these are
    hidden: dict[int, Tensor] = field(default_factory=dict)
    scratch: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)  # layer -> the rank's chunk -> it
    recurrent: dict[int, list[tuple[Tensor, ...] | None]] = field(default_factory=dict)  # layer -> per run
    final: Tensor | None = None

    @classmethod
    def empty(cls, device: torch.device, every: int, base: int) -> LayerInputs:
        """The inputs of a rank without chunks (filled in when it has some) of an extend from ``base``."""
        nothing = torch.empty(0, device=device)
        return cls(nothing.long(), (nothing, nothing), every, base)

    def add_cell(
        self,
        i: int,
        rows: slice,
        h: Tensor,
        scratch: dict[int, dict[str, Any]],
        recurrent: tuple[Tensor, ...] | None,
    ) -> None:
        """Layer ``i``'s inputs of one of the rank's runs (its ``rows`` of ``h``, its chunks' scratch by index among
        the rank's chunks, the recurrent state before it), kept before the layer computes them; the rank's runs
        come in position order at each layer."""
        if i % self.every == 0:
            if i not in self.hidden:
                self.hidden[i] = torch.empty_like(h)
            self.hidden[i][rows] = h[rows]
        self.scratch.setdefault(i, {}).update({k: dict(s) for k, s in scratch.items()})
        self.recurrent.setdefault(i, []).append(None if recurrent is None else tuple(t.clone() for t in recurrent))

    @staticmethod
    def planned_nbytes(positions: int, hidden_size: int, itemsize: int, layers: int, every: int) -> int:
        """What a rank keeps for ``positions`` of its shard, analytically: one hidden vector per position at every
        ``every``-th layer and after the last. (The recurrent states before the rank's runs and DSA's selections
        add a few per layer, not per position.)"""
        return positions * hidden_size * itemsize * (math.ceil(layers / every) + 1)

    @property
    def nbytes(self) -> int:
        states = [t for per_run in self.recurrent.values() for r in per_run if r is not None for t in r]
        tensors = [*self.hidden.values(), *states, *([] if self.final is None else [self.final])]
        scratch = {
            id(v): v for layer in self.scratch.values() for chunk in layer.values() for v in chunk.values()
            if torch.is_tensor(v)
        }  # fmt: skip
        return sum(t.numel() * t.element_size() for t in [*tensors, *scratch.values()])


# + the layer index (< 4096 layers): rows for a layer's backward, for its forward recomputation, their gradients, a
# recurrent state's gradient, the gradient of a later rank's context rows (sent when the walk is done)
_ROWS_TAG, _RECOMPUTE_ROWS_TAG, _ROW_GRADS_TAG, _RECURRENT_GRAD_TAG = 1 << 12, 2 << 12, 3 << 12, 4 << 12
_CONTEXT_GRADS_TAG = 5 << 12


class WavefrontWalk:
    """Exact mode's reverse walk over a sharded extend (``ShardedCapture``: a capture from position 0, or a long
    extend after ``since`` — a long turn, a member's long history), compute sharded: each rank backpropagates only
    its own chunks, layer by layer from the last, reading the layer inputs the capture kept.

    Layer i on rank r needs the gradient of its chunks' outputs of layer i — from its own layer i+1 — and of the
    state rows it holds of layer i — from every later query, i.e. its own later chunks and every later rank's
    chunks at layer i. So rank r walks layer i once it has finished layer i+1 and the later ranks have finished layer
    i: a wavefront from the last rank, whose critical path is ``layers + ranks - 1`` layer steps (the naive order,
    each rank walking all its layers after the later ranks finished all theirs, is their product). The messages:

    - before the walk, each rank posts its rows of every growing layer to the later computing ranks (views of its
      arenas, sent device to device; staged through the host, one host copy per layer), in the order they are
      taken: a receiver takes layer i's when it recomputes or backpropagates the layer and drops them after (one
      layer's at a time; a recomputed layer's rows travel twice); it attends to them with gradient sinks of their
      own, and sends those sinks (the gradient for the earlier rank's K/V) back to their owner once its layer i is
      done, where they are added into the state's gradient;
    - after ``since``, the earlier ranks' queries read the context rows the later ranks hold too: a later rank posts
      those of layer i as its own step i ends (after the gradient it sends the same rank), and the gradient the
      earlier ranks' queries give them (``into_since``) goes back once their walk is done (until then each rank
      holds it: at most the context's state gradient);
    - a recurrent layer's state gradient before a rank's first chunk goes to the rank that holds the chunk before;
      the extend's first chunk's, the gradient of ``since``'s last recurrent state, is broadcast when the walk is
      done (every rank holds that state).

    The replicated part of the parameters' gradient (the branch replays, which every rank ran) is divided by the
    number of ranks before the walk, and the sum over ranks afterwards restores it and adds every rank's share of the
    prefix's (an exact division: cp sizes are powers of two in practice; any size is correct to rounding)."""

    def __init__(
        self,
        engine: Engine,
        shards: StateShards,
        state: State,
        grad: StateGrad,
        ids: Tensor,
        loss_fn: ChunkLoss | None,
        since: State | None = None,
        into_since: bool = True,
    ):
        self.engine, self.state, self.grad, self.ids, self.loss_fn = engine, state, grad, ids, loss_fn
        self.ownership, self.transport = shards.ownership, shards.transport
        inputs = state.layer_inputs
        assert isinstance(inputs, LayerInputs)  # the engine walks only states a sharded capture gave inputs
        self.inputs, self.since = inputs, since
        self.base = since.num_tokens if since is not None else 0
        self.into_since = into_since and self.base > 0  # (nothing before position 0)
        self.first = next(j for j, chunk in enumerate(state.chunks) if chunk.start >= self.base)  # the extend's first
        rank = self.ownership.rank
        # the extend's even cut: each rank's chunks contiguous, in rank order
        extend = ChunkOwners.of([c.owner for c in state.chunks[self.first :]], rank)
        self.owners = [c.owner for c in state.chunks]
        self.mine = [self.first + j for j in extend.mine]
        self.computing = extend.computing
        self.context_holders = sorted({c.owner for c in state.chunks[: self.first]})
        holders = sorted({*self.computing, *self.context_holders})
        # who sends this rank rows: the earlier ranks holding any (posted before the walk), the later ones holding
        # context rows (posted as they walk)
        self.posted_by = [src for src in holders if src < rank] if self.mine else []
        self.walked_by = [src for src in self.context_holders if src > rank] if self.mine else []
        self.lo = state.chunks[self.mine[0]].start if self.mine else self.base
        self.segment: dict[int, Tensor | None] = {}  # the current segment's layer inputs (recomputed from its first)
        # recurrent layers the segment recomputed: the state before each of this rank's chunks
        self.states_before: dict[int, list[tuple[Tensor, ...] | None]] = {}
        # per later rank, the gradient of its context rows this rank's queries read, a layer at a time (walk order)
        self.context_grads: dict[int, list[tuple[Tensor, ...]]] = {}
        self.since_recurrent: dict[int, tuple[Tensor, ...]] = {}  # per layer, the gradient of since's last state
        self.context_rows: dict[int, list[Tensor]] = {}  # per layer, the context rows staged for the earlier ranks

    def run(self) -> None:
        engine = self.engine
        # Every rank ends the walk with the whole parameter gradient: its own share of the walk added to the
        # replicated part (the branch replays every rank ran), divided by the ranks now and summed over them after.
        # With sharded weights, a layer's gradient is reduced into its shards (a sum over the ranks) as its step of
        # the walk ends: only the root's (embeddings, final norm, LM head), whole through the step, is summed here.
        params = engine.weights.root_parameters() if engine.weights is not None else list(engine.model.parameters())
        params = [p for p in params if p.requires_grad]
        had_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.float64)
        for p in params:
            if p.grad is not None:
                p.grad.div_(self.ownership.size)
        self._post_rows()
        engine.announce(self._gather_order())
        g = self._seed()
        for i in reversed(range(engine.num_layers)):
            with engine.gathered(i, partial=True):  # each rank adds its share of the layer's gradient
                layer_input = self._input(i)  # (recomputed before waiting for the later ranks; None without chunks)
                if engine.adapter.layers[i].mixer.grows:
                    self._add_row_grads(i)
                    g = self._backward_growing(i, g, layer_input)
                    self._post_context_rows([i], _ROWS_TAG)
                else:
                    g = self._backward_recurrent(i, g, layer_input)
            for kind in ("state_grad", "context_rows"):  # a window of layers in flight
                self.transport.flush(kind, keep=self.ownership.size**2)
        if g is not None:  # into the embeddings of this rank's tokens
            with torch.enable_grad():
                at = self.lo - self.base
                h, _, _ = engine.adapter.embed(self.ids[at : at + g.shape[0]], self.lo)
                h.backward(g)
        self._exchange_context_grads()
        self.transport.flush()
        self._into_since_recurrent()
        engine.settle()
        self._sum_parameter_grads(params, had_grad)

    def _gather_order(self) -> list[int]:
        """The layers the walk gathers, in order: per segment from the last, its top (whose block is open while the
        segment's inputs are recomputed), the layers below it ascending (the recomputation), then descending (the
        backward)."""
        every, layers = self.inputs.every, self.engine.num_layers
        order: list[int] = []
        for first in reversed(range(0, layers, every)):
            top = min(first + every, layers) - 1
            order += [top, *range(first, top), *range(top - 1, first - 1, -1)]
        return order

    # --- messages ---------------------------------------------------------------------------------------------
    def _sinked(self, position: int) -> bool:
        """Whether rows from ``position`` on get a gradient: the extend's always, ``since``'s with ``into_since``."""
        return position >= self.base or self.into_since

    def _own_rows(self, i: int, context_only: bool = False) -> list[tuple[int, Block]]:
        """This rank's rows of layer ``i`` (only ``since``'s: ``context_only``), cut at the extend's start."""
        rows = []
        for position, block in self.state.positioned_blocks(i):
            for lo, hi in _cut(position, block.length, self.base):
                if not context_only or lo < self.base:
                    rows.append((lo, Block(block.arena, block.lo + lo - position, block.lo + hi - position)))
        return rows

    def _past(self, message: Sequence[Tensor], sinks: bool) -> list[PastBlock]:
        """The rows another rank sent, cut at the extend's start, with gradient sinks of their own (``sinks``) where
        they get a gradient."""
        blocks = []
        for start, rows in incoming_runs(message):
            for lo, hi in _cut(start, rows[0].shape[0], self.base):
                part = tuple(t[lo - start : hi - start] for t in rows)
                grads = tuple(self.grad.zeros_like(t) for t in part) if sinks and self._sinked(lo) else None
                blocks.append(PastBlock(part, grads, lo))
        return blocks

    def _add_into_own(self, message: Sequence[Tensor], rows: list[tuple[int, Block]]) -> None:
        """Add ``message`` — the gradient of those of ``rows`` that get one, back to back — into the state's."""
        offset = 0
        for position, block in rows:
            if self._sinked(position):
                for buffer, part in zip(self.grad.block_grads(block), message, strict=True):
                    buffer.add_(part[offset : offset + block.length])
                offset += block.length

    def _post_rows(self) -> None:
        """Start sending this rank's rows of every growing layer to the later computing ranks, in the order they
        are received: per segment from the last, its recomputed layers ascending (``_input``), then every layer of
        it descending (the backward). A receiver holds one layer's rows at a time; the rows of a recomputed layer
        travel twice."""
        rank = self.ownership.rank
        later = [dst for dst in self.computing if dst > rank]
        if not later or not (self.mine or rank in self.context_holders):
            return
        every, layers = self.inputs.every, self.engine.num_layers
        staged: dict[int, list[Tensor]] = {}  # a layer's message, for every destination and both tags
        for first in reversed(range(0, layers, every)):
            top = min(first + every, layers) - 1
            order = [(i, _RECOMPUTE_ROWS_TAG) for i in range(first, top)]
            order += [(i, _ROWS_TAG) for i in range(top, first - 1, -1)]
            for i, tag in order:
                if not self.engine.adapter.layers[i].mixer.grows:
                    continue
                if i not in staged:
                    staged[i] = self.transport.stage(outgoing_runs(self._own_rows(i)))
                for dst in later:
                    self.transport.send(staged[i], dst, tag + i, "rows")

    def _post_context_rows(self, layers: Sequence[int], tag: int) -> None:
        """Send this rank's context rows of ``layers`` to the earlier computing ranks, which take them in this order
        (a segment's recomputation as it is entered, a layer's backward after its gradient from this rank). One message
        per layer serves both (dropped after the backward's); the sends are flushed in a window each step."""
        rank = self.ownership.rank
        earlier = [dst for dst in self.computing if dst < rank]
        if not earlier or rank not in self.context_holders:
            return
        for i in layers:
            if self.engine.adapter.layers[i].mixer.grows:
                if i not in self.context_rows:
                    self.context_rows[i] = self.transport.stage(outgoing_runs(self._own_rows(i, context_only=True)))
                rows = self.context_rows[i] if tag == _RECOMPUTE_ROWS_TAG else self.context_rows.pop(i)
                for dst in earlier:
                    self.transport.send(rows, dst, tag + i, "context_rows")

    def _receive_rows(self, i: int, tag: int, sinks: bool) -> list[tuple[int, PastBlock]]:
        """The other ranks' rows of layer ``i`` (``tag``: for its backward or its recomputation), each with the rank
        that sent it."""
        received = []
        for src in self.posted_by + self.walked_by:
            message = self.transport.recv(src, tag + i, self.engine.adapter.device, on_host=RUNS_HEADER)
            received += [(src, block) for block in self._past(message, sinks)]
        return received

    def _add_row_grads(self, i: int) -> None:
        """Add what the later ranks' queries sent back for this rank's rows of layer ``i`` into the state gradient."""
        rank = self.ownership.rank
        own = self._own_rows(i)
        if not any(self._sinked(position) for position, _ in own):
            return
        for src in self.computing:
            if src > rank:
                self._add_into_own(self.transport.recv(src, _ROW_GRADS_TAG + i, self.engine.adapter.device), own)

    def _exchange_context_grads(self) -> None:
        """Once the walk is done: send the gradient of the later ranks' context rows, and add what the earlier
        ranks' queries gave this rank's (every growing layer, from the last)."""
        growing = [i for i in reversed(range(self.engine.num_layers)) if self.engine.adapter.layers[i].mixer.grows]
        for dst, per_layer in self.context_grads.items():
            for i, grads in zip(growing, per_layer, strict=True):
                self.transport.send(grads, dst, _CONTEXT_GRADS_TAG + i, "state_grad")
        rank = self.ownership.rank
        if not self.into_since or rank not in self.context_holders:
            return
        for src in [q for q in self.computing if q < rank]:
            for i in growing:
                message = self.transport.recv(src, _CONTEXT_GRADS_TAG + i, self.engine.adapter.device)
                self._add_into_own(message, self._own_rows(i, context_only=True))

    def _into_since_recurrent(self) -> None:
        """The gradient of ``since``'s last recurrent states, from the rank that walked the extend's first chunk,
        added on every rank (each holds those states)."""
        recurrent = [i for i, layer in enumerate(self.engine.adapter.layers) if not layer.mixer.grows]
        if not self.into_since or not recurrent or self.since is None:
            return
        src = self.owners[self.first]
        mine = src == self.ownership.rank
        flat = [t for i in recurrent for t in self.since_recurrent[i]] if mine else None
        received = self.transport.broadcast_tensors(flat, src, self.engine.adapter.device)
        at = 0
        for i in recurrent:
            rec = self.since.chunks[-1].recurrent[i]
            assert rec is not None  # a state after position 0 keeps its last recurrent states
            buffers = self.grad.recurrent_grads(rec)
            for buffer, part in zip(buffers, received[at : at + len(buffers)], strict=True):
                buffer.add_(part)
            at += len(buffers)

    # --- the walk ---------------------------------------------------------------------------------------------
    def _rows(self, j: int) -> slice:
        chunk = self.state.chunks[j]
        return slice(chunk.start - self.lo, chunk.end - self.lo)

    def _layer(
        self, i: int, j: int, x: Tensor, ctx: LayerContext, scratch: dict[str, Any]
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        rows, inputs = self._rows(j), self.inputs
        rope = (inputs.rope[0][rows], inputs.rope[1][rows])
        layer, start = self.engine.adapter.layers[i], self.state.chunks[j].start
        return self.engine.adapter.run_layer(
            layer, x, inputs.positions[rows], rope, ctx, dict(scratch), self.engine.local_attention, start
        )

    def _seed(self) -> Tensor | None:
        """The gradient of the loss (``loss_fn`` over this rank's chunks) w.r.t. the last layer's output."""
        if not self.mine or self.loss_fn is None:
            return None
        assert self.inputs.final is not None  # the capture keeps it
        g: Tensor | None = None
        for j in self.mine:  # a chunk's graph at a time (an agent's history has loss all along)
            chunk, rows = self.state.chunks[j], self._rows(j)
            with torch.enable_grad():
                x = self.inputs.final[rows].detach().requires_grad_(True)
                loss = self.loss_fn(self.engine.adapter.final_norm(x), chunk.start, chunk.end)
                if loss is None:
                    continue
                loss.backward()
            if x.grad is not None:
                g = torch.zeros_like(self.inputs.final) if g is None else g
                g[rows] = x.grad
        return g

    def _input(self, i: int) -> Tensor | None:
        """Layer ``i``'s input on this rank: kept by the capture at the first layer of each segment, the others
        recomputed forward from it, a segment at a time, when the walk enters the segment (from its top). None on a
        rank without chunks (which still gathers the segment's layers with the others)."""
        if i not in self.segment:
            first = i - i % self.inputs.every
            self._post_context_rows(range(first, i), _RECOMPUTE_ROWS_TAG)  # the earlier ranks recompute them too
            h: Tensor | None = self.inputs.hidden.get(first)
            for layer in range(first, i + 1):
                self.segment[layer] = h
                if layer < i:
                    h = self._forward_layer(layer, h)
        return self.segment.pop(i)

    def _forward_layer(self, i: int, h: Tensor | None) -> Tensor | None:
        """Layer ``i`` over this rank's chunks without a graph (recomputing a segment's inputs); None without
        chunks. Every rank gathers the layer's weights (a collective when they are sharded)."""
        with self.engine.gathered(i):
            return None if h is None else self._recompute_layer(i, h)

    def _recompute_layer(self, i: int, h: Tensor) -> Tensor:
        layer, out = self.engine.adapter.layers[i], torch.empty_like(h)
        carried = self.inputs.recurrent[i][0]  # (one run per rank: the cut in rank order)
        befores: list[tuple[Tensor, ...] | None] = []
        remote = [b for _, b in self._receive_rows(i, _RECOMPUTE_ROWS_TAG, sinks=False)] if layer.mixer.grows else []
        with torch.no_grad():
            for k, j in enumerate(self.mine):
                span = self._rows(j)
                if layer.mixer.grows:
                    own = self.engine.past_blocks(self.state.positioned_blocks(i, j), None)
                    ctx = LayerContext(past=in_position_order([*remote, *own]))
                else:
                    befores.append(carried)
                    ctx = LayerContext(recurrent=carried)
                out[span], new = self._layer(i, j, h[span], ctx, self.inputs.scratch[i][k])
                carried = new
        if not layer.mixer.grows:
            self.states_before[i] = befores  # the layer's backward starts each chunk from these
        return out

    def _backward_growing(self, i: int, g: Tensor | None, layer_input: Tensor | None) -> Tensor | None:
        """Layer ``i`` (attention / MLA) of this rank's chunks, last chunk first; returns the gradient of its input."""
        if layer_input is None:
            return None
        received = self._receive_rows(i, _ROWS_TAG, sinks=True)  # sinks of their own, sent back to the owners
        remote = [block for _, block in received]
        frozen_before = 0 if self.into_since else self.base
        g_in = torch.zeros_like(layer_input)
        for k in reversed(range(len(self.mine))):
            j = self.mine[k]
            chunk, span = self.state.chunks[j], self._rows(j)
            own = self.engine.past_blocks(self.state.positioned_blocks(i, j), self.grad, frozen_before)
            block = chunk.blocks[i]
            upstream = self.grad.existing_block_grads(block) if block is not None else None
            with torch.enable_grad():
                x = layer_input[span].detach().requires_grad_(True)
                past = in_position_order([*remote, *own])
                out, new = self._layer(i, j, x, LayerContext(past=past), self.inputs.scratch[i][k])
                self._backpropagate(out, g, span, new, upstream)
            if x.grad is not None:
                g_in[span] = x.grad
        rank = self.ownership.rank
        for src in dict.fromkeys(src for src, _ in received):  # the other ranks' K/V gradient, to their owners
            grads = _joined([block.grads for s, block in received if s == src and block.grads is not None])
            if grads is None:
                continue
            if src < rank:
                self.transport.send(grads, src, _ROW_GRADS_TAG + i, "state_grad")
            else:  # a later rank's context rows: once the walk is done
                self.context_grads.setdefault(src, []).append(grads)
        context = {id(block.arena) for _, block in self._own_rows(i, context_only=True)}
        for _, block in self._own_rows(i):
            if id(block.arena) not in context:  # (the context's gradient is walked later, whoever added to it)
                self.grad.release_arena(block.arena)
        return g_in

    def _backward_recurrent(self, i: int, g: Tensor | None, layer_input: Tensor | None) -> Tensor | None:
        """Layer ``i`` (GatedDeltaNet) of this rank's chunks: the states before each recomputed forward from the one
        before the rank's first chunk, then each chunk backpropagated last first, the state gradient carried back."""
        if layer_input is None:
            return None
        carry = self._recurrent_grad_after_last(i)
        if i not in self.states_before:  # the top of a segment: not recomputed yet
            self._forward_layer(i, layer_input)
        befores = self.states_before.pop(i)
        g_in = torch.zeros_like(layer_input)
        for k in reversed(range(len(self.mine))):
            j, rows = self.mine[k], self._rows(self.mine[k])
            with torch.enable_grad():
                before = befores[k]
                leaves = None if before is None else tuple(t.detach().requires_grad_(True) for t in before)
                x = layer_input[rows].detach().requires_grad_(True)
                out, new = self._layer(i, j, x, LayerContext(recurrent=leaves), self.inputs.scratch[i][k])
                self._backpropagate(out, g, rows, new, carry)
            if x.grad is not None:
                g_in[rows] = x.grad
            carry = (
                None if leaves is None else tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves)
            )
        if self.mine[0] > self.first:
            assert carry is not None  # a chunk after position 0 starts from a state
            self.transport.send(carry, self.owners[self.mine[0] - 1], _RECURRENT_GRAD_TAG + i, "state_grad")
        elif self.into_since and carry is not None:  # the gradient of since's last state: broadcast after the walk
            self.since_recurrent[i] = carry
        return g_in

    def _recurrent_grad_after_last(self, i: int) -> tuple[Tensor, ...] | None:
        last = self.mine[-1]
        if last + 1 < len(self.state.chunks):
            return self.transport.recv(self.owners[last + 1], _RECURRENT_GRAD_TAG + i, self.engine.adapter.device)
        rec = self.state.chunks[last].recurrent[i]
        found = None if rec is None else self.grad.existing_recurrent_grads(rec)
        if rec is not None:
            self.grad.release_recurrent(rec)
        return found

    @staticmethod
    def _backpropagate(
        out: Tensor, g: Tensor | None, rows: slice, new: tuple[Tensor, ...], upstream: Sequence[Tensor] | None
    ) -> None:
        outputs: list[Tensor] = []
        grads: list[Tensor] = []
        if g is not None:
            outputs.append(out)
            grads.append(g[rows])
        if upstream is not None:
            outputs.extend(new)
            grads.extend(u.to(o.dtype) for o, u in zip(new, upstream, strict=True))
        if outputs:
            torch.autograd.backward(outputs, grads)

    def _sum_parameter_grads(self, params: list[nn.Parameter], had_grad: Tensor) -> None:
        """Every rank's parameter gradient summed over the ranks, in place, in flat buckets of one dtype (models
        keep some parameters in fp32, e.g. routers) of at most ``GRADIENT_BUCKET_BYTES`` (a larger gradient is
        summed where it lies); a parameter no rank gave a gradient keeps none (as in one process: an optimizer
        skips it)."""
        has = had_grad + torch.tensor([p.grad is not None for p in params], dtype=torch.float64)
        somewhere = self.transport.sum_(has, "param_grads").tolist()
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for p, found in zip(params, somewhere, strict=True):
            if found:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            for bucket in _buckets(grads, GRADIENT_BUCKET_BYTES):
                if len(bucket) == 1 and bucket[0].is_contiguous():
                    self.transport.sum_(bucket[0], "param_grads")
                    continue
                flat = self.transport.sum_(torch.cat([g.reshape(-1) for g in bucket]), "param_grads")
                offset = 0
                for g in bucket:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()


def _cut(start: int, length: int, at: int) -> list[tuple[int, int]]:
    """``[start, start + length)`` as one or two ``(lo, hi)`` ranges, cut at position ``at``."""
    end = start + length
    return [(start, at), (at, end)] if start < at < end else [(start, end)]


def _joined(parts: list[tuple[Tensor, ...]]) -> tuple[Tensor, ...] | None:
    """Per state tensor, the ``parts`` back to back (None for none)."""
    return tuple(torch.cat(tensors) for tensors in zip(*parts, strict=True)) if parts else None


def _buckets(tensors: list[Tensor], limit: int) -> list[list[Tensor]]:
    """``tensors`` in order, cut into runs of at most ``limit`` bytes (a larger tensor alone)."""
    buckets: list[list[Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not buckets or size + nbytes > limit:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += nbytes
    return buckets
