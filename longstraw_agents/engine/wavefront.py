"""Exact mode's reverse walk over a sharded capture, compute sharded: a wavefront over (run, layer) that reads the
layer inputs the capture kept (``LayerInputs``). docs/distributed.md writes the schedule down."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from longstraw_agents.models.base import LayerContext, PastBlock
from longstraw_agents.state import Block, State, StateGrad

from .kit import ChunkLoss, ExecutionKit, past_blocks
from .schedule import (
    Run,
    SegmentRecompute,
    WalkEvent,
    WaveGather,
    runs_of,
    walk_cells,
    walk_gather_order,
    walk_schedule,
    waves,
)
from .shards import RUNS_HEADER, StateShards, in_position_order, incoming_runs, outgoing_runs
from .tags import MessageKind, check_tag_bounds, message_tag

# The most bytes of parameter gradient flattened for one sum over ranks (DDP's default bucket, 25 MiB): one flat
# copy of a whole model's gradient would hold a second gradient at once.
GRADIENT_BUCKET_BYTES = 25 * 2**20

# the messages that carry state rows (ready before the walk), not gradients
_ROWS_KINDS = (MessageKind.WALK_ROWS, MessageKind.WALK_RECOMPUTE_ROWS)


@dataclass(frozen=True)
class _Message:
    """A message of the walk, named by the cell it serves: ``src``'s rows of layer ``layer`` before run ``run`` (for
    the cell's backward, or its segment's recomputation), the gradient cell ``(run, layer)`` gives ``src``'s rows
    before it (``ROW_GRADS``: sent by the run's owner, ``src``), or the gradient of the recurrent state before run
    ``run`` (``RECURRENT_GRAD``, from its owner)."""

    kind: MessageKind
    run: int
    layer: int
    src: int

    @property
    def tag(self) -> int:
        return message_tag(self.kind, self.run, self.layer)


class WavefrontWalk:
    """Exact mode's reverse walk over a sharded extend (``ShardedCapture``: a capture from position 0, or a long
    extend after ``since`` — a long turn, a member's long history), compute sharded: each rank backpropagates only
    its own chunks, a run (its consecutive chunks) at a time, layer by layer from the last, reading the layer inputs
    the capture kept.

    Cell ``(run k, layer i)`` needs the gradient of the run's outputs of layer i — from its own cell ``(k, i + 1)`` —
    and of the state rows before the later runs at layer i — from every later run's cell ``(k' > k, i)``, whose
    queries read them. Both are a reverse wavefront step earlier (step ``(runs - 1 - k) + (layers - 1 - i)``), so
    each rank walks its cells by step (``walk_cells``), and the critical path is ``layers + runs - 1`` steps of one
    run. With the cut in rank order (one run per rank) that is layer by layer, the last rank first; balanced (rank
    r's runs r and 2N - 2 - r of 2N - 1, the middle one rank N - 1's) a rank's later run leads its first. The
    messages, each sent as soon as it and those before it to the same peer are ready, in the order the peer takes
    them (NCCL matches a pair's messages in posting order):

    - a rank's rows of a growing layer before a run (of ``since``, of its own earlier runs) go to the run's owner for
      the cell's backward, and for the recomputation of the cell's segment when the run enters it (views of its
      arenas, sent device to device; staged through the host once per layer and cut). They are state, not results:
      ready before the walk. The receiver attends to them with gradient sinks of their own and drops them after the
      cell; the sinks of the extend's rows go back to their owner once the cell is done (added into its state
      gradient before its own cells of the layer), those of ``since``'s rows once the walk is done (until then each
      rank holds them: at most the context's state gradient);
    - a recurrent layer's state gradient before a run goes to the owner of the run before; the extend's first run's,
      the gradient of ``since``'s last recurrent state, is broadcast when the walk is done (every rank holds that
      state).

    With sharded weights (FSDP2) every gather and reduction is a collective in one order on every rank. In rank order
    each rank gathers its cell's layer (the same order everywhere, started ahead: ``_gather_order``). A balanced
    walk's ranks reach a layer's two waves of runs in different orders, so gathers, reductions and recomputations
    are paced by a schedule of their own (``walk_events``): per wave, a layer's gather starts when the wave's first
    run reaches it and its gradient, kept on the whole copy meanwhile, is reduced the step after the wave's last;
    each segment's inputs are recomputed for every run when the first run enters it.

    The replicated part of the parameters' gradient (the branch replays, which every rank ran) is divided by the
    number of ranks before the walk, and the sum over ranks afterwards restores it and adds every rank's share of the
    prefix's (an exact division: cp sizes are powers of two in practice; any size is correct to rounding)."""

    def __init__(
        self,
        kit: ExecutionKit,
        shards: StateShards,
        state: State,
        grad: StateGrad,
        ids: Tensor,
        loss_fn: ChunkLoss | None,
        since: State | None = None,
        into_since: bool = True,
    ):
        self.kit, self.state, self.grad, self.ids, self.loss_fn = kit, state, grad, ids, loss_fn
        self.ownership, self.transport = shards.ownership, shards.transport
        inputs = state.layer_inputs
        assert inputs is not None  # the engine walks only states a sharded capture gave inputs
        self.inputs, self.since = inputs, since
        self.base = since.num_tokens if since is not None else 0
        self.into_since = into_since and self.base > 0  # (nothing before position 0)
        self.first = next(j for j, chunk in enumerate(state.chunks) if chunk.start >= self.base)  # the extend's first
        extend = runs_of([c.owner for c in state.chunks[self.first :]])
        self.runs = [Run(r.index, r.owner, tuple(self.first + j for j in r.chunks)) for r in extend]
        check_tag_bounds(len(self.runs), kit.num_layers)
        self.waves = waves(self.runs)
        rank = self.ownership.rank
        self.my_runs = [run for run in self.runs if run.owner == rank]
        self.mine = [j for run in self.my_runs for j in run.chunks]
        self.index = {j: k for k, j in enumerate(self.mine)}  # a chunk's index among this rank's (its scratch)
        # a chunk's rows among this rank's (its runs back to back, as the capture kept them), and within its run
        self.rows: dict[int, slice] = {}
        self.local: dict[int, slice] = {}
        at = 0
        for run in self.my_runs:
            lo = at
            for j in run.chunks:
                n = state.chunks[j].length
                self.rows[j], self.local[j] = slice(at, at + n), slice(at - lo, at - lo + n)
                at += n
        self.context_holders = sorted({c.owner for c in state.chunks[: self.first]})
        self.computing = sorted({run.owner for run in self.runs})
        self.grows = [layer.mixer.grows for layer in kit.adapter.layers]
        # sharded weights and a rank with several runs: gathers, reductions and recomputations in one order of their
        # own (``walk_events``); otherwise a cell gathers its layer (in rank order the same order on every rank)
        self.paced = kit.weights is not None and len(self.runs) > len(self.computing)
        self.done: set[tuple[int, int]] = set()  # this rank's cells walked: (run index, layer)
        self.pending: dict[tuple[int, int, int], tuple[Tensor, ...]] = {}  # (run, layer, dst) -> a gradient to send
        self.staged: dict[tuple[int, int], list[Tensor]] = {}  # (layer, own chunks before) -> this rank's rows
        self.outbox = {
            dst: collections.deque(m for m in self._takes(dst) if m.src == rank)
            for dst in range(self.ownership.size)
            if dst != rank
        }
        self.segment: dict[tuple[int, int], Tensor] = {}  # (run, layer) -> its input, recomputed in its segment
        # (run, recurrent layer) the segment recomputed: the state before each of the run's chunks
        self.states_before: dict[tuple[int, int], list[tuple[Tensor, ...] | None]] = {}
        # (a context holder, layer) -> the gradient of its context rows this rank's queries read, until the walk ends
        self.context_grads: dict[tuple[int, int], tuple[Tensor, ...]] = {}
        self.since_recurrent: dict[int, tuple[Tensor, ...]] = {}  # per layer, the gradient of since's last state

    def run(self) -> None:
        kit = self.kit
        # Every rank ends the walk with the whole parameter gradient: its own share of the walk added to the
        # replicated part (the branch replays every rank ran), divided by the ranks now and summed over them after.
        # With sharded weights, a layer's gradient is reduced into its shards (a sum over the ranks) as its step of
        # the walk ends: only the root's (embeddings, final norm, LM head), whole through the step, is summed here.
        params = kit.weights.root_parameters() if kit.weights is not None else list(kit.model.parameters())
        params = [p for p in params if p.requires_grad]
        had_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.float64)
        for p in params:
            if p.grad is not None:
                p.grad.div_(self.ownership.size)
        self._post()  # (the rows: state, ready at once)
        kit.announce(self._gather_order(), ahead=0 if self.paced else None)
        g = {run.index: self._seed(run) for run in self.my_runs}
        if not self.my_runs and not self.paced:
            self._gathers_only()
        for item in self._schedule(self.ownership.rank):
            if isinstance(item, tuple):
                run, i = item
                # each rank adds its share of the layer's gradient (paced: reduced in its wave's turn)
                with kit.gathered(i, partial=True, reduce=not self.paced):
                    g[run.index] = self._cell(run, i, g[run.index])
                self.done.add((run.index, i))
                self._post()
                self.transport.flush("state_grad", keep=self.ownership.size**2)  # a window of gradients in flight
            else:
                self._event(item)
        for run in self.my_runs:  # into the embeddings of the run's tokens
            if g[run.index] is not None:
                with torch.enable_grad():
                    start = self.state.chunks[run.chunks[0]].start
                    ids = self.ids[start - self.base : start - self.base + self._length(run)]
                    h, _, _ = kit.adapter.embed(ids, start)
                    if h.requires_grad:  # (frozen embeddings, as a LoRA policy's, take no gradient)
                        h.backward(g[run.index])
        assert not any(self.outbox.values())  # every message sent
        self._exchange_context_grads()
        self.transport.flush()
        self._into_since_recurrent()
        kit.settle()
        self._sum_parameter_grads(params, had_grad)

    def _schedule(self, rank: int) -> list[tuple[Run, int] | WalkEvent]:
        """What ``rank`` does, in order: its cells ``(run, layer)`` (``walk_cells``), paced with the walk's events
        (``walk_events``: each due by a cell's step before it, the rest at the end)."""
        layers = self.kit.num_layers
        if not self.paced:
            return list(walk_cells(self.runs, layers, rank))
        return walk_schedule(self.runs, layers, self.inputs.every, rank)

    def _event(self, event: WalkEvent) -> None:
        """One of the paced walk's events on this rank: a segment's recomputation for its runs, a wave's gather
        started (taken and freed at once where this rank has no run in the wave), a wave's reduction."""
        kit = self.kit
        if isinstance(event, SegmentRecompute):
            takes = collections.deque(self._segment_takes(event, self.my_runs))
            self._recompute_segment(event.first, event.top, self.my_runs, takes)
            assert not takes  # (it takes what ``_segment_takes`` says, in its order)
        elif isinstance(event, WaveGather):
            kit.start_gather()
            if not any(run.owner == self.ownership.rank for run in self.waves[event.wave]):
                with kit.gathered(event.layer, partial=True, reduce=False):
                    pass
        else:
            kit.reduce(event.layer)

    def _gather_order(self) -> list[int]:
        """The layers the walk gathers, in order (``walk_gather_order``)."""
        return walk_gather_order(self.runs, self.kit.num_layers, self.inputs.every, self.paced)

    def _gathers_only(self) -> None:
        """A rank without chunks takes part in every gather (a collective when the weights are sharded), in the
        order of the ranks walking: per layer from the last, a segment's recomputed layers as it is entered."""
        for i in reversed(range(self.kit.num_layers)):
            with self.kit.gathered(i, partial=True):
                for layer in self._recomputed(i):
                    with self.kit.gathered(layer):
                        pass

    def _recomputed(self, i: int) -> range:
        """The layers whose inputs a run recomputes as its walk enters a segment at layer ``i`` (none elsewhere)."""
        every = self.inputs.every
        first = i - i % every
        return range(first, i) if i == min(first + every, self.kit.num_layers) - 1 else range(0)

    def _length(self, run: Run) -> int:
        return sum(self.state.chunks[j].length for j in run.chunks)

    # --- messages ---------------------------------------------------------------------------------------------
    def _senders(self, run: Run) -> list[int]:
        """The ranks that send a growing layer's rows before ``run``: every other rank holding some (of ``since``,
        or of its runs before)."""
        earlier = {r.owner for r in self.runs[: run.index]}
        return sorted((set(self.context_holders) | earlier) - {run.owner})

    def _cell_takes(self, run: Run, i: int) -> list[_Message]:
        """What cell ``(run, i)`` receives, in the order it takes it: its segment's rows for the recomputation (as
        the run enters the segment; paced, its ``SegmentRecompute`` takes those), then at a growing layer the gradient
        the later runs' cells gave the owner's rows (those after the owner's next run took theirs already) and the
        rows for the backward; at a recurrent layer the state gradient after the run."""
        k, senders = run.index, self._senders(run)
        recomputed = range(0) if self.paced else self._recomputed(i)
        takes = [
            _Message(MessageKind.WALK_RECOMPUTE_ROWS, k, layer, s)
            for layer in recomputed
            if self.grows[layer]
            for s in senders
        ]
        if self.grows[i]:
            later = [r.index for r in self.runs if r.owner == run.owner and r.index > k]
            upto = later[0] if later else len(self.runs)
            takes += [_Message(MessageKind.ROW_GRADS, r, i, self.runs[r].owner) for r in reversed(range(k + 1, upto))]
            takes += [_Message(MessageKind.WALK_ROWS, k, i, s) for s in senders]
        elif k + 1 < len(self.runs):
            takes.append(_Message(MessageKind.RECURRENT_GRAD, k + 1, i, self.runs[k + 1].owner))
        return takes

    def _segment_takes(self, event: SegmentRecompute, runs: Sequence[Run]) -> list[_Message]:
        """What a paced segment's recomputation for ``runs`` receives, in order: per layer, per run, per sender."""
        layers = [layer for layer in range(event.first, event.top) if self.grows[layer]]
        return [
            _Message(MessageKind.WALK_RECOMPUTE_ROWS, run.index, i, s)
            for i in layers
            for run in runs
            for s in self._senders(run)
        ]

    def _takes(self, rank: int) -> list[_Message]:
        """Every message ``rank`` receives in the walk, in the order it takes them."""
        runs = [run for run in self.runs if run.owner == rank]
        takes: list[_Message] = []
        for item in self._schedule(rank):
            if isinstance(item, tuple):
                takes += self._cell_takes(*item)
            elif isinstance(item, SegmentRecompute):
                takes += self._segment_takes(item, runs)
        return takes

    def _receive(self, message: _Message) -> tuple[Tensor, ...]:
        on_host = RUNS_HEADER if message.kind in _ROWS_KINDS else 0
        return self.transport.recv(message.src, message.tag, self.kit.adapter.device, on_host=on_host)

    def _ready(self, message: _Message) -> bool:
        """Whether this rank has what ``message`` carries: rows at once (state), a gradient once its cell is walked."""
        return message.kind in _ROWS_KINDS or (message.run, message.layer) in self.done

    def _post(self) -> None:
        """Send each peer the messages now ready, in the order it takes them (none past one not ready yet)."""
        for dst, queue in self.outbox.items():
            while queue and self._ready(queue[0]):
                message = queue.popleft()
                if message.kind in _ROWS_KINDS:
                    self.transport.send(self._staged_rows(message), dst, message.tag, "rows")
                else:
                    payload = self.pending.pop((message.run, message.layer, dst))
                    self.transport.send(payload, dst, message.tag, "state_grad")

    def _staged_rows(self, message: _Message) -> list[Tensor]:
        """This rank's rows of the message's layer before its run, as a message (views of its arenas; staged through
        the host once per layer and number of this rank's own chunks before the run: once for every peer and run
        that reads the same rows)."""
        before = self.runs[message.run].chunks[0]
        key = (message.layer, sum(1 for j in self.mine if j < before))
        if key not in self.staged:
            self.staged[key] = self.transport.stage(outgoing_runs(self._own_rows(message.layer, before)))
        return self.staged[key]

    def _sinked(self, position: int) -> bool:
        """Whether rows from ``position`` on get a gradient: the extend's always, ``since``'s with ``into_since``."""
        return position >= self.base or self.into_since

    def _own_rows(self, i: int, upto: int | None = None, context_only: bool = False) -> list[tuple[int, Block]]:
        """This rank's rows of layer ``i`` (before chunk ``upto``; only ``since``'s: ``context_only``), cut at the
        extend's start."""
        rows = []
        for position, block in self.state.positioned_blocks(i, upto):
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

    def _returned(self, run: Run, i: int, received: list[tuple[int, PastBlock]]) -> None:
        """The gradient cell ``(run, i)`` gave the other ranks' rows: the extend's to be sent to their owners as
        their turn comes, ``since``'s held (summed over this rank's cells) until the walk is done."""
        for src in dict.fromkeys(src for src, _ in received):
            blocks = [block for s, block in received if s == src and block.grads is not None]
            extend = _joined([block.grads for block in blocks if block.start >= self.base])  # type: ignore[misc]
            context = _joined([block.grads for block in blocks if block.start < self.base])  # type: ignore[misc]
            if extend is not None:
                self.pending[run.index, i, src] = extend
            if context is not None:
                held = self.context_grads.get((src, i))
                self.context_grads[src, i] = (
                    context if held is None else tuple(a.add_(b) for a, b in zip(held, context, strict=True))
                )

    def _exchange_context_grads(self) -> None:
        """Once the walk is done: send each context holder the gradient this rank's queries gave its context rows,
        and add what the other ranks' queries gave this rank's (every growing layer, from the last)."""
        if not self.into_since:
            return
        rank = self.ownership.rank
        growing = [i for i in reversed(range(self.kit.num_layers)) if self.grows[i]]
        if self.my_runs:
            for dst in (holder for holder in self.context_holders if holder != rank):
                for i in growing:
                    grads = self.context_grads.pop((dst, i))
                    self.transport.send(grads, dst, _Message(MessageKind.CONTEXT_GRADS, 0, i, rank).tag, "state_grad")
        if rank not in self.context_holders:
            return
        for src in (q for q in self.computing if q != rank):
            for i in growing:
                message = self._receive(_Message(MessageKind.CONTEXT_GRADS, 0, i, src))
                self._add_into_own(message, self._own_rows(i, context_only=True))

    def _into_since_recurrent(self) -> None:
        """The gradient of ``since``'s last recurrent states, from the rank that walked the extend's first chunk,
        added on every rank (each holds those states)."""
        recurrent = [i for i, grows in enumerate(self.grows) if not grows]
        if not self.into_since or not recurrent or self.since is None:
            return
        src = self.runs[0].owner
        mine = src == self.ownership.rank
        flat = [t for i in recurrent for t in self.since_recurrent[i]] if mine else None
        received = self.transport.broadcast_tensors(flat, src, self.kit.adapter.device)
        at = 0
        for i in recurrent:
            rec = self.since.chunks[-1].recurrent[i]
            assert rec is not None  # a state after position 0 keeps its last recurrent states
            buffers = self.grad.recurrent_grads(rec)
            for buffer, part in zip(buffers, received[at : at + len(buffers)], strict=True):
                buffer.add_(part)
            at += len(buffers)

    # --- the walk ---------------------------------------------------------------------------------------------
    def _cell(self, run: Run, i: int, g: Tensor | None) -> Tensor | None:
        """Cell ``(run, i)``: the run's layer ``i`` backpropagated, its input recomputed first where the run enters
        a segment; returns the gradient of the run's input of the layer."""
        takes = collections.deque(self._cell_takes(run, i))
        layer_input = self._input(run, i, takes)
        if self.grows[i]:
            g = self._backward_growing(run, i, g, layer_input, takes)
        else:
            g = self._backward_recurrent(run, i, g, layer_input, takes)
        assert not takes  # (a cell takes what ``_cell_takes`` says, in its order)
        return g

    def _layer(
        self, i: int, j: int, x: Tensor, ctx: LayerContext, scratch: dict[str, Any]
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        rows, inputs = self.rows[j], self.inputs
        rope = (inputs.rope[0][rows], inputs.rope[1][rows])
        layer, start = self.kit.adapter.layers[i], self.state.chunks[j].start
        return self.kit.adapter.run_layer(
            layer, x, inputs.positions[rows], rope, ctx, dict(scratch), self.kit.local_attention, start
        )

    def _seed(self, run: Run) -> Tensor | None:
        """The gradient of the loss (``loss_fn`` over the run's chunks) w.r.t. the last layer's output."""
        if self.loss_fn is None:
            return None
        assert self.inputs.final is not None  # the capture keeps it
        g: Tensor | None = None
        for j in run.chunks:  # a chunk's graph at a time (an agent's history has loss all along)
            chunk = self.state.chunks[j]
            with torch.enable_grad():
                x = self.inputs.final[self.rows[j]].detach().requires_grad_(True)
                loss = self.loss_fn(self.kit.adapter.final_norm(x), chunk.start, chunk.end)
                if loss is None:
                    continue
                loss.backward()
            if x.grad is not None:
                g = x.grad.new_zeros(self._length(run), x.shape[-1]) if g is None else g
                g[self.local[j]] = x.grad
        return g

    def _input(self, run: Run, i: int, takes: collections.deque[_Message]) -> Tensor:
        """The run's input of layer ``i``: kept by the capture at the first layer of each segment, the others
        recomputed forward from it when the run's walk enters the segment (from its top)."""
        if (run.index, i) not in self.segment:
            assert not self.paced  # (its ``SegmentRecompute`` did, when the first run entered the segment)
            self._recompute_segment(i - i % self.inputs.every, i, [run], takes)
        return self.segment.pop((run.index, i))

    def _recompute_segment(self, first: int, top: int, runs: Sequence[Run], takes: collections.deque[_Message]) -> None:
        """The inputs of layers ``first .. top`` of ``runs``: the kept one, and layers ``first .. top - 1`` forward
        from it, a layer (gathered once) at a time over every run. A rank without runs only gathers."""
        h = {run.index: self.inputs.hidden[first][self._span(run)] for run in runs}
        for layer in range(first, top + 1):
            for run in runs:
                self.segment[run.index, layer] = h[run.index]
            if layer < top:
                with self.kit.gathered(layer):
                    for run in runs:
                        h[run.index] = self._recompute_layer(run, layer, h[run.index], takes)

    def _span(self, run: Run) -> slice:
        """The run's rows among this rank's."""
        return slice(self.rows[run.chunks[0]].start, self.rows[run.chunks[-1]].stop)

    def _received_rows(
        self, kind: MessageKind, run: Run, i: int, takes: collections.deque[_Message], sinks: bool
    ) -> list[tuple[int, PastBlock]]:
        """The rows the next messages of ``takes`` carry of layer ``i`` before ``run`` (``kind``: for the backward
        or a recomputation), each with the rank that sent it."""
        received = []
        while takes and (takes[0].kind, takes[0].run, takes[0].layer) == (kind, run.index, i):
            message = takes.popleft()
            received += [(message.src, block) for block in self._past(self._receive(message), sinks)]
        return received

    def _recompute_layer(self, run: Run, i: int, h: Tensor, takes: collections.deque[_Message]) -> Tensor:
        """Layer ``i`` over the run's chunks without a graph (recomputing a segment's inputs)."""
        layer, out = self.kit.adapter.layers[i], torch.empty_like(h)
        carried = self.inputs.recurrent[i][self.my_runs.index(run)]
        befores: list[tuple[Tensor, ...] | None] = []
        remote = []
        if layer.mixer.grows:
            remote = [
                block for _, block in self._received_rows(MessageKind.WALK_RECOMPUTE_ROWS, run, i, takes, sinks=False)
            ]
        with torch.no_grad():
            for j in run.chunks:
                if layer.mixer.grows:
                    own = past_blocks(self.state.positioned_blocks(i, j), None)
                    ctx = LayerContext(past=in_position_order([*remote, *own]))
                else:
                    befores.append(carried)
                    ctx = LayerContext(recurrent=carried)
                out[self.local[j]], new = self._layer(
                    i, j, h[self.local[j]], ctx, self.inputs.scratch[i][self.index[j]]
                )
                carried = new
        if not layer.mixer.grows:
            self.states_before[run.index, i] = befores  # the layer's backward starts each chunk from these
        return out

    def _backward_growing(
        self, run: Run, i: int, g: Tensor | None, layer_input: Tensor, takes: collections.deque[_Message]
    ) -> Tensor:
        """Layer ``i`` (attention / MLA) of the run's chunks, last chunk first; returns the gradient of its input."""
        # the later runs' queries' gradient for this rank's rows
        while takes and takes[0].kind == MessageKind.ROW_GRADS:
            message = takes.popleft()
            rows = self._own_rows(i, self.runs[message.run].chunks[0])
            self._add_into_own(self._receive(message), [(p, b) for p, b in rows if p >= self.base])
        # with sinks of their own, whose gradients go back to the owners
        received = self._received_rows(MessageKind.WALK_ROWS, run, i, takes, sinks=True)
        remote = [block for _, block in received]
        frozen_before = 0 if self.into_since else self.base
        g_in = torch.zeros_like(layer_input)
        for j in reversed(run.chunks):
            block = self.state.chunks[j].blocks[i]
            own = past_blocks(self.state.positioned_blocks(i, j), self.grad, frozen_before)
            upstream = self.grad.existing_block_grads(block) if block is not None else None
            with torch.enable_grad():
                x = layer_input[self.local[j]].detach().requires_grad_(True)
                past = in_position_order([*remote, *own])
                out, new = self._layer(i, j, x, LayerContext(past=past), self.inputs.scratch[i][self.index[j]])
                self._backpropagate(out, g, self.local[j], new, upstream)
            if x.grad is not None:
                g_in[self.local[j]] = x.grad
        self._returned(run, i, received)
        if run is self.my_runs[0]:  # this rank's last cell of the layer: nothing adds to its rows' gradient now
            context = {id(block.arena) for _, block in self._own_rows(i, context_only=True)}
            for _, block in self._own_rows(i):
                if id(block.arena) not in context:  # (the context's gradient is walked later, whoever added to it)
                    self.grad.release_arena(block.arena)
        return g_in

    def _backward_recurrent(
        self, run: Run, i: int, g: Tensor | None, layer_input: Tensor, takes: collections.deque[_Message]
    ) -> Tensor:
        """Layer ``i`` (GatedDeltaNet) of the run's chunks: the states before each recomputed forward from the one
        before the run, then each chunk backpropagated last first, the state gradient carried back."""
        carry = self._recurrent_grad_after(run, i, takes)
        if (run.index, i) not in self.states_before:  # the top of a segment: not recomputed yet
            with self.kit.gathered(i):
                self._recompute_layer(run, i, layer_input, takes)
        befores = self.states_before.pop((run.index, i))
        g_in = torch.zeros_like(layer_input)
        for k in reversed(range(len(run.chunks))):
            j = run.chunks[k]
            with torch.enable_grad():
                before = befores[k]
                leaves = None if before is None else tuple(t.detach().requires_grad_(True) for t in before)
                x = layer_input[self.local[j]].detach().requires_grad_(True)
                out, new = self._layer(i, j, x, LayerContext(recurrent=leaves), self.inputs.scratch[i][self.index[j]])
                self._backpropagate(out, g, self.local[j], new, carry)
            if x.grad is not None:
                g_in[self.local[j]] = x.grad
            carry = (
                None if leaves is None else tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves)
            )
        if run.index > 0:
            assert carry is not None  # a chunk after position 0 starts from a state
            self.pending[run.index, i, self.runs[run.index - 1].owner] = carry
        elif self.into_since and carry is not None:  # the gradient of since's last state: broadcast after the walk
            self.since_recurrent[i] = carry
        return g_in

    def _recurrent_grad_after(self, run: Run, i: int, takes: collections.deque[_Message]) -> tuple[Tensor, ...] | None:
        """The gradient of layer ``i``'s recurrent state after the run: from the next run's owner, or (the last run)
        the state's own."""
        if run.index + 1 < len(self.runs):
            return self._receive(takes.popleft())
        rec = self.state.chunks[run.chunks[-1]].recurrent[i]
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
