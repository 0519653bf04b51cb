"""Exact mode's reverse walk over a state's chunks (DESIGN.md, "Exact gradients through the prefix", step 2): in one
process, or replicated on every context-parallel rank when the capture was not sharded with its layer inputs.

Each chunk, last first, is recomputed under autograd from the K/V of earlier chunks (leaves whose gradients add
into the state's gradient) and the recurrent state before it; the gradient waiting for its outputs — its own state
entries' and ``loss_fn``'s — is backpropagated into the parameters and into earlier chunks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from longstraw_agents.state import Block, ChunkRecord, RecurrentState, State, StateGrad

from .graphs import GraphBank, KeptGraph
from .kit import ChunkLoss, ExecutionKit


class ReverseWalk:
    """The walk of ``state``'s chunks after ``since`` (chunk index ``first`` on), last first. ``into_since``: also
    pass the gradient on to ``since``'s tensors (False: detached mode's long branches); ``kept``: chunks whose
    capture graphs it holds are backpropagated without recomputation."""

    def __init__(
        self,
        kit: ExecutionKit,
        state: State,
        grad: StateGrad,
        ids: Tensor,
        since: State | None,
        first: int,
        loss_fn: ChunkLoss | None,
        into_since: bool,
        kept: GraphBank | None,
    ):
        self.kit, self.state, self.grad, self.ids, self.first = kit, state, grad, ids, first
        self.loss_fn, self.kept = loss_fn, kept
        self.base = since.num_tokens if since is not None else 0
        self.frozen_before = 0 if into_since else self.base
        self.recurrent = RecurrentStates(kit, state, since, ids, self.base, first)

    def run(self) -> None:
        for j in reversed(range(self.first, len(self.state.chunks))):
            chunk = self.state.chunks[j]
            graph = self.kept.pop(chunk) if self.kept is not None else None
            self._chunk(j, self.recurrent.after(j - 1), self.recurrent.after(j), graph)
            self.recurrent.forget(j)

    def _chunk(
        self,
        j: int,
        before: Sequence[RecurrentState | None],
        after: Sequence[RecurrentState | None],
        graph: KeptGraph | None,
    ) -> None:
        """Recompute chunk ``j`` (or take its kept graph) and backpropagate what waits for its outputs."""
        kit, chunk = self.kit, self.state.chunks[j]
        outputs: list[Tensor] = []
        grads: list[Tensor] = []
        with torch.enable_grad():
            if graph is None:
                contexts = kit.contexts(self.state, j, self.grad, before, self.frozen_before)
                ids = self.ids[chunk.start - self.base : chunk.end - self.base]
                hidden, new = kit.forward(ids, chunk.start, contexts)
            else:
                hidden, new = graph.hidden, graph.new
            for entry, block, rec, layer in zip(new, chunk.blocks, after, kit.adapter.layers, strict=True):
                if layer.mixer.grows:
                    upstream = self._block_upstream(chunk, block, entry)
                else:
                    upstream = None if rec is None else self.grad.existing_recurrent_grads(rec)
                if upstream is not None:  # buffers may be wider than the outputs (fp32 accumulation)
                    outputs.extend(entry)
                    grads.extend(g.to(o.dtype) for o, g in zip(entry, upstream, strict=True))
            if self.loss_fn is not None:
                loss = self.loss_fn(hidden, chunk.start, chunk.end)
                if loss is not None:
                    outputs.append(loss)
                    grads.append(torch.ones_like(loss))
            backpropagate(outputs, grads)
        self._release(chunk, after)

    def _block_upstream(
        self, chunk: ChunkRecord, block: Block | None, entry: tuple[Tensor, ...]
    ) -> tuple[Tensor, ...] | None:
        """The gradient waiting for a chunk's new state entries; with context parallelism it lives on the chunk's
        owner and is broadcast, so that every rank's recomputation backpropagates the same thing."""
        shards = self.kit.shards
        if shards is None:
            return None if block is None else self.grad.existing_block_grads(block)
        owner = chunk.owner
        found = self.grad.existing_block_grads(block) if block is not None else None
        buffers = [found[i].clone() if found is not None else self.grad.zeros_like(t) for i, t in enumerate(entry)]
        return tuple(shards.transport.broadcast(b, owner) for b in buffers)

    def _release(self, chunk: ChunkRecord, after: Sequence[RecurrentState | None]) -> None:
        """Drop gradient buffers nothing earlier can add to any more."""
        for block, rec in zip(chunk.blocks, after, strict=True):
            if block is not None and block.lo == 0:
                self.grad.release_arena(block.arena)
            if rec is not None:
                self.grad.release_recurrent(rec)


def backpropagate(outputs: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
    """``torch.autograd.backward`` over the outputs that need a gradient: with frozen weights (a LoRA policy) a
    chunk's early state entries may depend on nothing that trains (the embeddings and an unadapted first layer)."""
    pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


class RecurrentStates:
    """The recurrent states around each chunk of a reverse walk: kept checkpoints, ``since``'s last state, or —
    between checkpoints — recomputed forward without a graph from the nearest one, a segment at a time (at most
    ``checkpoints - 1`` of them live at once)."""

    def __init__(self, kit: ExecutionKit, state: State, since: State | None, ids: Tensor, base: int, first: int):
        self.kit, self.state, self.since, self.ids, self.base, self.first = kit, state, since, ids, base, first
        self.none: tuple[RecurrentState | None, ...] = (None,) * state.num_layers
        self.cache: dict[int, tuple[RecurrentState | None, ...]] = {}

    def after(self, m: int) -> tuple[RecurrentState | None, ...]:
        """Every layer's recurrent state after chunk ``m`` (None entries for growing layers and position 0)."""
        if m < 0:
            return self.none
        if m == self.first - 1 and self.since is not None:
            return self.since.chunks[-1].recurrent  # the parent keeps its own last state
        kept = self.state.recurrent_after(m)
        if kept is not None:
            return kept
        if m not in self.cache:
            self._recompute_to(m)
        return self.cache[m]

    def _recompute_to(self, m: int) -> None:
        start = m - 1
        while start >= self.first and self.state.recurrent_after(start) is None and start not in self.cache:
            start -= 1
        for t in range(start + 1, m + 1):
            chunk = self.state.chunks[t]
            with torch.no_grad():
                contexts = self.kit.contexts(self.state, t, None, self.after(t - 1))
                ids = self.ids[chunk.start - self.base : chunk.end - self.base]
                new = self.kit.state_entries(ids, chunk.start, contexts)
            self.cache[t] = tuple(
                None if block is not None else RecurrentState.owning(entry)
                for entry, block in zip(new, chunk.blocks, strict=True)
            )

    def forget(self, m: int) -> None:
        self.cache.pop(m, None)
