"""``Engine``: capture / extend / logits / backward over a model's own state objects, and the layer-context helpers
the engine's schedules share (public within the package: ``reverse_walk``, ``sharded_capture``, ``wavefront``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from longstraw_agents.attention import Attention
from longstraw_agents.models import FamilyAdapter, adapter_for
from longstraw_agents.models.base import LayerContext, PastBlock
from longstraw_agents.state import Arena, Block, ChunkRecord, RecurrentState, State, StateGrad, leaf_into
from longstraw_agents.token_ids import as_token_ids

from .config import EngineConfig, checkpoint_spacing, layer_inputs_spacing
from .graphs import GraphBank
from .reverse_walk import ReverseWalk
from .sharded_capture import ShardedCapture
from .shards import StateShards, Transport
from .wavefront import LayerInputs, WavefrontWalk
from .weights import ExpertRounds, LayerWeights

# loss_fn(hidden [n, hidden], start, end) -> scalar loss for the tokens at positions [start, end), or None; it gets
# the final-normed hidden states, not logits, so that it can apply the LM head in tiles (longstraw_agents.logprobs)
ChunkLoss = Callable[[Tensor, int, int], Tensor | None]


@dataclass(frozen=True)
class Backward:
    """What ``Engine.backward`` did. ``sharded``: the walk ran over context-parallel ranks, each walking (and
    evaluating ``loss_fn`` on) its own chunks only; ``total`` then turns what ``loss_fn`` accumulated on this rank
    into the whole walk's."""

    sharded: bool = False
    transport: Transport | None = None

    def total(self, values: Tensor) -> Tensor:
        """``values`` accumulated by ``loss_fn`` during the walk (a tensor of sums), as the whole walk's: summed over
        the ranks when each evaluated its own chunks, unchanged otherwise (every rank evaluated every chunk)."""
        if not self.sharded or self.transport is None:
            return values
        return self.transport.sum_(values.clone(), "metrics")


class Engine:
    """capture / extend / logits over a model's own state objects (never a transformers cache).

    shards: context parallelism (``longstraw_agents.parallel``): this rank stores the state of its share of each
    path's positions only (``Ownership``; every chunk records its owner), and every rank of the group must make the
    same calls in the same order.
    weights: parameters sharded over the ranks (``LayerWeights``, FSDP2): each layer's weights are gathered only
    around the work that uses them (and ``bind`` may take over parts of the layers: expert parallelism's MoE). A
    capture (an extend at least as long as its parent, or than ``EngineConfig.sharded_extend_tokens``) and exact
    mode's walk back over it are computed shard by shard, layer by layer, in a wavefront across the ranks
    (``ShardedCapture``, ``WavefrontWalk``) — unless ``EngineConfig.sharded_extends`` is off (under expert
    parallelism a sharded extend's MoE calls are rounds of all-to-alls, and exact mode walks replicated); shorter
    extends and branch replays are replicated, attention combining the ranks' partial
    results. Results equal one process's."""

    def __init__(
        self,
        model: nn.Module,
        config: EngineConfig | None = None,
        *,
        chunk_size: int | None = None,
        shards: StateShards | None = None,
        weights: LayerWeights | None = None,
    ):
        self.model = model
        self.adapter: FamilyAdapter = adapter_for(model)
        config = config or EngineConfig()
        if chunk_size is not None:
            config = config.updated(chunk_size=chunk_size)
        self.config = config
        self.shards = shards
        self.weights = weights
        if weights is not None:
            if weights.lockstep and weights.rounds is None and shards is not None and config.sharded_extends:
                raise ValueError(
                    "the weights' sharding needs every rank to make the same layer calls, so no extend may be "
                    "sharded: EngineConfig(sharded_extends=False)"
                )
            weights.bind(self.adapter.layers)
        transport = shards.transport if shards is not None else None
        # a state block's dK/dV are computed a chunk of positions at a time: the transient stays below a chunk's graph
        budget, exact = config.max_score_elements, config.exact_products
        self.attention = Attention(config.attention, budget, config.chunk_size, transport, exact_products=exact)
        self.local_attention = Attention(config.attention, budget, config.chunk_size, exact_products=exact)

    def gathered(self, layer: int | None, partial: bool = False, reduce: bool = True) -> AbstractContextManager[None]:
        """Layer ``layer``'s weights whole for a block (``LayerWeights.gathered``; nothing to do unsharded)."""
        if self.weights is None:
            return contextlib.nullcontext()
        return self.weights.gathered(layer, partial, reduce)

    def reduce(self, layer: int) -> None:
        """``LayerWeights.reduce`` (nothing to do unsharded)."""
        if self.weights is not None:
            self.weights.reduce(layer)

    def announce(self, layers: Sequence[int], ahead: int | None = None) -> None:
        """The order of the coming ``gathered`` blocks (``LayerWeights.announce``; nothing to do unsharded)."""
        if self.weights is not None:
            self.weights.announce(layers, ahead)

    @property
    def rounds(self) -> ExpertRounds | None:
        """Under expert parallelism, a sharded extend's MoE calls as rounds (``LayerWeights.rounds``)."""
        return self.weights.rounds if self.weights is not None else None

    def start_gather(self) -> None:
        """``LayerWeights.start_next`` (nothing to do unsharded)."""
        if self.weights is not None:
            self.weights.start_next()

    def settle(self) -> None:
        """``LayerWeights.settle`` (nothing to do unsharded)."""
        if self.weights is not None:
            self.weights.settle()

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
        contexts = self.contexts(state, len(state.chunks), grad)
        hidden, _ = self.forward(ids, state.num_tokens, contexts)
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
    ) -> Backward:
        """Backpropagate ``grad`` (and ``loss_fn``'s loss) through the chunks of ``state`` after ``since``.

        ``ids`` are the tokens of those chunks (the engine keeps no token ids). Chunks are recomputed in reverse
        under autograd; parameter gradients accumulate in ``.grad``, the gradients for earlier chunks in ``grad``,
        and — unless ``into_since`` is False (detached mode's long branches) — those for ``since``'s tensors too.
        Recurrent states the state does not keep (between checkpoints) are recomputed forward, without a graph,
        from the nearest checkpoint. Chunks whose graphs ``kept`` holds are not recomputed. Peak: state + grad +
        one chunk graph (+ up to k-1 recurrent states, + the kept graphs).

        A sharded extend made under context parallelism with its layer inputs (``EngineConfig.wavefront_walk``: a
        capture, or a long extend of ``since``) is walked sharded: each rank walks its own chunks
        (``Backward.sharded``).
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
        inputs = state.layer_inputs
        if self.shards is not None and isinstance(inputs, LayerInputs) and inputs.base == base:
            WavefrontWalk(self, self.shards, state, grad, ids, loss_fn, since, into_since).run()
            return Backward(sharded=True, transport=self.shards.transport)
        ReverseWalk(self, state, grad, ids, since, first, loss_fn, into_since, kept).run()
        return Backward()

    # --- what the schedules share -----------------------------------------------------------------------------
    def forward(self, ids: Tensor, start: int, contexts: list[LayerContext]) -> tuple[Tensor, list[tuple[Tensor, ...]]]:
        """Every layer over ``ids`` at positions from ``start``, reading ``contexts``: the final-normed hidden states
        and each layer's new state entries."""
        return self.adapter.forward(
            ids,
            start,
            contexts,
            attention=self.attention,
            checkpoint_layers=self.config.activation_checkpointing,
            runner=self.weights.run if self.weights is not None else None,
        )

    def state_entries(self, ids: Tensor, start: int, contexts: list[LayerContext]) -> list[tuple[Tensor, ...]]:
        """``forward``'s state entries without its hidden states (no grad: a capture, a recomputed chunk)."""
        runner = self.weights.run if self.weights is not None else None
        return self.adapter.state_entries(ids, start, contexts, attention=self.attention, runner=runner)

    def contexts(
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
                contexts.append(LayerContext(past=self.past_blocks(blocks, grad, frozen_before)))
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
    def past_blocks(blocks: list[tuple[int, Block]], grad: StateGrad | None, frozen_before: int = 0) -> list[PastBlock]:
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

    def arenas_for(self, state: State, n: int, reserve: int) -> list[Arena | None]:
        """Per growing layer, the arena to append ``n`` positions to: the last one in place, or a new one with room
        for ``reserve`` more (none when this rank stores nothing of them: no block would hold on to its room)."""
        arenas: list[Arena | None] = []
        for i, layer in enumerate(self.adapter.layers):
            if not layer.mixer.grows or n == 0:
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

    def pieces(
        self, state: State, n: int, chunk: int, sharded: bool = False, balanced: bool = True
    ) -> list[tuple[int, int, int]]:
        """``(lo, hi, owner)``: offsets of the chunks of ``n`` tokens after ``state`` (at most ``chunk`` long) and the
        rank that will store each (context parallelism; 0 without). ``sharded``: a sharded extend's cut
        (``Ownership.cut``, ``balanced`` or in rank order); otherwise each chunk goes to the rank holding the least
        of the path (``Ownership.assign``)."""
        runs = [(0, n, 0)] if self.shards is None or not sharded else self.shards.ownership.cut(n, balanced)
        pieces = [(lo, min(lo + chunk, hi), owner) for a, hi, owner in runs for lo in range(a, hi, chunk)]
        if self.shards is not None and not sharded:
            ownership = self.shards.ownership
            owners = ownership.assign(state.positions_held(ownership.size), [hi - lo for lo, hi, _ in pieces])
            pieces = [(lo, hi, owner) for (lo, hi, _), owner in zip(pieces, owners, strict=True)]
        return pieces

    def reserve_share(self, reserve: int) -> int:
        """The room each rank reserves for ``reserve`` later positions: they spread over the ranks too."""
        return reserve if self.shards is None else -(-reserve // self.shards.ownership.size)

    def sharded(self, state: State, n: int) -> bool:
        """Whether an extend of ``n`` tokens after ``state`` runs sharded (``ShardedCapture``): with context
        parallelism, when it is at least as long as the state (a capture: moving the earlier rows costs no more than
        computing the new ones replicated) or than ``EngineConfig.sharded_extend_tokens``; never without
        ``EngineConfig.sharded_extends``."""
        least = self.config.sharded_extend_tokens
        if self.shards is None or not self.config.sharded_extends or n == 0:
            return False
        return n >= state.num_tokens or (least is not None and n >= least)

    def owns(self, owner: int) -> bool:
        """Whether this rank stores the state of chunks of ``owner`` (always, without context parallelism)."""
        return self.shards is None or owner == self.shards.ownership.rank

    def record(
        self, start: int, n: int, new: list[tuple[Tensor, ...]], arenas: list[Arena | None], owner: int
    ) -> ChunkRecord:
        """The chunk's record: growing layers' entries appended to their arenas — on its ``owner`` (context
        parallelism: elsewhere the chunk has no block) — and recurrent layers' new states."""
        store = self.owns(owner)
        blocks: list[Block | None] = []
        recurrent: list[RecurrentState | None] = []
        for entry, arena, layer in zip(new, arenas, self.adapter.layers, strict=True):
            if layer.mixer.grows:
                blocks.append(arena.append(entry) if store and arena is not None else None)
                recurrent.append(None)
            else:
                blocks.append(None)
                recurrent.append(RecurrentState.owning(entry))
        return ChunkRecord(start, n, tuple(blocks), tuple(recurrent), owner=owner)

    # --- internals ------------------------------------------------------------------------------------------
    def _check_ids(self, ids: Tensor | Sequence[int], allow_empty: bool = False) -> Tensor:
        ids = as_token_ids(ids, allow_empty=allow_empty, vocab_size=self.adapter.vocab_size)
        return ids.to(device=self.adapter.device)

    def _check_state(self, state: State) -> None:
        if not isinstance(state, State):
            raise TypeError(f"expected a State from Engine.capture/extend, got {type(state).__name__}")
        if state.owner != id(self.model) or state.num_layers != self.num_layers:
            raise ValueError("this state was made by an engine over a different model")

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
        if not keeping and not want_logits and self.sharded(state, ids.shape[0]):
            # a long extend (a capture): each rank computes its own shard, layer by layer (see ShardedCapture)
            assert self.shards is not None  # (only context parallelism shards an extend)
            return ShardedCapture(self, self.shards, state, ids, chunk).run(reserve), None
        pieces = self.pieces(state, ids.shape[0], chunk)
        owned = sum(hi - lo for lo, hi, owner in pieces if self.owns(owner))
        arenas = self.arenas_for(state, owned, self.reserve_share(reserve))
        # a kept chunk's graph reads the recurrent state before it: keep every one (the graph holds it anyway)
        current = state.with_checkpoints(1) if keeping else state
        last_logits = None
        for lo, hi, owner in pieces:
            piece = ids[lo:hi]
            logits_here = want_logits and hi == ids.shape[0]
            hidden: Tensor | None = None
            if keeping and keep is not None:
                with torch.enable_grad(), keep.measuring() as measured:
                    contexts = self.contexts(current, len(current.chunks), keep.grad)
                    hidden, new = self.forward(piece, current.num_tokens, contexts)
            else:
                with torch.no_grad():
                    contexts = self.contexts(current, len(current.chunks), None)
                    if logits_here:
                        hidden, new = self.forward(piece, current.num_tokens, contexts)
                    else:  # nothing reads this chunk's hidden states
                        new = self.state_entries(piece, current.num_tokens, contexts)
            with torch.no_grad():
                record = self.record(current.num_tokens, piece.shape[0], new, arenas, owner)
                current = current.append(record)
                if logits_here and hidden is not None:
                    last_logits = self.adapter.lm_head(hidden[-1:])[0]
            if keeping and keep is not None and hidden is not None:
                keep.add(record, new, hidden, measured.current_bytes)
        return current.with_checkpoints(state.checkpoints), last_logits
