"""Parameters sharded over ranks as the engine sees them: a protocol, implemented by
``longstraw_agents.parallel.fsdp.LayerGather`` (FSDP2 units the engine gathers itself, since it never calls a
module's forward, where FSDP2's own hooks would).

The engine gathers a decoder layer's weights only around the work that uses them — layer by layer in a sharded
capture and the wavefront walk (``gathered``), around each layer's forward elsewhere (``run``, whose backward gathers
them again) — so no rank holds the whole model. The root unit (embeddings, final norm, LM head) is the caller's to
gather for a block (the trainer's step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from torch import Tensor, nn

from longstraw_agents.models.base import DecoderLayer


class ExpertRounds(Protocol):
    """Under expert parallelism, a sharded extend's MoE calls (each rank its own tokens) as rounds every rank takes
    part in, each sending its tokens to the ranks holding their experts and serving the others'
    (``parallel.experts.ExpertExchange``). The engine makes as many rounds on every rank at each wavefront step:
    ``idle`` ones where a rank has fewer calls."""

    calls: int  # rounds with this rank's tokens so far

    @property
    def routed(self) -> frozenset[int]:
        """The layers whose MoE calls are rounds."""
        ...

    def bind(self, layers: Sequence[DecoderLayer]) -> None:
        """Take over each MoE layer's routed experts (``MoE.routed``)."""
        ...

    def dispatching(self) -> AbstractContextManager[None]:
        """MoE calls as rounds for the block (no gradient)."""
        ...

    def idle(self, like: Tensor) -> None:
        """A round without tokens of this rank's (``like``: hidden states, for their width, dtype and device)."""
        ...


class LayerWeights(Protocol):
    """A decoder layer's weights whole only while used; its gradient reduced into the shards when its backward is
    done. Every rank of the shard mesh makes the same calls in the same order."""

    def gathered(self, layer: int | None, partial: bool = False, reduce: bool = True) -> AbstractContextManager[None]:
        """Layer ``layer``'s weights (None: the root unit's) whole for the block; on leaving the outermost block of
        the layer, the gradient accumulated reduced into the shards. ``partial``: each rank's gradient is its share
        of a sum (the wavefront walk), not a copy of a replicated one. ``reduce=False``: the gradient is kept for a
        later ``reduce``."""
        ...

    def reduce(self, layer: int) -> None:
        """The gradient layer ``layer``'s blocks left with ``reduce=False`` accumulated, each rank's share of a sum,
        reduced into the shards (every rank calls it, in one order)."""
        ...

    def announce(self, layers: Sequence[int], ahead: int | None = None) -> None:
        """The layers the next gathers will be, in order (the same on every rank), so that they are started ahead:
        in a wavefront the ranks reach a layer at different times, and a gather waits for all of them. ``ahead``:
        how many this rank starts ahead (as many wavefront steps as it trails the first rank to reach a layer; by
        default the sharding's own window, enough for any rank)."""
        ...

    def start_next(self) -> None:
        """Start the next announced gather now (a schedule that paces its own: ``announce(..., ahead=0)``)."""
        ...

    def settle(self) -> None:
        """End a stretch of ``partial`` blocks: their reductions done (every rank calls it)."""
        ...

    @property
    def lockstep(self) -> bool:
        """Whether every rank must make the same layer calls in the same order (expert parallelism: each MoE call
        is a collective): a sharded extend then runs its MoE calls as ``rounds``."""
        ...

    @property
    def rounds(self) -> ExpertRounds | None:
        """Under expert parallelism, the MoE calls of a sharded extend as rounds."""
        ...

    def bind(self, layers: Sequence[DecoderLayer]) -> None:
        """Called once by the engine with its adapter's layers: the sharding may take over parts of them (expert
        parallelism: each MoE's routed experts, ``MoE.routed``)."""
        ...

    def root_parameters(self) -> list[nn.Parameter]:
        """The parameters outside the decoder layers (embeddings, final norm, LM head), as registered now."""
        ...

    def run(self, layer: int, fn: Callable[[Tensor], Any], h: Tensor) -> Any:
        """``fn(h)``, layer ``layer``'s forward, with its weights whole; under autograd its backward, whenever it runs,
        gathers them again and reduces the gradient when it is done."""
        ...
