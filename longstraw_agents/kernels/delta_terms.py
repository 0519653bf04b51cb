"""The gated delta rule's terms per block: what ``models.delta_rule.block_terms`` computes with batched torch ops and
the scan across blocks takes, in pure torch (``models.delta_rule.torch_scan``) or in Triton
(``kernels.delta_scan``). Here, below both, so that neither imports the other; and free of Triton, which the
pure-torch path runs without."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class BlockTerms(NamedTuple):
    """A sequence's terms per (flattened) head and block of ``C`` positions, which the scan across blocks takes:
    ``w`` (the keys, decayed to the block's start and passed through its UT transform), ``q`` (the queries decayed
    from the block's start), ``k`` (the keys decayed to the block's end) ``[H, N, C, D_k]``; ``u`` (the values
    through the UT transform) ``[H, N, C, D_v]``; ``a`` (the queries' decayed scores against the block's keys, lower
    triangular) ``[H, N, C, C]``; ``decay`` (the block's whole decay) ``[H, N]``."""

    w: Tensor
    u: Tensor
    q: Tensor
    a: Tensor
    k: Tensor
    decay: Tensor

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        heads, blocks, size, dk = self.w.shape
        return heads, blocks, size, dk, self.u.shape[-1]
