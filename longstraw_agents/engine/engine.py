"""``Engine``: capture / extend / logits / backward over a model's own state objects — the public front. It picks
the schedule each call runs (``ChunkedExtend`` or ``ShardedCapture``; ``ReverseWalk`` or ``WavefrontWalk``) and hands
it the execution kit they all run layers with (``ExecutionKit``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from longstraw_agents.attention import Attention
from longstraw_agents.models import FamilyAdapter
from longstraw_agents.state import State, StateGrad
from longstraw_agents.token_ids import as_token_ids

from .chunked_extend import ChunkedExtend
from .config import EngineConfig
from .graphs import GraphBank
from .kit import ChunkLoss, ExecutionKit
from .reverse_walk import ReverseWalk
from .schedule import shards_extend
from .sharded_capture import ShardedCapture
from .shards import StateShards, Transport
from .wavefront import WavefrontWalk
from .weights import LayerWeights


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
        config = config or EngineConfig()
        if chunk_size is not None:
            config = config.updated(chunk_size=chunk_size)
        self.kit = ExecutionKit(model, config, shards, weights)

    @property
    def model(self) -> nn.Module:
        return self.kit.model

    @property
    def adapter(self) -> FamilyAdapter:
        return self.kit.adapter

    @property
    def config(self) -> EngineConfig:
        return self.kit.config

    @property
    def shards(self) -> StateShards | None:
        return self.kit.shards

    @property
    def weights(self) -> LayerWeights | None:
        return self.kit.weights

    @property
    def attention(self) -> Attention:
        """The attention ops the layers run with (merging the ranks' partial results under context parallelism)."""
        return self.kit.attention

    @property
    def family(self) -> str:
        return self.adapter.family

    @property
    def num_layers(self) -> int:
        return self.kit.num_layers

    @property
    def checkpoint_spacing(self) -> int:
        """k: exact-mode states keep the recurrent state after every k-th chunk (see ``EngineConfig``)."""
        return self.kit.checkpoint_spacing

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
        contexts = self.kit.contexts(state, len(state.chunks), grad)
        hidden, _ = self.kit.forward(ids, state.num_tokens, contexts)
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
        if self.shards is not None and inputs is not None and inputs.base == base:
            WavefrontWalk(self.kit, self.shards, state, grad, ids, loss_fn, since, into_since).run()
            return Backward(sharded=True, transport=self.shards.transport)
        ReverseWalk(self.kit, state, grad, ids, since, first, loss_fn, into_since, kept).run()
        return Backward()

    # --- which schedule an extend runs ---------------------------------------------------------------------
    def sharded(self, state: State, n: int) -> bool:
        """Whether an extend of ``n`` tokens after ``state`` runs sharded (``ShardedCapture``): with context
        parallelism, when it is at least as long as the state (a capture: moving the earlier rows costs no more than
        computing the new ones replicated) or than ``EngineConfig.sharded_extend_tokens``; never without
        ``EngineConfig.sharded_extends``."""
        if self.shards is None or not self.config.sharded_extends:
            return False
        return shards_extend(n, state.num_tokens, self.config.sharded_extend_tokens)

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
            return ShardedCapture(self.kit, self.shards, state, ids, chunk).run(reserve), None
        return ChunkedExtend(self.kit, state, ids, chunk, reserve, want_logits, keep).run()
