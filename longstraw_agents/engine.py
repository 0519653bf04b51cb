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
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch import Tensor, nn

from longstraw_agents.attention import BACKEND_NAMES, DEFAULT_SCORE_ELEMENTS, Attention, Shards
from longstraw_agents.memory import MemoryTracker
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

# loss_fn(hidden [n, hidden], start, end) -> scalar loss for the tokens at positions [start, end), or None; it gets
# the final-normed hidden states, not logits, so that it can apply the LM head in tiles (longstraw_agents.logprobs)
ChunkLoss = Callable[[Tensor, int, int], Tensor | None]
GradAccumulation = Literal["fp32", "state"]
MAX_CHECKPOINT_SPACING = 64  # models without per-token state (all recurrent) keep one snapshot per 64 chunks


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings.

    chunk_size: tokens evaluated per forward during capture/extend; bounds activation memory (and, in exact mode,
        the size of one recomputed graph).
    attention: the attention backend: "auto" (the fastest one that takes the shapes), "cpu-flash", "cuda-flash" or
        "eager" (see ``longstraw_agents.attention``).
    max_score_elements: attention scores (heads x queries x keys) the eager backend (and DSA's indexer) materialise
        at once; longer key blocks are processed in pieces, so a chunk's transient memory does not grow with the
        prefix. In backward, a state block's key/value gradient is computed ``chunk_size`` positions at a time.
    checkpoint_every: with exact gradients, keep the recurrent (GatedDeltaNet) state after every k-th chunk; the
        reverse walk recomputes the ones in between forward from the nearest checkpoint (one extra no-grad forward of
        those chunks). None: the smallest k whose checkpoints take no more memory per token than the attention
        state (1 for the tiny presets; 5 for a Qwen3.6-27B layout at chunk 512).
    grad_accumulation: the state gradient's buffers: "fp32" (at least fp32: bf16 models get fp32 buffers) or
        "state" (the state's own dtype).
    graph_budget_bytes: exact mode keeps the autograd graphs of the last prefix chunks that fit in this many bytes
        instead of recomputing them in the reverse walk (0: recompute every chunk, the smallest peak); a budget at
        a full-graph trainer's peak makes exact mode about as fast as one. With context parallelism a budget makes
        the capture replicated (the kept graphs need every chunk on every rank), and so the reverse walk.
    activation_checkpointing: graphs (branch replays, recomputed chunks) keep each layer's input only and recompute
        the layer in backward — a large model's branch graph shrinks from every layer's activations to one layer's
        (one more forward of the branch or chunk).
    wavefront_walk: with context parallelism, exact mode's capture keeps each rank's layer inputs (one hidden vector
        per position and layer of its shard) and the reverse walk runs sharded in a wavefront over (rank, layer);
        False: every rank recomputes every chunk in the walk (no layer inputs kept; the choice when they do not fit —
        ``longstraw plan`` shows both). See docs/distributed.md.
    layer_inputs_every: the wavefront walk's layer inputs are kept at every k-th layer only; the walk recomputes the
        ones between, a segment of k layers at a time (forward, no graph): ``L / k + k`` hidden vectors per position
        instead of ``L``. None: k = ceil(sqrt(L)).
    """

    chunk_size: int = 512
    attention: str = "auto"
    max_score_elements: int = DEFAULT_SCORE_ELEMENTS
    checkpoint_every: int | None = None
    grad_accumulation: GradAccumulation = "fp32"
    graph_budget_bytes: int = 0
    activation_checkpointing: bool = False
    wavefront_walk: bool = True
    layer_inputs_every: int | None = None

    def __post_init__(self) -> None:
        if self.layer_inputs_every is not None and self.layer_inputs_every < 1:
            raise ValueError(f"layer_inputs_every must be >= 1 (or None), got {self.layer_inputs_every}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.max_score_elements < 1:
            raise ValueError(f"max_score_elements must be >= 1, got {self.max_score_elements}")
        if self.attention not in BACKEND_NAMES:
            raise ValueError(f"attention must be one of {list(BACKEND_NAMES)}, got {self.attention!r}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ValueError(
                f"checkpoint_every must be >= 1 (or None: chosen from memory), got {self.checkpoint_every}"
            )
        if self.graph_budget_bytes < 0:
            raise ValueError(f"graph_budget_bytes must be >= 0, got {self.graph_budget_bytes}")
        if self.grad_accumulation not in ("fp32", "state"):
            raise ValueError(f"grad_accumulation must be 'fp32' or 'state', got {self.grad_accumulation!r}")


def checkpoint_spacing(model_config: Any, dtype: torch.dtype, config: EngineConfig) -> int:
    """``config.checkpoint_every``, or the smallest k whose recurrent checkpoints (one every k chunks) take no more
    memory per token than the attention state of ``model_config`` (1 without recurrent layers)."""
    if config.checkpoint_every is not None:
        return config.checkpoint_every
    size = state_size(model_config, dtype)
    per_chunk = size.bytes_per_token * config.chunk_size
    if size.fixed_bytes == 0:
        return 1
    if per_chunk == 0:
        return MAX_CHECKPOINT_SPACING
    return max(1, min(MAX_CHECKPOINT_SPACING, math.ceil(size.fixed_bytes / per_chunk)))


def layer_inputs_spacing(num_layers: int, config: EngineConfig) -> int:
    """``config.layer_inputs_every``, or ceil(sqrt(layers)): the kept inputs and one recomputed segment then take
    about ``2 sqrt(L)`` hidden vectors per position."""
    return config.layer_inputs_every or math.ceil(math.sqrt(num_layers))


class StateShards(Shards, Protocol):
    """Context parallelism as the engine sees it: the ranks of a group hold contiguous shards of the positions'
    state (``longstraw_agents.parallel.ContextParallel`` implements it); a position's attention/MLA state is stored
    by its owner only. A capture (and exact mode's walk over it) shards the compute too — each rank evaluates its own
    chunks, meeting the others in a wavefront of point-to-point messages; short extends and branch replays run the
    same computation on every rank, attention merging every rank's partial."""

    rank: int
    shard_size: int

    def owner(self, position: int) -> int:
        """The rank that stores ``position``'s state."""
        ...

    def shard_end(self, position: int) -> int:
        """The first position after ``position``'s shard (chunks never cross it)."""
        ...

    def fit(self, prompt_len: int, chunk: int) -> None:
        """Re-cut the shards so that a prompt of ``prompt_len`` positions spreads evenly over the ranks."""
        ...

    def broadcast(self, tensor: Tensor, src: int) -> Tensor:
        """``tensor`` as rank ``src`` has it, on every rank (in place)."""
        ...

    size: int

    def send(self, tensors: Sequence[Tensor], dst: int, tag: int, kind: str) -> None:
        """Start sending ``tensors`` to rank ``dst`` (``flush`` waits for the sends); ``kind`` names the payload."""
        ...

    def recv(self, src: int, tag: int, device: torch.device) -> tuple[Tensor, ...]:
        """What rank ``src`` sent with ``tag``."""
        ...

    def flush(self, kind: str | None = None, keep: int = 0) -> None:
        """Wait for this rank's sends (of ``kind``; all but the last ``keep`` messages)."""
        ...

    def sum_(self, tensor: Tensor, kind: str = "dq") -> Tensor:
        """``tensor`` summed over the ranks, in place (``kind`` names the payload)."""
        ...

    def broadcast_tensors(self, tensors: Sequence[Tensor] | None, src: int, device: torch.device) -> tuple[Tensor, ...]:
        """Rank ``src``'s ``tensors`` on every rank (the others pass None)."""
        ...


class Engine:
    """capture / extend / logits over a model's own state objects (never a transformers cache).

    shards: context parallelism (``longstraw_agents.parallel``): this rank stores the state of its shard of the
    positions only, and every rank of the group must make the same calls in the same order. A capture (an extend
    at least as long as its parent) and exact mode's walk over it are computed shard by shard, layer by layer, in a
    wavefront across the ranks (``_ShardedExtend``, ``_WavefrontWalk``); shorter extends and branch replays are
    replicated, attention combining the ranks' partial results. Results equal one process's."""

    def __init__(
        self,
        model: nn.Module,
        config: EngineConfig | None = None,
        *,
        chunk_size: int | None = None,
        shards: StateShards | None = None,
    ):
        self.model = model
        self.adapter: FamilyAdapter = adapter_for(model)
        config = config or EngineConfig()
        if chunk_size is not None:
            config = dataclasses.replace(config, chunk_size=chunk_size)
        self.config = config
        self.shards = shards
        # a state block's dK/dV are computed a chunk of positions at a time: the transient stays below a chunk's graph
        self.attention = Attention(config.attention, config.max_score_elements, config.chunk_size, shards)
        self.local_attention = dataclasses.replace(self.attention, shards=None)  # every key on this rank

    @property
    def family(self) -> str:
        return self.adapter.family

    @property
    def num_layers(self) -> int:
        return len(self.adapter.layers)

    @property
    def checkpoint_spacing(self) -> int:
        """k: exact-mode states keep the recurrent state after every k-th chunk (see ``EngineConfig``)."""
        return checkpoint_spacing(self.model.config, self.adapter.dtype, self.config)

    @property
    def layer_inputs_spacing(self) -> int:
        """k: the wavefront walk's layer inputs are kept every k layers (see ``EngineConfig``)."""
        return layer_inputs_spacing(self.num_layers, self.config)

    # --- public API -----------------------------------------------------------------------------------------
    def empty_state(self, checkpoints: bool | int = False) -> State:
        """A state of no tokens. checkpoints: True keeps recurrent checkpoints every ``checkpoint_spacing`` chunks
        (exact gradients), an int every that many chunks, False only the last."""
        spacing = self.checkpoint_spacing if checkpoints is True else int(checkpoints)
        return State(chunks=(), num_layers=self.num_layers, checkpoints=spacing, owner=id(self.model))

    def new_grad(self) -> StateGrad:
        """An empty state gradient accumulating as ``EngineConfig.grad_accumulation`` says."""
        return StateGrad(torch.float32 if self.config.grad_accumulation == "fp32" else None)

    def capture(
        self, ids: Tensor | Sequence[int], *, checkpoints: bool | int = False, chunk_size: int | None = None
    ) -> State:
        """Evaluate ``ids`` from position 0 in chunks under ``no_grad``.

        checkpoints: keep recurrent checkpoints so that ``backward`` can recompute chunks (exact mode); see
            ``empty_state``.
        """
        return self.extend(self.empty_state(checkpoints), ids, chunk_size=chunk_size)

    def extend(
        self,
        state: State,
        ids: Tensor | Sequence[int],
        *,
        chunk_size: int | None = None,
        reserve: int = 0,
        keep: GraphBank | None = None,
    ) -> State:
        """A child state covering ``state`` + ``ids``; ``state`` itself is untouched and stays valid.

        reserve: extra positions to allocate for later in-place appends (token-by-token decoding); an append goes
            in place only while no sibling has written past the parent's end, otherwise into fresh storage.
        keep: exact mode's bank of chunk graphs (``graph_bank``): the chunks are evaluated under autograd and the
            last ones that fit its budget keep their graphs, so ``backward`` need not recompute them.
        """
        child, _ = self._extend(state, self._check_ids(ids), chunk_size, reserve, want_logits=False, keep=keep)
        return child

    def graph_bank(self, grad: StateGrad) -> GraphBank:
        """A bank for ``EngineConfig.graph_budget_bytes`` of kept chunk graphs feeding ``grad``."""
        return GraphBank(self.config.graph_budget_bytes, grad)

    def step(self, state: State, ids: Tensor | Sequence[int], *, reserve: int = 0) -> tuple[State, Tensor]:
        """``extend`` plus the next-token logits after the last of ``ids`` (``[V]``), in one forward: sampling."""
        child, last = self._extend(state, self._check_ids(ids), None, reserve, want_logits=True)
        assert last is not None  # the last chunk's logits were asked for
        return child, last

    def logits(self, state: State, ids: Tensor | Sequence[int], *, grad: StateGrad | None = None) -> Tensor:
        """Logits ``[len(ids), V]`` of ``ids`` after ``state``; the graph (if grad is enabled) covers ``ids`` only.

        grad: when given, the state's tensors enter the graph and their gradients accumulate into it.
        """
        return self.adapter.lm_head(self.hidden(state, ids, grad=grad))

    def hidden(self, state: State, ids: Tensor | Sequence[int], *, grad: StateGrad | None = None) -> Tensor:
        """The final-normed hidden states ``[len(ids), hidden]`` of ``ids`` after ``state`` (what the LM head reads;
        ``longstraw_agents.logprobs`` turns them into log-probabilities without a [n, V] tensor)."""
        self._check_state(state)
        ids = self._check_ids(ids)
        contexts = self._contexts(state, len(state.chunks), grad)
        hidden, _ = self._forward(ids, state.num_tokens, contexts)
        return hidden

    def backward(
        self,
        state: State,
        grad: StateGrad,
        ids: Tensor | Sequence[int],
        *,
        since: State | None = None,
        loss_fn: ChunkLoss | None = None,
        into_since: bool = True,
        kept: GraphBank | None = None,
    ) -> bool:
        """Backpropagate ``grad`` (and ``loss_fn``'s loss) through the chunks of ``state`` after ``since``.

        ``ids`` are the tokens of those chunks (the engine keeps no token ids). Chunks are recomputed in reverse
        under autograd; parameter gradients accumulate in ``.grad``, the gradients for earlier chunks in ``grad``,
        and — unless ``into_since`` is False (detached mode's long branches) — those for ``since``'s tensors too.
        Recurrent states the state does not keep (between checkpoints) are recomputed forward, without a graph,
        from the nearest checkpoint. Chunks whose graphs ``kept`` holds are not recomputed. Peak: state + grad +
        one chunk graph (+ up to k-1 recurrent states, + the kept graphs).

        Returns whether the walk was sharded over context-parallel ranks (a capture kept in ``kept``): each rank
        then evaluated ``loss_fn`` on its own chunks only, so sums taken inside it cover this rank's share.
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
        inputs = kept.pop_layer_inputs(state) if kept is not None and base == 0 else None
        if inputs is not None and self.shards is not None:  # a sharded capture: its ranks walk it in a wavefront
            _WavefrontWalk(self, self.shards, state, grad, ids, loss_fn, inputs).run()
            return True
        walk = _RecurrentWalk(self, state, since, ids, base, first)
        for j in reversed(range(first, len(state.chunks))):
            chunk = state.chunks[j]
            chunk_ids = ids[chunk.start - base : chunk.end - base]
            before, after = walk.after(j - 1), walk.after(j)
            graph = kept.pop(chunk) if kept is not None else None
            self._backward_chunk(
                state, j, chunk_ids, grad, loss_fn, before, after, base if not into_since else 0, graph
            )
            walk.forget(j)
        return False

    # --- internals ------------------------------------------------------------------------------------------
    def _forward(self, ids: Tensor, start: int, contexts: list[LayerContext]):
        return self.adapter.forward(
            ids, start, contexts, attention=self.attention, checkpoint_layers=self.config.activation_checkpointing
        )

    def _check_ids(self, ids: Tensor | Sequence[int], allow_empty: bool = False) -> Tensor:
        ids = as_token_ids(ids, allow_empty=allow_empty, vocab_size=self.adapter.vocab_size)
        return ids.to(device=self.adapter.device)

    def _check_state(self, state: State) -> None:
        if not isinstance(state, State):
            raise TypeError(f"expected a State from Engine.capture/extend, got {type(state).__name__}")
        if state.owner != id(self.model) or state.num_layers != self.num_layers:
            raise ValueError("this state was made by an engine over a different model")

    def _contexts(
        self,
        state: State,
        upto: int,
        grad: StateGrad | None,
        recurrent_before: Sequence[RecurrentState | None] | None = None,
        frozen_before: int = 0,
    ) -> list[LayerContext]:
        """What each layer reads of the first ``upto`` chunks. With ``grad``, attention blocks carry their slices of
        the state's gradient buffers (the attention backward adds into them) and recurrent states enter the graph
        as leaves whose gradients are added into theirs — except positions before ``frozen_before``, which stay
        constants. ``recurrent_before``: the recurrent states to start from (default: the state's own)."""
        contexts = []
        for i, layer in enumerate(self.adapter.layers):
            if layer.mixer.grows:
                blocks = state.positioned_blocks(i, upto)
                contexts.append(LayerContext(past=self._past_blocks(blocks, grad, frozen_before)))
                continue
            start = state.chunks[upto].start if upto < len(state.chunks) else state.num_tokens
            rec = (
                recurrent_before[i]
                if recurrent_before is not None
                else (state.recurrent(i, upto - 1) if upto else None)
            )
            tensors = None
            if rec is not None:
                tensors = rec.tensors
                if grad is not None and start > frozen_before:
                    tensors = tuple(leaf_into(t, g) for t, g in zip(tensors, grad.recurrent_grads(rec), strict=True))
            contexts.append(LayerContext(recurrent=tensors))
        return contexts

    @staticmethod
    def _past_blocks(blocks: list[tuple[int, Block]], grad: StateGrad | None, frozen_before: int) -> list[PastBlock]:
        """The blocks (with the position each starts at) as the mixers read them, with gradient sinks from ``grad``
        for positions >= ``frozen_before`` (a block straddling it is split)."""
        past = []
        for position, block in blocks:
            views, end = block.views(), position + block.length
            if grad is None or end <= frozen_before:
                past.append(PastBlock(views, None, position))
            elif position >= frozen_before:
                past.append(PastBlock(views, grad.block_grads(block), position))
            else:
                cut = frozen_before - position
                sinks = grad.block_grads(block)
                past.append(PastBlock(tuple(v[:cut] for v in views), None, position))
                past.append(PastBlock(tuple(v[cut:] for v in views), tuple(g[cut:] for g in sinks), frozen_before))
        return past

    def _arenas_for(self, state: State, n: int, reserve: int) -> list[Arena | None]:
        """Per growing layer, the arena to append ``n`` positions to: the last one in place, or a new one (none when
        this rank stores nothing of them)."""
        arenas: list[Arena | None] = []
        for i, layer in enumerate(self.adapter.layers):
            if not layer.mixer.grows or n + reserve == 0:
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
        self,
        state: State,
        ids: Tensor,
        chunk_size: int | None,
        reserve: int,
        want_logits: bool,
        keep: GraphBank | None = None,
    ) -> tuple[State, Tensor | None]:
        self._check_state(state)
        chunk = chunk_size or self.config.chunk_size
        keeping = keep is not None and keep.budget_bytes > 0
        if self.shards is not None and not keeping and not want_logits and ids.shape[0] >= state.num_tokens:
            # a long extend (a capture): each rank computes its own shard, layer by layer (see _ShardedExtend)
            keep_inputs = keep if self.config.wavefront_walk else None
            return _ShardedExtend(self, self.shards, state, ids, chunk).run(reserve, keep_inputs), None
        pieces = self._pieces(state.num_tokens, ids.shape[0], chunk)
        owned = sum(hi - lo for lo, hi in pieces if self._owns(state.num_tokens + lo))
        arenas = self._arenas_for(state, owned, reserve if self._owns(state.num_tokens + ids.shape[0] - 1) else 0)
        # a kept chunk's graph reads the recurrent state before it: keep every one (the graph holds it anyway)
        current = state.with_checkpoints(1) if keeping else state
        last_logits = None
        for lo, hi in pieces:
            piece = ids[lo:hi]
            if keeping and keep is not None:
                with torch.enable_grad(), keep.measuring() as measured:
                    contexts = self._contexts(current, len(current.chunks), keep.grad)
                    hidden, new = self._forward(piece, current.num_tokens, contexts)
            else:
                with torch.no_grad():
                    contexts = self._contexts(current, len(current.chunks), None)
                    hidden, new = self._forward(piece, current.num_tokens, contexts)
            with torch.no_grad():
                record = self._record(current.num_tokens, piece.shape[0], new, arenas)
                current = current.append(record)
                if want_logits and hi == ids.shape[0]:
                    last_logits = self.adapter.lm_head(hidden[-1:])[0]
            if keeping and keep is not None:
                keep.add(record, new, hidden, measured.current_bytes)
        return current.with_checkpoints(state.checkpoints), last_logits

    def _pieces(self, start: int, n: int, chunk: int) -> list[tuple[int, int]]:
        """``[lo, hi)`` offsets of the chunks of ``n`` tokens from position ``start``: at most ``chunk`` long, and
        (context parallelism) never across a shard boundary."""
        pieces, lo = [], 0
        while lo < n:
            hi = min(lo + chunk, n)
            if self.shards is not None:
                hi = min(hi, self.shards.shard_end(start + lo) - start)
            pieces.append((lo, hi))
            lo = hi
        return pieces

    def _owns(self, position: int) -> bool:
        """Whether this rank stores the state of ``position`` (always, without context parallelism)."""
        return self.shards is None or self.shards.owner(position) == self.shards.rank

    def _record(self, start: int, n: int, new: list[tuple[Tensor, ...]], arenas: list[Arena | None]) -> ChunkRecord:
        """The chunk's record: growing layers' entries appended to their arenas — on the rank that owns the
        positions (context parallelism: elsewhere the chunk has no block) — and recurrent layers' new states."""
        store = self._owns(start)
        blocks: list[Block | None] = []
        recurrent: list[RecurrentState | None] = []
        for entry, arena, layer in zip(new, arenas, self.adapter.layers, strict=True):
            if layer.mixer.grows:
                blocks.append(arena.append(entry) if store and arena is not None else None)
                recurrent.append(None)
            else:
                blocks.append(None)
                recurrent.append(RecurrentState.owning(entry))
        return ChunkRecord(start, n, tuple(blocks), tuple(recurrent))

    def _backward_chunk(
        self,
        state: State,
        j: int,
        ids: Tensor,
        grad: StateGrad,
        loss_fn: ChunkLoss | None,
        before: Sequence[RecurrentState | None],
        after: Sequence[RecurrentState | None],
        frozen_before: int,
        graph: KeptGraph | None = None,
    ) -> None:
        chunk = state.chunks[j]
        outputs: list[Tensor] = []
        grads: list[Tensor] = []
        with torch.enable_grad():
            if graph is None:
                contexts = self._contexts(state, j, grad, before, frozen_before)
                hidden, new = self._forward(ids, chunk.start, contexts)
            else:
                hidden, new = graph.hidden, graph.new
            for entry, block, rec, layer in zip(new, chunk.blocks, after, self.adapter.layers, strict=True):
                if layer.mixer.grows:
                    upstream = self._block_upstream(chunk, block, entry, grad)
                else:
                    upstream = None if rec is None else grad.existing_recurrent_grads(rec)
                if upstream is not None:  # buffers may be wider than the outputs (fp32 accumulation)
                    outputs.extend(entry)
                    grads.extend(g.to(o.dtype) for o, g in zip(entry, upstream, strict=True))
            if loss_fn is not None:
                loss = loss_fn(hidden, chunk.start, chunk.end)
                if loss is not None:
                    outputs.append(loss)
                    grads.append(torch.ones_like(loss))
            if outputs:
                torch.autograd.backward(outputs, grads)
        self._release(chunk, after, grad)

    def _block_upstream(
        self, chunk: ChunkRecord, block: Block | None, entry: tuple[Tensor, ...], grad: StateGrad
    ) -> tuple[Tensor, ...] | None:
        """The gradient waiting for a chunk's new state entries; with context parallelism it lives on the chunk's
        owner and is broadcast, so that every rank's recomputation backpropagates the same thing."""
        if self.shards is None:
            return None if block is None else grad.existing_block_grads(block)
        owner = self.shards.owner(chunk.start)
        found = grad.existing_block_grads(block) if block is not None else None
        buffers = [found[i].clone() if found is not None else _zeros_like_grad(t, grad) for i, t in enumerate(entry)]
        return tuple(self.shards.broadcast(b, owner) for b in buffers)

    @staticmethod
    def _release(chunk: ChunkRecord, after: Sequence[RecurrentState | None], grad: StateGrad) -> None:
        """Drop gradient buffers nothing earlier can add to any more."""
        for block, rec in zip(chunk.blocks, after, strict=True):
            if block is not None and block.lo == 0:
                grad.release_arena(block.arena)
            if rec is not None:
                grad.release_recurrent(rec)


def _ownership(shards: StateShards, starts: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """For chunks starting at ``starts``: each one's owner, the indices of this rank's, and the ranks owning any."""
    owners = [shards.owner(start) for start in starts]
    mine = [j for j, owner in enumerate(owners) if owner == shards.rank]
    return owners, mine, sorted(set(owners))


def _staged(tensors: list[Tensor]) -> list[Tensor]:
    """``tensors`` in host memory, where point-to-point messages travel (``StateShards.send``): a no-op on CPU, one
    device-to-host copy on a GPU — made once, then shared by every message that carries them."""
    return [t.detach().to("cpu") for t in tensors]


def _joined_views(blocks: Sequence[Block]) -> list[Tensor]:
    """The rows of consecutive ``blocks`` (in position order) as one tensor per state tensor: views when they lie
    back to back in one arena, else a copy."""
    joined: list[Block] = []
    for block in blocks:
        if joined and block.follows(joined[-1]):
            joined[-1] = Block(block.arena, joined[-1].lo, block.hi)
        else:
            joined.append(block)
    parts = [b.views() for b in joined]
    return [pieces[0] if len(pieces) == 1 else torch.cat(pieces) for pieces in zip(*parts, strict=True)]


def _zeros_like_grad(t: Tensor, grad: StateGrad) -> Tensor:
    return torch.zeros(t.shape, dtype=_grad_dtype(t, grad), device=t.device)


def _grad_dtype(t: Tensor, grad: StateGrad) -> torch.dtype:
    return t.dtype if grad.accumulate_dtype is None else torch.promote_types(t.dtype, grad.accumulate_dtype)


@dataclass(frozen=True, eq=False)
class KeptGraph:
    """A chunk evaluated under autograd during capture: its final hidden states and new state entries (in the
    graph), and the bytes its forward left alive (the graph's saved tensors and these outputs)."""

    hidden: Tensor
    new: list[tuple[Tensor, ...]]
    nbytes: int


class GraphBank:
    """Exact mode's memory budget: the autograd graphs of the last capture chunks that fit ``budget_bytes``.

    Chunks are added in capture order; when the kept graphs exceed the budget, the oldest are dropped (their
    chunks will be recomputed), so what stays is the last chunks — the first the reverse walk reaches. The graphs
    read the state with ``grad``'s sinks, so backpropagating through one feeds the same buffers recomputation would.
    """

    def __init__(self, budget_bytes: int, grad: StateGrad):
        self.budget_bytes, self.grad = budget_bytes, grad
        self._graphs: dict[int, KeptGraph] = {}  # by id of the chunk record, in insertion (capture) order
        self._layer_inputs: dict[int, LayerInputs] = {}  # sharded captures', by id of the state's last record
        self.nbytes = 0

    @staticmethod
    def measuring() -> MemoryTracker:
        """Counts the storages a chunk's forward allocates; those still alive after it (``current_bytes``) are what
        its graph and outputs hold."""
        return MemoryTracker()

    def add(self, record: ChunkRecord, new: list[tuple[Tensor, ...]], hidden: Tensor, nbytes: int) -> None:
        self._graphs[id(record)] = KeptGraph(hidden, new, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.budget_bytes and self._graphs:
            oldest = next(iter(self._graphs))
            self.nbytes -= self._graphs.pop(oldest).nbytes

    def pop(self, record: ChunkRecord) -> KeptGraph | None:
        graph = self._graphs.pop(id(record), None)
        if graph is not None:
            self.nbytes -= graph.nbytes
        return graph

    def add_layer_inputs(self, state: State, inputs: LayerInputs) -> None:
        """Keep a sharded capture's layer inputs on this rank (outside the graph budget: the wavefront walk needs
        them, where the replicated walk would recompute every chunk on every rank)."""
        self._layer_inputs[id(state.chunks[-1])] = inputs
        self.nbytes += inputs.nbytes

    def pop_layer_inputs(self, state: State) -> LayerInputs | None:
        inputs = self._layer_inputs.pop(id(state.chunks[-1]), None) if state.chunks else None
        if inputs is not None:
            self.nbytes -= inputs.nbytes
        return inputs

    def __len__(self) -> int:
        return len(self._graphs)

    def __contains__(self, record: object) -> bool:
        return id(record) in self._graphs


class _ShardedExtend:
    """An extend under context parallelism whose compute is sharded: each rank evaluates only the chunks of its own
    positions, layer by layer across them (holding its shard's hidden states between layers), and the ranks meet in
    a wavefront — what layer i needs of earlier positions arrives from the ranks that hold them:

    - a growing layer (attention, MLA + DSA index keys): every rank that holds earlier rows of the layer (from the
      parent state, or computed in this extend) sends them to each later rank that computes here, once it has
      computed its own; the receiver attends to them as ordinary past blocks (one process's arithmetic) and drops
      them after the layer;
    - a recurrent layer (GatedDeltaNet): the state after a rank's last chunk goes to the rank computing the next
      chunk.

    Every message goes from a lower rank to a higher one, so rank r finishes layer i after rank r-1 did: the
    critical path is ``layers + ranks - 1`` layer steps of one shard, not their product. Afterwards the owners
    broadcast the recurrent states every rank's later work reads (the last, and exact mode's checkpoints); attention
    rows stay with their owners. Used where the new tokens are at least as many as the parent's (a capture): moving
    the earlier rows there costs no more than the rows computed; a short extend (a turn, a branch) instead runs
    replicated with partials merged (``Attention.shards``), which moves only the new tokens' partials."""

    def __init__(self, engine: Engine, shards: StateShards, state: State, ids: Tensor, chunk: int):
        self.engine, self.shards, self.state, self.ids = engine, shards, state, ids
        self.base = state.num_tokens
        self.pieces = [(self.base + lo, self.base + hi) for lo, hi in engine._pieces(self.base, ids.shape[0], chunk)]
        self.owners, self.mine, self.computing = _ownership(shards, [a for a, _ in self.pieces])
        # per rank holding rows once this extend is done (parent's or new; one contiguous range): its first position
        self.row_start: dict[int, int] = {}
        for start in [c.start for c in state.chunks] + [a for a, _ in self.pieces]:
            self.row_start.setdefault(shards.owner(start), start)

    def run(self, reserve: int, keep: GraphBank | None = None) -> State:
        """The child state. keep: exact mode's bank, which then holds this rank's layer inputs (``LayerInputs``)
        for the wavefront walk of a capture from position 0."""
        engine, adapter = self.engine, self.engine.adapter
        mine = [self.pieces[j] for j in self.mine]
        width = sum(b - a for a, b in mine)
        # later appends (a chain of turns, decoding) go to the owner of the position after these
        owns_next = self.shards.owner(self.base + self.ids.shape[0]) == self.shards.rank
        arenas = engine._arenas_for(self.state, width, reserve if owns_next else 0)
        blocks: list[list[Block | None]] = [[None] * engine.num_layers for _ in mine]
        recurrent: list[list[RecurrentState | None]] = [[None] * engine.num_layers for _ in mine]
        # every rank keeps inputs (empty without chunks), so that every rank picks the wavefront walk
        every = engine.layer_inputs_spacing
        inputs = LayerInputs.empty(adapter.device, every, self.shards) if keep is not None and self.base == 0 else None
        # the wavefront walk reads no checkpoint of another rank: only the last state is shared then
        share_checkpoints = keep is None or self.base > 0
        kept_after = [self._keeps(j, share_checkpoints) for j in self.mine]  # chunks whose states are kept
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
                self.shards.flush(keep=self.shards.size**2)
            self.shards.flush()
        child = self._records(blocks, recurrent, share_checkpoints)
        if inputs is not None and keep is not None:
            inputs.final = h if mine else None
            keep.add_layer_inputs(child, inputs)
        return child

    def _earlier_rows(self, i: int) -> list[PastBlock]:
        """Layer ``i``'s rows before this rank's first chunk, received from the ranks that hold them."""
        past = []
        for src in range(self.shards.rank):
            if src in self.row_start:
                tensors = self.shards.recv(src, i, self.engine.adapter.device)
                past.append(PastBlock(tensors, None, self.row_start[src]))
        past += self.engine._past_blocks(self.state.positioned_blocks(i), None, 0)  # this rank's own, earlier
        return past

    def _recurrent_before(self, i: int) -> tuple[Tensor, ...] | None:
        """Layer ``i``'s recurrent state before this rank's first chunk: the parent's, or the previous rank's."""
        if not self.mine:
            return None
        if self.mine[0] == 0:
            return self.state.recurrent(i).tensors if self.state.chunks else None  # type: ignore[union-attr]
        return self.shards.recv(self.owners[self.mine[0] - 1], i, self.engine.adapter.device)

    def _pass_on(
        self, i: int, grows: bool, blocks: list[list[Block | None]], carried: tuple[Tensor, ...] | None
    ) -> None:
        """Send what later ranks need of layer ``i``: this rank's rows, or the recurrent state after its chunks."""
        rank = self.shards.rank
        if grows:
            if rank not in self.row_start:
                return
            own = [b for _, b in self.state.positioned_blocks(i)]
            own += [row[i] for row in blocks if row[i] is not None]  # type: ignore[misc]
            rows = _staged(_joined_views(own))  # one host copy for every destination
            for dst in self.computing:
                if dst > rank:
                    self.shards.send(rows, dst, i, "rows")
        elif carried is not None and self.mine[-1] + 1 < len(self.pieces):
            self.shards.send(carried, self.owners[self.mine[-1] + 1], i, "recurrent")

    def _records(
        self, blocks: list[list[Block | None]], recurrent: list[list[RecurrentState | None]], share_checkpoints: bool
    ) -> State:
        """The child state; recurrent states another rank computed are broadcast by it where this rank's later work
        reads them (the last chunk's, and the checkpoints exact mode's replicated reverse walk starts from)."""
        engine, state = self.engine, self.state
        recurrent_layers = [i for i, layer in enumerate(engine.adapter.layers) if not layer.mixer.grows]
        current, k = state, 0
        for j, (a, b) in enumerate(self.pieces):
            mine = self.owners[j] == self.shards.rank
            nothing: list[RecurrentState | None] = [None] * engine.num_layers
            record_blocks = blocks[k] if mine else [None] * engine.num_layers
            states = recurrent[k] if mine else nothing
            needed = self._keeps(j, share_checkpoints)
            if recurrent_layers and needed:
                states = self._shared_recurrent(states, recurrent_layers, self.owners[j])
            # a chunk whose states no rank shares is marked not kept: a replicated walk recomputes them from the
            # nearest kept state instead of reading them as absent (position 0)
            kept = needed or not recurrent_layers
            current = current.append(ChunkRecord(a, b - a, tuple(record_blocks), tuple(states), kept=kept))
            k += mine
        return current

    def _keeps(self, j: int, share_checkpoints: bool) -> bool:
        """Whether every rank keeps the recurrent states after piece ``j``: the last, and shared checkpoints."""
        return j == len(self.pieces) - 1 or (
            share_checkpoints and self.state.keeps_checkpoint(len(self.state.chunks) + j)
        )

    def _shared_recurrent(
        self, states: list[RecurrentState | None], layers: list[int], src: int
    ) -> list[RecurrentState | None]:
        mine = src == self.shards.rank
        flat = [t for i in layers for t in states[i].tensors] if mine else None  # type: ignore[union-attr]
        received = self.shards.broadcast_tensors(flat, src, self.engine.adapter.device)
        if mine:
            return states
        out: list[RecurrentState | None] = [None] * self.engine.num_layers
        at = 0
        for i in layers:
            count = len(self.engine.adapter.layers[i].mixer.state_shapes())
            out[i] = RecurrentState(received[at : at + count])
            at += count
        return out


@dataclass(eq=False)
class LayerInputs:
    """What a sharded capture keeps on a rank for exact mode's wavefront walk: the input hidden states ``[n, hidden]``
    of the rank's chunks at every ``every``-th layer (the walk recomputes the layers between), each chunk's forward
    scratch before every layer (DSA's selection), the recurrent state before the rank's first chunk (recurrent
    layers), and the last layer's output: ``L / every + 1`` hidden vectors per position of the shard."""

    positions: Tensor
    rope: tuple[Tensor, Tensor]
    every: int = 1
    shard_size: int = 0  # the cut the capture was made under (the walk must see the same)
    hidden: dict[int, Tensor] = field(default_factory=dict)
    scratch: list[list[dict[str, Any]]] = field(default_factory=list)
    recurrent: list[tuple[Tensor, ...] | None] = field(default_factory=list)
    final: Tensor | None = None

    @classmethod
    def empty(cls, device: torch.device, every: int, shards: StateShards) -> LayerInputs:
        """The inputs of a rank without chunks (filled in when it has some)."""
        nothing = torch.empty(0, device=device)
        return cls(nothing.long(), (nothing, nothing), every, shards.shard_size)

    def add_layer(self, i: int, h: Tensor, scratch: list[dict[str, Any]], recurrent: tuple[Tensor, ...] | None) -> None:
        if i % self.every == 0:
            self.hidden[i] = h.clone()
        self.scratch.append([dict(s) for s in scratch])
        self.recurrent.append(None if recurrent is None else tuple(t.clone() for t in recurrent))

    @property
    def nbytes(self) -> int:
        tensors = [*self.hidden.values(), *(t for r in self.recurrent if r is not None for t in r)]
        tensors += [] if self.final is None else [self.final]
        scratch = {id(v): v for layer in self.scratch for chunk in layer for v in chunk.values() if torch.is_tensor(v)}
        return sum(t.numel() * t.element_size() for t in [*tensors, *scratch.values()])


# + the layer index (< 4096 layers): rows for a layer's backward, for its forward recomputation, their gradients
_ROWS_TAG, _RECOMPUTE_ROWS_TAG, _ROW_GRADS_TAG, _RECURRENT_GRAD_TAG = 1 << 12, 2 << 12, 3 << 12, 4 << 12


class _WavefrontWalk:
    """Exact mode's reverse walk over a sharded capture (``_ShardedExtend`` from position 0), compute sharded: each
    rank backpropagates only its own chunks, layer by layer from the last, reading the layer inputs the capture kept.

    Layer i on rank r needs the gradient of its chunks' outputs of layer i — from its own layer i+1 — and of the
    state rows it holds of layer i — from every later query, i.e. its own later chunks and every later rank's
    chunks at layer i. So rank r walks layer i once it has finished layer i+1 and the later ranks have finished layer
    i: a wavefront from the last rank, whose critical path is ``layers + ranks - 1`` layer steps (the naive order,
    each rank walking all its layers after the later ranks finished all theirs, is their product). The messages:

    - before the walk, each rank posts its rows of every growing layer to the later ranks (views of its arenas; on a
      GPU one host copy per layer), in the order they are taken: a receiver takes layer i's when it recomputes or
      backpropagates the layer and drops them after (one layer's at a time; a recomputed layer's rows travel
      twice); it attends to them with gradient sinks of their own, and sends those sinks (the gradient for the
      earlier rank's K/V) back to their owner once its layer i is done, where they are added into the state's
      gradient;
    - a recurrent layer's state gradient before a rank's first chunk goes to the rank that holds the chunk before.

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
        inputs: LayerInputs,
    ):
        self.engine, self.shards, self.state, self.grad, self.ids = engine, shards, state, grad, ids
        self.loss_fn, self.inputs = loss_fn, inputs
        self.owners, self.mine, self.computing = _ownership(shards, [c.start for c in state.chunks])
        self.row_start = {owner: state.chunks[self.owners.index(owner)].start for owner in self.computing}
        self.lo = state.chunks[self.mine[0]].start if self.mine else 0
        if inputs.shard_size != shards.shard_size:
            raise ValueError(
                f"the context-parallel shards were re-cut between the capture (shard size {inputs.shard_size}) and its "
                f"reverse walk ({shards.shard_size}): walk a state under the cut it was captured with"
            )
        self.segment: dict[int, Tensor] = {}  # the current segment's layer inputs (recomputed from its first)
        # recurrent layers the segment recomputed: the state before each of this rank's chunks
        self.states_before: dict[int, list[tuple[Tensor, ...] | None]] = {}

    def run(self) -> None:
        engine = self.engine
        params = [p for p in engine.model.parameters() if p.requires_grad]
        had_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.float64)
        for p in params:
            if p.grad is not None:
                p.grad.div_(self.shards.size)  # the replicated part, summed back below
        self._post_rows()
        g = self._seed()
        for i in reversed(range(engine.num_layers)):
            layer_input = self._input(i) if self.mine else None  # (recomputed before waiting for the later ranks)
            if engine.adapter.layers[i].mixer.grows:
                self._add_row_grads(i)
                g = self._backward_growing(i, g, layer_input)
            else:
                g = self._backward_recurrent(i, g, layer_input)
            self.shards.flush("state_grad", keep=self.shards.size**2)  # a window of layers in flight
        if g is not None:  # into the embeddings of this rank's tokens
            with torch.enable_grad():
                h, _, _ = engine.adapter.embed(self.ids[self.lo : self.lo + g.shape[0]], self.lo)
                h.backward(g)
        self.shards.flush()
        self._sum_parameter_grads(params, had_grad)

    # --- messages ---------------------------------------------------------------------------------------------
    def _own_rows(self, i: int) -> list[tuple[int, Block]]:
        return self.state.positioned_blocks(i)

    def _post_rows(self) -> None:
        """Start sending this rank's rows of every growing layer to the later computing ranks, in the order they
        are received: per segment from the last, its recomputed layers ascending (``_input``), then every layer of
        it descending (the backward). A receiver holds one layer's rows at a time; the rows of a recomputed layer
        travel twice."""
        rank = self.shards.rank
        later = [dst for dst in self.computing if dst > rank]
        if not self.mine or not later:
            return
        every, layers = self.inputs.every, self.engine.num_layers
        staged: dict[int, list[Tensor]] = {}  # one host copy per layer, for every destination and both tags
        for first in reversed(range(0, layers, every)):
            top = min(first + every, layers) - 1
            order = [(i, _RECOMPUTE_ROWS_TAG) for i in range(first, top)]
            order += [(i, _ROWS_TAG) for i in range(top, first - 1, -1)]
            for i, tag in order:
                if not self.engine.adapter.layers[i].mixer.grows:
                    continue
                if i not in staged:
                    staged[i] = _staged(_joined_views([b for _, b in self._own_rows(i)]))
                for dst in later:
                    self.shards.send(staged[i], dst, tag + i, "rows")

    def _add_row_grads(self, i: int) -> None:
        """Add what the later ranks' queries sent back for this rank's rows of layer ``i`` into the state gradient."""
        if not self.mine:
            return
        for src in self.computing:
            if src <= self.shards.rank:
                continue
            received = self.shards.recv(src, _ROW_GRADS_TAG + i, self.engine.adapter.device)
            offset = 0
            for _, block in self._own_rows(i):
                for buffer, part in zip(self.grad.block_grads(block), received, strict=True):
                    buffer.add_(part[offset : offset + block.length])
                offset += block.length

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
        with torch.enable_grad():
            x = self.inputs.final.detach().requires_grad_(True)
            hidden = self.engine.adapter.final_norm(x)
            chunks = [self.state.chunks[j] for j in self.mine]
            losses = [
                self.loss_fn(hidden[self._rows(j)], c.start, c.end) for j, c in zip(self.mine, chunks, strict=True)
            ]
            found = [loss for loss in losses if loss is not None]
            if not found:
                return None
            torch.autograd.backward(found, [torch.ones_like(loss) for loss in found])
        return x.grad

    def _input(self, i: int) -> Tensor:
        """Layer ``i``'s input on this rank: kept by the capture at the first layer of each segment, the others
        recomputed forward from it, a segment at a time, when the walk enters the segment (from its top)."""
        if i not in self.segment:
            first = i - i % self.inputs.every
            h = self.inputs.hidden[first]
            for layer in range(first, i + 1):
                self.segment[layer] = h
                if layer < i:
                    h = self._forward_layer(layer, h)
        return self.segment.pop(i)

    def _receive_rows(self, i: int, tag: int) -> list[PastBlock]:
        """The earlier ranks' rows of layer ``i`` (``tag``: for its backward or its recomputation)."""
        received = []
        for src in self.computing:
            if src < self.shards.rank:
                rows = self.shards.recv(src, tag + i, self.engine.adapter.device)
                received.append(PastBlock(rows, None, self.row_start[src]))
        return received

    def _forward_layer(self, i: int, h: Tensor) -> Tensor:
        """Layer ``i`` over this rank's chunks without a graph (recomputing a segment's inputs)."""
        layer, out = self.engine.adapter.layers[i], torch.empty_like(h)
        carried = self.inputs.recurrent[i]
        befores: list[tuple[Tensor, ...] | None] = []
        earlier = self._receive_rows(i, _RECOMPUTE_ROWS_TAG) if layer.mixer.grows else []
        with torch.no_grad():
            for k, j in enumerate(self.mine):
                span = self._rows(j)
                if layer.mixer.grows:
                    own = self.engine._past_blocks(self.state.positioned_blocks(i, j), None, 0)
                    ctx = LayerContext(past=[*earlier, *own])
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
        remote = [
            PastBlock(b.tensors, tuple(_zeros_like_grad(t, self.grad) for t in b.tensors), b.start)
            for b in self._receive_rows(i, _ROWS_TAG)
        ]  # each with gradient sinks of its own, sent back to the owner
        g_in = torch.zeros_like(layer_input)
        for k in reversed(range(len(self.mine))):
            j = self.mine[k]
            chunk, span = self.state.chunks[j], self._rows(j)
            own = self.engine._past_blocks(self.state.positioned_blocks(i, j), self.grad, 0)
            block = chunk.blocks[i]
            upstream = self.grad.existing_block_grads(block) if block is not None else None
            with torch.enable_grad():
                x = layer_input[span].detach().requires_grad_(True)
                out, new = self._layer(i, j, x, LayerContext(past=[*remote, *own]), self.inputs.scratch[i][k])
                self._backpropagate(out, g, span, new, upstream)
            if x.grad is not None:
                g_in[span] = x.grad
        for past in remote:  # the earlier ranks' K/V gradient, to their owners
            assert past.grads is not None
            self.shards.send(past.grads, self.shards.owner(past.start), _ROW_GRADS_TAG + i, "state_grad")
        for _, block in self._own_rows(i):
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
        if self.mine[0] > 0:
            assert carry is not None  # a chunk after position 0 starts from a state
            self.shards.send(carry, self.owners[self.mine[0] - 1], _RECURRENT_GRAD_TAG + i, "state_grad")
        return g_in

    def _recurrent_grad_after_last(self, i: int) -> tuple[Tensor, ...] | None:
        last = self.mine[-1]
        if last + 1 < len(self.state.chunks):
            return self.shards.recv(self.owners[last + 1], _RECURRENT_GRAD_TAG + i, self.engine.adapter.device)
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
        """Every rank's parameter gradient summed over the ranks, in place, one flat all-reduce per dtype (models
        keep some parameters in fp32, e.g. routers); a parameter no rank gave a gradient keeps none (as in one
        process: an optimizer skips it)."""
        has = had_grad + torch.tensor([p.grad is not None for p in params], dtype=torch.float64)
        somewhere = self.shards.sum_(has, "param_grads").tolist()
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p, found in zip(params, somewhere, strict=True):
            if found:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                by_dtype.setdefault(p.grad.dtype, []).append(p)
        for group in by_dtype.values():
            grads = [p.grad for p in group if p.grad is not None]
            flat = self.shards.sum_(torch.cat([g.reshape(-1) for g in grads]), "param_grads")
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()


class _RecurrentWalk:
    """The recurrent states around each chunk of a backward walk: kept checkpoints, ``since``'s last state, or —
    between checkpoints — recomputed forward without a graph from the nearest one, a segment at a time (at most
    ``checkpoints - 1`` of them live at once)."""

    def __init__(self, engine: Engine, state: State, since: State | None, ids: Tensor, base: int, first: int):
        self.engine, self.state, self.since, self.ids, self.base, self.first = engine, state, since, ids, base, first
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
                contexts = self.engine._contexts(self.state, t, None, self.after(t - 1))
                ids = self.ids[chunk.start - self.base : chunk.end - self.base]
                _, new = self.engine._forward(ids, chunk.start, contexts)
            self.cache[t] = tuple(
                None if block is not None else RecurrentState.owning(entry)
                for entry, block in zip(new, chunk.blocks, strict=True)
            )

    def forget(self, m: int) -> None:
        self.cache.pop(m, None)
