"""Incremental prefill: evaluate shared context once without autograd, keep only what later tokens need.

>>> engine = Engine(model)                    # a transformers CausalLM of a supported family, any dtype
>>> state = engine.capture(prefix_ids)        # chunked, no graph; state.num_tokens, state.nbytes
>>> logits = engine.logits(state, ids)        # == model(cat(prefix, ids)).logits[0, len(prefix):]
>>> child = engine.extend(state, more_ids)    # covers prefix + more_ids; `state` stays valid and unchanged

Exact gradients through the prefix (DESIGN.md, "Exact gradients"): pass a ``StateGrad`` to ``logits`` so the
state's tensors enter the branch graph as leaves whose gradient is accumulated into it, then call ``backward`` to
walk the state's chunks in reverse, recomputing each under autograd from the K/V of earlier chunks and the
recurrent state checkpointed at its start, and backpropagating into the parameters and earlier chunks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from longstraw_agents.attention import BACKEND_NAMES, DEFAULT_SCORE_ELEMENTS, Attention
from longstraw_agents.models import FamilyAdapter, StateSize, adapter_for, state_size
from longstraw_agents.models.base import LayerContext, PastBlock
from longstraw_agents.state import (
    Arena,
    Block,
    ChunkRecord,
    RecurrentState,
    State,
    StateGrad,
    leaf_into,
)
from longstraw_agents.token_ids import as_token_ids

__all__ = ["Engine", "EngineConfig", "ChunkLoss", "State", "StateGrad", "StateSize", "state_size"]

# loss_fn(logits [n, V], start, end) -> scalar loss for the tokens at positions [start, end), or None
ChunkLoss = Callable[[Tensor, int, int], Tensor | None]


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings.

    chunk_size: tokens evaluated per forward during capture/extend; bounds activation memory (and, in exact mode,
        the size of one recomputed graph).
    attention: the attention backend: "auto" (the fastest one that takes the shapes), "cpu-flash", "cuda-flash" or
        "eager" (see ``longstraw_agents.attention``).
    max_score_elements: attention scores (heads x queries x keys) the eager backend (and DSA's indexer) materialise
        at once; longer key blocks are processed in pieces, so a chunk's transient memory does not grow with the
        prefix. In backward, a block's key/value gradient is computed for at most
        ``max(chunk_size, max_score_elements / elements per position)`` positions at a time.
    """

    chunk_size: int = 512
    attention: str = "auto"
    max_score_elements: int = DEFAULT_SCORE_ELEMENTS

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.max_score_elements < 1:
            raise ValueError(f"max_score_elements must be >= 1, got {self.max_score_elements}")
        if self.attention not in BACKEND_NAMES:
            raise ValueError(f"attention must be one of {list(BACKEND_NAMES)}, got {self.attention!r}")


class Engine:
    """capture / extend / logits over a model's own state objects (never a transformers cache)."""

    def __init__(self, model: nn.Module, config: EngineConfig | None = None, *, chunk_size: int | None = None):
        self.model = model
        self.adapter: FamilyAdapter = adapter_for(model)
        config = config or EngineConfig()
        if chunk_size is not None:
            config = dataclasses.replace(config, chunk_size=chunk_size)
        self.config = config
        self.attention = Attention(config.attention, config.max_score_elements, self._gradient_piece(config))

    @property
    def family(self) -> str:
        return self.adapter.family

    @property
    def num_layers(self) -> int:
        return len(self.adapter.layers)

    # --- public API -----------------------------------------------------------------------------------------
    def empty_state(self, checkpoints: bool = False) -> State:
        return State(chunks=(), num_layers=self.num_layers, checkpoints=checkpoints, owner=id(self.model))

    def capture(
        self, ids: Tensor | Sequence[int], *, checkpoints: bool = False, chunk_size: int | None = None
    ) -> State:
        """Evaluate ``ids`` from position 0 in chunks under ``no_grad``.

        checkpoints: keep each chunk's recurrent state so that ``backward`` can recompute chunks (exact mode).
        """
        return self.extend(self.empty_state(checkpoints), ids, chunk_size=chunk_size)

    def extend(
        self, state: State, ids: Tensor | Sequence[int], *, chunk_size: int | None = None, reserve: int = 0
    ) -> State:
        """A child state covering ``state`` + ``ids``; ``state`` itself is untouched and stays valid.

        reserve: extra positions to allocate for later in-place appends (token-by-token decoding); an append goes
            in place only while no sibling has written past the parent's end, otherwise into fresh storage.
        """
        child, _ = self._extend(state, self._check_ids(ids), chunk_size, reserve, want_logits=False)
        return child

    def step(self, state: State, ids: Tensor | Sequence[int], *, reserve: int = 0) -> tuple[State, Tensor]:
        """``extend`` plus the next-token logits after the last of ``ids`` (``[V]``), in one forward: sampling."""
        child, last = self._extend(state, self._check_ids(ids), None, reserve, want_logits=True)
        assert last is not None  # the last chunk's logits were asked for
        return child, last

    def logits(self, state: State, ids: Tensor | Sequence[int], *, grad: StateGrad | None = None) -> Tensor:
        """Logits ``[len(ids), V]`` of ``ids`` after ``state``; the graph (if grad is enabled) covers ``ids`` only.

        grad: when given, the state's tensors enter the graph as leaves and their gradients accumulate into it.
        """
        self._check_state(state)
        ids = self._check_ids(ids)
        contexts = self._contexts(state, len(state.chunks), grad)
        hidden, _ = self._forward(ids, state.num_tokens, contexts)
        return self.adapter.lm_head(hidden)

    def backward(
        self,
        state: State,
        grad: StateGrad,
        ids: Tensor | Sequence[int],
        *,
        since: State | None = None,
        loss_fn: ChunkLoss | None = None,
    ) -> None:
        """Backpropagate ``grad`` (and ``loss_fn``'s loss) through the chunks of ``state`` after ``since``.

        ``ids`` are the tokens of those chunks (the engine keeps no token ids). Chunks are recomputed in reverse
        under autograd with earlier chunks' tensors as leaves; parameter gradients accumulate in ``.grad``, the
        gradients for earlier chunks (and ``since``'s tensors) in ``grad``. Peak: state + grad + one chunk graph.
        """
        self._check_state(state)
        ids = self._check_ids(ids, allow_empty=True)
        base = since.num_tokens if since is not None else 0
        if ids.shape[0] != state.num_tokens - base:
            raise ValueError(
                f"ids cover {ids.shape[0]} tokens; the chunks after `since` cover {state.num_tokens - base}"
            )
        first = next((j for j, chunk in enumerate(state.chunks) if chunk.start >= base), len(state.chunks))
        if first < len(state.chunks) and state.chunks[first].start != base:
            raise ValueError("`since` must be an ancestor of `state` (its end must fall on a chunk boundary)")
        for j in reversed(range(first, len(state.chunks))):
            chunk = state.chunks[j]
            self._backward_chunk(state, j, ids[chunk.start - base : chunk.end - base], grad, loss_fn)

    # --- internals ------------------------------------------------------------------------------------------
    def _forward(self, ids: Tensor, start: int, contexts: list[LayerContext]):
        return self.adapter.forward(ids, start, contexts, attention=self.attention)

    def _gradient_piece(self, config: EngineConfig) -> int:
        """Positions of a state block whose key/value gradient the attention backward computes at once: the score
        budget's worth of elements, never fewer than a chunk (fewer, larger kernel calls)."""
        per_position = max(
            (
                sum(math.prod(shape) for shape in layer.mixer.state_shapes())
                for layer in self.adapter.layers
                if layer.mixer.grows
            ),
            default=1,
        )
        return max(config.chunk_size, config.max_score_elements // per_position)

    def _check_ids(self, ids: Tensor | Sequence[int], allow_empty: bool = False) -> Tensor:
        ids = as_token_ids(ids, allow_empty=allow_empty, vocab_size=self.adapter.vocab_size)
        return ids.to(device=self.adapter.device)

    def _check_state(self, state: State) -> None:
        if not isinstance(state, State):
            raise TypeError(f"expected a State from Engine.capture/extend, got {type(state).__name__}")
        if state.owner != id(self.model) or state.num_layers != self.num_layers:
            raise ValueError("this state was made by an engine over a different model")

    def _contexts(self, state: State, upto: int, grad: StateGrad | None) -> list[LayerContext]:
        """What each layer reads of the first ``upto`` chunks. With ``grad``, attention blocks carry their slices of
        the state's gradient buffers (the attention backward adds into them) and recurrent states enter the graph
        as leaves whose gradients are added into theirs."""
        contexts = []
        for i, layer in enumerate(self.adapter.layers):
            if layer.mixer.grows:
                past = [
                    PastBlock(block.views(), None if grad is None else grad.block_grads(block))
                    for block in state.blocks(i, upto)
                ]
                contexts.append(LayerContext(past=past))
                continue
            rec = state.recurrent(i, upto - 1) if upto else None
            tensors = None
            if rec is not None:
                tensors = rec.tensors
                if grad is not None:
                    tensors = tuple(leaf_into(t, g) for t, g in zip(tensors, grad.recurrent_grads(rec), strict=True))
            contexts.append(LayerContext(recurrent=tensors))
        return contexts

    def _arenas_for(self, state: State, n: int, reserve: int) -> list[Arena | None]:
        """Per growing layer, the arena to append ``n`` positions to: the last one in place, or a new one."""
        arenas: list[Arena | None] = []
        for i, layer in enumerate(self.adapter.layers):
            if not layer.mixer.grows:
                arenas.append(None)
                continue
            blocks = state.blocks(i)
            last = blocks[-1] if blocks else None
            if last is not None and last.arena.can_append(last.hi, n):
                arenas.append(last.arena)
            else:
                shapes = layer.mixer.state_shapes()
                arenas.append(Arena(shapes, n + reserve, self.adapter.dtype, self.adapter.device))
        return arenas

    def _extend(
        self, state: State, ids: Tensor, chunk_size: int | None, reserve: int, want_logits: bool
    ) -> tuple[State, Tensor | None]:
        self._check_state(state)
        chunk = chunk_size or self.config.chunk_size
        arenas = self._arenas_for(state, ids.shape[0], reserve)
        current = state
        last_logits = None
        with torch.no_grad():
            for lo in range(0, ids.shape[0], chunk):
                piece = ids[lo : lo + chunk]
                contexts = self._contexts(current, len(current.chunks), None)
                hidden, new = self._forward(piece, current.num_tokens, contexts)
                current = current.append(self._record(current.num_tokens, piece.shape[0], new, arenas))
                if want_logits and lo + chunk >= ids.shape[0]:
                    last_logits = self.adapter.lm_head(hidden[-1:])[0]
        return current, last_logits

    def _record(self, start: int, n: int, new: list[tuple[Tensor, ...]], arenas: list[Arena | None]) -> ChunkRecord:
        blocks: list[Block | None] = []
        recurrent: list[RecurrentState | None] = []
        for entry, arena in zip(new, arenas, strict=True):
            if arena is not None:
                blocks.append(arena.append(entry))
                recurrent.append(None)
            else:
                blocks.append(None)
                recurrent.append(RecurrentState(tuple(t.detach() for t in entry)))
        return ChunkRecord(start, n, tuple(blocks), tuple(recurrent))

    def _backward_chunk(self, state: State, j: int, ids: Tensor, grad: StateGrad, loss_fn: ChunkLoss | None) -> None:
        chunk = state.chunks[j]
        outputs: list[Tensor] = []
        grads: list[Tensor] = []
        with torch.enable_grad():
            contexts = self._contexts(state, j, grad)
            hidden, new = self._forward(ids, chunk.start, contexts)
            for i, entry in enumerate(new):
                block, rec = chunk.blocks[i], chunk.recurrent[i]
                if block is not None:
                    upstream = grad.existing_block_grads(block)
                else:
                    if rec is None:
                        raise ValueError("state keeps no recurrent checkpoint for this chunk (checkpoints=True)")
                    upstream = grad.existing_recurrent_grads(rec)
                if upstream is not None:
                    outputs.extend(entry)
                    grads.extend(upstream)
            if loss_fn is not None:
                loss = loss_fn(self.adapter.lm_head(hidden), chunk.start, chunk.end)
                if loss is not None:
                    outputs.append(loss)
                    grads.append(torch.ones_like(loss))
            if outputs:
                torch.autograd.backward(outputs, grads)
        self._release(chunk, grad)

    @staticmethod
    def _release(chunk: ChunkRecord, grad: StateGrad) -> None:
        """Drop gradient buffers nothing earlier can add to any more."""
        for block, rec in zip(chunk.blocks, chunk.recurrent, strict=True):
            if block is not None and block.lo == 0:
                grad.release_arena(block.arena)
            if rec is not None:
                grad.release_recurrent(rec)
