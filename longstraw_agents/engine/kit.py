"""The execution kit: what every schedule of the engine runs layers with — a model's adapter, its attention ops,
the weights' gathers (FSDP2) and the chunk bookkeeping of context parallelism — and the layer-context helpers the
schedules share (``ChunkedExtend``, ``ShardedCapture``, ``ReverseWalk``, ``WavefrontWalk``, ``Decoder``).

It depends on no schedule: the schedules take a kit, and ``Engine`` (the public front) builds one and picks the
schedule a call runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

from torch import Tensor, nn

from longstraw_agents.attention import Attention
from longstraw_agents.models import FamilyAdapter, adapter_for
from longstraw_agents.models.base import LayerContext, PastBlock
from longstraw_agents.state import Arena, Block, ChunkRecord, RecurrentState, State, StateGrad, leaf_into

from .config import EngineConfig, checkpoint_spacing, layer_inputs_spacing
from .shards import StateShards
from .weights import ExpertRounds, LayerWeights

# loss_fn(hidden [n, hidden], start, end) -> scalar loss for the tokens at positions [start, end), or None; it gets
# the final-normed hidden states, not logits, so that it can apply the LM head in tiles (longstraw_agents.logprobs)
ChunkLoss = Callable[[Tensor, int, int], Tensor | None]


class ExecutionKit:
    """A model's layers as the engine's schedules run them, over its own state objects.

    shards: context parallelism (``Engine``'s): this rank stores the state of its share of each path's positions.
    weights: parameters sharded over the ranks (``LayerWeights``, FSDP2), gathered around the work that uses them;
    bound to the model's layers here (``bind`` may take over parts of them: expert parallelism's MoE)."""

    def __init__(
        self,
        model: nn.Module,
        config: EngineConfig,
        shards: StateShards | None = None,
        weights: LayerWeights | None = None,
    ):
        self.model = model
        self.adapter: FamilyAdapter = adapter_for(model)
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

    # --- the weights' gathers (nothing to do unsharded) -----------------------------------------------------------
    def gathered(self, layer: int | None, partial: bool = False, reduce: bool = True) -> AbstractContextManager[None]:
        """Layer ``layer``'s weights whole for a block (``LayerWeights.gathered``)."""
        if self.weights is None:
            return contextlib.nullcontext()
        return self.weights.gathered(layer, partial, reduce)

    def reduce(self, layer: int) -> None:
        """``LayerWeights.reduce``."""
        if self.weights is not None:
            self.weights.reduce(layer)

    def announce(self, layers: Sequence[int], ahead: int | None = None) -> None:
        """The order of the coming ``gathered`` blocks (``LayerWeights.announce``)."""
        if self.weights is not None:
            self.weights.announce(layers, ahead)

    @property
    def rounds(self) -> ExpertRounds | None:
        """Under expert parallelism, a sharded extend's MoE calls as rounds (``LayerWeights.rounds``)."""
        return self.weights.rounds if self.weights is not None else None

    def start_gather(self) -> None:
        """``LayerWeights.start_next``."""
        if self.weights is not None:
            self.weights.start_next()

    def settle(self) -> None:
        """``LayerWeights.settle``."""
        if self.weights is not None:
            self.weights.settle()

    # --- sizes --------------------------------------------------------------------------------------------------
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

    # --- layers over states ---------------------------------------------------------------------------------------
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
                contexts.append(LayerContext(past=past_blocks(blocks, grad, frozen_before)))
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

    # --- chunks and who stores them ---------------------------------------------------------------------------
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
