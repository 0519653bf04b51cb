"""An extend computed chunk by chunk, every layer of a chunk before the next chunk: in one process, or replicated
on every context-parallel rank (each chunk stored by one rank, attention merging the ranks' partial results).
A capture under context parallelism runs sharded instead (``ShardedCapture``)."""

from __future__ import annotations

import torch
from torch import Tensor

from longstraw_agents.state import State

from .graphs import GraphBank
from .kit import ExecutionKit


class ChunkedExtend:
    """``ids`` after ``state`` in chunks of at most ``chunk`` tokens.

    reserve: extra positions each new arena keeps for later in-place appends (token-by-token decoding).
    want_logits: also the next-token logits after the last of ``ids``, from the same forward.
    keep: exact mode's bank of chunk graphs: the chunks are evaluated under autograd and the last ones that fit its
        budget keep their graphs, so the reverse walk need not recompute them."""

    def __init__(
        self,
        kit: ExecutionKit,
        state: State,
        ids: Tensor,
        chunk: int,
        reserve: int = 0,
        want_logits: bool = False,
        keep: GraphBank | None = None,
    ):
        self.kit, self.state, self.ids, self.chunk, self.reserve = kit, state, ids, chunk, reserve
        self.want_logits = want_logits
        self.keep = keep if keep is not None and keep.budget_bytes > 0 else None

    def run(self) -> tuple[State, Tensor | None]:
        """The child state, and the next-token logits ``[V]`` when asked for."""
        kit, ids, keep = self.kit, self.ids, self.keep
        pieces = kit.pieces(self.state, ids.shape[0], self.chunk)
        owned = sum(hi - lo for lo, hi, owner in pieces if kit.owns(owner))
        arenas = kit.arenas_for(self.state, owned, kit.reserve_share(self.reserve))
        # a kept chunk's graph reads the recurrent state before it: keep every one (the graph holds it anyway)
        current = self.state.with_checkpoints(1) if keep is not None else self.state
        last_logits = None
        for lo, hi, owner in pieces:
            piece = ids[lo:hi]
            logits_here = self.want_logits and hi == ids.shape[0]
            hidden: Tensor | None = None
            if keep is not None:
                with torch.enable_grad(), keep.measuring() as measured:
                    contexts = kit.contexts(current, len(current.chunks), keep.grad)
                    hidden, new = kit.forward(piece, current.num_tokens, contexts)
            else:
                with torch.no_grad():
                    contexts = kit.contexts(current, len(current.chunks), None)
                    if logits_here:
                        hidden, new = kit.forward(piece, current.num_tokens, contexts)
                    else:  # nothing reads this chunk's hidden states
                        new = kit.state_entries(piece, current.num_tokens, contexts)
            with torch.no_grad():
                record = kit.record(current.num_tokens, piece.shape[0], new, arenas, owner)
                current = current.append(record)
                if logits_here and hidden is not None:
                    last_logits = kit.adapter.lm_head(hidden[-1:])[0]
            if keep is not None and hidden is not None:
                keep.add(record, new, hidden, measured.current_bytes)
        return current.with_checkpoints(self.state.checkpoints), last_logits
