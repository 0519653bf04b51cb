"""Engine state: exactly what later tokens need of the tokens already seen, per layer, immutable and shareable.

Layers that grow with length (full attention: K/V; MLA: compressed latent + rope key + DSA indexer key) keep their
per-position tensors in ``Arena``s — append-only buffers, position first, written once. A ``State`` is a tuple of
``ChunkRecord``s, one per evaluated chunk, each pointing at the positions it wrote (``Block``: arena + range).
Recurrent layers (GatedDeltaNet) keep a fixed-size ``RecurrentState`` per chunk end; only the last is needed to
continue. For exact prefix gradients a state keeps *checkpoints*: the recurrent state after every ``checkpoints``-th
chunk (``checkpoints=k``; the reverse walk recomputes the ones in between forward from the nearest checkpoint), so
their memory is spaced independently of the chunk size.

Forking is free: a child state is the parent's tuple plus new records, sharing every tensor; the parent's
positions are never written again, so the parent stays valid. ``StateGrad`` holds the gradient with respect to a
state's tensors (same shapes, allocated lazily) for the exact-gradient backward walk. A state made by a sharded
capture under context parallelism may carry this rank's ``LayerInputs``: what exact mode's wavefront walk over it
reads instead of recomputing every layer.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


class Arena:
    """Append-only per-position storage of one layer: tensors ``[capacity, *shape]`` filled from the front."""

    def __init__(self, shapes: tuple[tuple[int, ...], ...], capacity: int, dtype: torch.dtype, device: torch.device):
        self.tensors: tuple[Tensor, ...] = tuple(
            torch.empty((capacity, *shape), dtype=dtype, device=device) for shape in shapes
        )
        self.capacity = capacity
        self.filled = 0

    def can_append(self, at: int, n: int) -> bool:
        """True if positions ``[at, at+n)`` are free and ``at`` is the fill mark (no sibling wrote there)."""
        return at == self.filled and self.filled + n <= self.capacity

    def append(self, values: tuple[Tensor, ...]) -> Block:
        n = values[0].shape[0]
        if not self.can_append(self.filled, n):
            raise RuntimeError("arena is full")  # engine bug: callers check can_append first
        start = self.filled
        for dst, src in zip(self.tensors, values, strict=True):
            dst[start : start + n].copy_(src)
        self.filled += n
        return Block(self, start, start + n)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


@dataclass(frozen=True, eq=False)
class Block:
    """Positions ``[lo, hi)`` of an arena."""

    arena: Arena
    lo: int
    hi: int

    @property
    def length(self) -> int:
        return self.hi - self.lo

    def views(self) -> tuple[Tensor, ...]:
        return tuple(t[self.lo : self.hi] for t in self.arena.tensors)

    def follows(self, other: Block) -> bool:
        return self.arena is other.arena and self.lo == other.hi


@dataclass(frozen=True, eq=False)
class RecurrentState:
    """Fixed-size state of a recurrent layer after some position: e.g. (conv tail, delta-rule state)."""

    tensors: tuple[Tensor, ...]

    @classmethod
    def owning(cls, tensors: tuple[Tensor, ...]) -> RecurrentState:
        """The state of ``tensors`` detached, each on a storage of its own size: a mixer's new state is often a view
        into a chunk-sized tensor (the conv tail is the last rows of the chunk's conv input), which a view would
        keep alive with every checkpoint."""
        return cls(tuple(_own_storage(t.detach()) for t in tensors))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def _own_storage(t: Tensor) -> Tensor:
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


@dataclass(frozen=True, eq=False)
class ChunkRecord:
    """One evaluated chunk: positions ``[start, start+length)``, what each layer wrote for them.

    ``blocks[i]`` is the block of growing layer i (None for recurrent layers, and — context parallelism — on ranks
    that do not hold these positions); ``recurrent[i]`` the recurrent state of layer i after the chunk (None for
    growing layers, and for every layer once the checkpoint was dropped: ``kept`` is then False). ``owner``: the
    context-parallel rank that holds the blocks (every rank records it; 0 without context parallelism).
    """

    start: int
    length: int
    blocks: tuple[Block | None, ...]
    recurrent: tuple[RecurrentState | None, ...]
    kept: bool = True
    owner: int = 0

    @property
    def end(self) -> int:
        return self.start + self.length

    def without_checkpoints(self) -> ChunkRecord:
        nothing = tuple(None for _ in self.recurrent)
        return ChunkRecord(self.start, self.length, self.blocks, nothing, kept=False, owner=self.owner)


# per layer, the merged blocks of a state with the token position each starts at (see State.blocks)
MergedBlocks = tuple[tuple[tuple[int, Block], ...], ...]


@dataclass(eq=False)
class LayerInputs:
    """What a sharded capture (``engine.ShardedCapture``) keeps on a rank for exact mode's wavefront walk
    (``engine.WavefrontWalk``), carried by the state it made (``State.layer_inputs``): the input hidden states
    ``[n, hidden]`` of the rank's chunks at every ``every``-th layer (the walk recomputes the layers between), each
    chunk's forward scratch before every layer (DSA's selection), the recurrent state before each of the rank's runs
    (recurrent layers), and the last layer's output: ``L / every + 1`` hidden vectors per position of the shard."""

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


# called with every State made while they are registered (``observe_states``: memory attribution by role)
_STATE_OBSERVERS: list[Callable[[State], None]] = []


@contextlib.contextmanager
def observe_states(callback: Callable[[State], None]) -> Iterator[None]:
    """``callback(state)`` for every ``State`` made inside the block (the engine's, on any engine)."""
    _STATE_OBSERVERS.append(callback)
    try:
        yield
    finally:
        _STATE_OBSERVERS.remove(callback)


@dataclass(frozen=True, eq=False)
class State:
    """What the engine keeps of ``num_tokens`` tokens. Immutable; children share its tensors."""

    chunks: tuple[ChunkRecord, ...]
    num_layers: int
    checkpoints: int = 0  # keep the recurrent state after every k-th chunk (0: only after the last)
    owner: int = field(default=0, repr=False)  # id of the engine that made it (a state is tied to its model)
    # a sharded capture's inputs for exact mode's wavefront walk over exactly these chunks (this rank's); children
    # do not inherit them
    layer_inputs: LayerInputs | None = field(default=None, repr=False)
    _merged: MergedBlocks | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        for observer in _STATE_OBSERVERS:
            observer(self)

    @property
    def num_tokens(self) -> int:
        return self.chunks[-1].end if self.chunks else 0

    def __len__(self) -> int:
        return self.num_tokens

    def with_checkpoints(self, spacing: int) -> State:
        """The same state whose children keep recurrent checkpoints every ``spacing`` chunks from now on."""
        if spacing == self.checkpoints:
            return self
        twin = State(self.chunks, self.num_layers, spacing, self.owner, self.layer_inputs)
        object.__setattr__(twin, "_merged", self._merged)
        return twin

    def with_layer_inputs(self, inputs: LayerInputs) -> State:
        """The same state carrying ``inputs`` (what its reverse walk reads instead of recomputing every layer)."""
        twin = State(self.chunks, self.num_layers, self.checkpoints, self.owner, inputs)
        object.__setattr__(twin, "_merged", self._merged)
        return twin

    def positions_held(self, ranks: int) -> list[int]:
        """How many of the state's positions each of ``ranks`` context-parallel ranks holds (``ChunkRecord.owner``)."""
        held = [0] * ranks
        for chunk in self.chunks:
            held[chunk.owner] += chunk.length
        return held

    def keeps_checkpoint(self, index: int) -> bool:
        """Whether the recurrent state after chunk ``index`` is kept once later chunks follow it."""
        return self.checkpoints > 0 and (index + 1) % self.checkpoints == 0

    def append(self, record: ChunkRecord) -> State:
        """The child covering one more chunk (the parent's last recurrent state is dropped from the child unless it
        is a checkpoint; the parent itself keeps it). Its merged blocks extend the parent's, so a chain of n appends
        costs O(n), not O(n²) — many-turn trees append thousands of tiny chunks."""
        chunks = self.chunks
        if chunks and not self.keeps_checkpoint(len(chunks) - 1):
            chunks = (*chunks[:-1], chunks[-1].without_checkpoints())
        child = State((*chunks, record), self.num_layers, self.checkpoints, self.owner)
        merged = tuple(
            _merge_block(layer, record.start, block)
            for layer, block in zip(self._merged_blocks(), record.blocks, strict=True)
        )
        object.__setattr__(child, "_merged", merged)
        return child

    def blocks(self, layer: int, upto: int | None = None) -> list[Block]:
        """The layer's blocks for positions ``[0, upto)`` (chunk-aligned), adjacent blocks of one arena merged
        into one (attention then reads one view instead of one block per chunk)."""
        return [block for _, block in self.positioned_blocks(layer, upto)]

    def positioned_blocks(self, layer: int, upto: int | None = None) -> list[tuple[int, Block]]:
        """``blocks`` with the token position each starts at (with context parallelism a rank holds some chunks'
        blocks only, so positions are not the running sum of lengths)."""
        merged = self._merged_blocks()[layer]
        if upto is None or upto >= len(self.chunks):
            return list(merged)
        limit = self.chunks[upto].start  # token positions before chunk `upto`
        out = []
        for start, block in merged:
            if start >= limit:
                break
            clipped = block if start + block.length <= limit else Block(block.arena, block.lo, block.lo + limit - start)
            out.append((start, clipped))
        return out

    def _merged_blocks(self) -> MergedBlocks:
        if self._merged is not None:
            return self._merged
        merged: list[tuple[tuple[int, Block], ...]] = [() for _ in range(self.num_layers)]
        for chunk in self.chunks:
            merged = [
                _merge_block(layer, chunk.start, block) for layer, block in zip(merged, chunk.blocks, strict=True)
            ]
        result = tuple(merged)
        object.__setattr__(self, "_merged", result)
        return result

    def recurrent(self, layer: int, after_chunk: int | None = None) -> RecurrentState | None:
        """Recurrent state of ``layer`` after chunk ``after_chunk`` (default: the last); None at position 0."""
        index = len(self.chunks) - 1 if after_chunk is None else after_chunk
        if index < 0:
            return None
        found = self.chunks[index].recurrent[layer]
        if found is None:
            raise ValueError(
                f"this state keeps no recurrent state after chunk {index} (checkpoints={self.checkpoints}); the "
                "engine's backward recomputes it from the nearest checkpoint (capture/extend with checkpoints=True)"
            )
        return found

    def recurrent_after(self, index: int) -> tuple[RecurrentState | None, ...] | None:
        """Every layer's recurrent state after chunk ``index`` if this state keeps it, else None."""
        chunk = self.chunks[index]
        return chunk.recurrent if chunk.kept else None

    @property
    def checkpoint_nbytes(self) -> int:
        """Bytes of the recurrent states kept before the last chunk (the checkpoints), each counted once."""
        last = {id(r) for r in self.chunks[-1].recurrent if r is not None} if self.chunks else set()
        kept = {id(r): r for chunk in self.chunks for r in chunk.recurrent if r is not None and id(r) not in last}
        return sum(r.nbytes for r in kept.values())

    def tensors(self) -> Iterator[Tensor]:
        """Every tensor the state holds (arena storages once each, recurrent states)."""
        seen: set[int] = set()
        for chunk in self.chunks:
            for block in chunk.blocks:
                if block is not None and id(block.arena) not in seen:
                    seen.add(id(block.arena))
                    yield from block.arena.tensors
            for rec in chunk.recurrent:
                if rec is not None and id(rec) not in seen:
                    seen.add(id(rec))
                    yield from rec.tensors

    @property
    def nbytes(self) -> int:
        """Exact bytes held: arenas (their full storage) and recurrent states, each counted once."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


def _merge_block(
    merged: tuple[tuple[int, Block], ...], start: int, block: Block | None
) -> tuple[tuple[int, Block], ...]:
    """``merged`` plus ``block`` (covering tokens from ``start``), joined to the last block when it follows it in
    its arena and in positions (with context parallelism a rank's arena may hold positions other ranks' chunks
    separate)."""
    if block is None:
        return merged
    if merged and block.follows(merged[-1][1]) and start == merged[-1][0] + merged[-1][1].length:
        first, last = merged[-1]
        return (*merged[:-1], (first, Block(block.arena, last.lo, block.hi)))
    return (*merged, (start, block))


class StateGrad:
    """Gradient with respect to a state's tensors, allocated lazily (zeros) and released chunk by chunk.

    Buffers are keyed by the arena (same shape as its storage) or by the recurrent state object. They accumulate in
    at least fp32 (``accumulate_dtype``; a bf16 model's early-chunk gradient is a sum over thousands of later
    positions, which bf16 additions would round away); ``nbytes`` counts them at that width.
    """

    def __init__(self, accumulate_dtype: torch.dtype | None = torch.float32) -> None:
        """accumulate_dtype: buffers are ``promote_types(state dtype, accumulate_dtype)``; None: the state's own."""
        self.accumulate_dtype = accumulate_dtype
        self._arena: dict[int, tuple[Arena, tuple[Tensor, ...]]] = {}
        self._recurrent: dict[int, tuple[RecurrentState, tuple[Tensor, ...]]] = {}

    def zeros_like(self, like: Tensor) -> Tensor:
        """Zeros shaped like ``like`` at the width this gradient accumulates in."""
        dtype = like.dtype if self.accumulate_dtype is None else torch.promote_types(like.dtype, self.accumulate_dtype)
        return torch.zeros(like.shape, dtype=dtype, device=like.device)

    def arena_buffers(self, arena: Arena) -> tuple[Tensor, ...]:
        entry = self._arena.get(id(arena))
        if entry is None:
            entry = (arena, tuple(self.zeros_like(t) for t in arena.tensors))
            self._arena[id(arena)] = entry
        return entry[1]

    def block_grads(self, block: Block) -> tuple[Tensor, ...]:
        """The gradient buffers of ``block``'s positions (its arena's buffers allocated on first use)."""
        return tuple(buf[block.lo : block.hi] for buf in self.arena_buffers(block.arena))

    def existing_block_grads(self, block: Block) -> tuple[Tensor, ...] | None:
        """``block_grads`` if anything was added to its arena yet, else None (nothing to backpropagate)."""
        return self.block_grads(block) if id(block.arena) in self._arena else None

    def recurrent_grads(self, rec: RecurrentState) -> tuple[Tensor, ...]:
        entry = self._recurrent.get(id(rec))
        if entry is None:
            entry = (rec, tuple(self.zeros_like(t) for t in rec.tensors))
            self._recurrent[id(rec)] = entry
        return entry[1]

    def existing_recurrent_grads(self, rec: RecurrentState) -> tuple[Tensor, ...] | None:
        return self.recurrent_grads(rec) if id(rec) in self._recurrent else None

    def release_arena(self, arena: Arena) -> None:
        self._arena.pop(id(arena), None)

    def release_recurrent(self, rec: RecurrentState) -> None:
        self._recurrent.pop(id(rec), None)

    @property
    def nbytes(self) -> int:
        total = 0
        for _, bufs in list(self._arena.values()) + list(self._recurrent.values()):
            total += sum(b.numel() * b.element_size() for b in bufs)
        return total


def leaf_into(view: Tensor, grad_buffer: Tensor) -> Tensor:
    """A leaf aliasing ``view`` whose gradient is added into ``grad_buffer`` as soon as it is ready.

    The post-accumulate hook frees the leaf's own ``.grad`` right away, so at most one block's transient gradient
    exists at a time; the buffer (a slice of the state's gradient) is the only lasting copy.
    """
    leaf = view.detach().requires_grad_(True)

    def _accumulate(t: Tensor) -> None:
        assert t.grad is not None  # the hook runs after the gradient was accumulated
        grad_buffer.add_(t.grad)
        t.grad = None

    leaf.register_post_accumulate_grad_hook(_accumulate)
    return leaf
