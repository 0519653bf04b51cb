"""The gated delta rule's terms per block: what ``models.delta_rule.block_terms`` computes with batched torch ops and
the scan across blocks takes, in pure torch (``models.delta_rule.torch_scan``) or in Triton
(``kernels.delta_scan``). Here, below both, so that neither imports the other; and free of Triton, which the
pure-torch path runs without."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

# The Triton scan's tiling (``kernels.delta_scan``). Columns of D_v per program: a [D_k, 32] slice of the state (and
# of its gradient) fits a program's registers for D_k up to 128 (Qwen3.6's head size) without spilling, and
# 16 heads x 4 column blocks keep the SMs busy. tl.dot takes no dimension under 16: smaller blocks are padded
# (masked) up to it.
BLOCK_V = 32
MIN_DOT = 16


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


def tile(n: int) -> int:
    """A dimension's tile in the Triton scan: the next power of two, at least ``MIN_DOT``."""
    return max(MIN_DOT, 1 << max(n - 1, 0).bit_length())


def column_blocks(dv: int) -> int:
    """How many blocks of ``D_v`` columns the Triton scan splits a head's state into (one program each): the
    gradients that sum over ``D_v`` come one per column block."""
    width = min(tile(dv), BLOCK_V)
    return -(-dv // width)


class ForwardBuffers(NamedTuple):
    out: Tensor  # [H, N, C, D_v]
    final: Tensor  # [H, D_k, D_v]
    states: Tensor | None  # the state before each block [H, N, D_k, D_v], with ``save_states``


class BackwardBuffers(NamedTuple):
    """The backward's gradients, those that sum over ``D_v`` one per column block (summed by ``grads``)."""

    d_w: Tensor  # [P, H, N, C, D_k]
    d_u: Tensor
    d_q: Tensor
    d_a: Tensor  # [P, H, N, C, C]
    d_k: Tensor
    d_decay: Tensor  # [P, H, N]
    d_initial: Tensor  # [H, D_k, D_v]

    def grads(self) -> BlockTerms:
        return BlockTerms(
            self.d_w.sum(0), self.d_u, self.d_q.sum(0), self.d_a.sum(0), self.d_k.sum(0), self.d_decay.sum(0)
        )


def forward_buffers(terms: BlockTerms, save_states: bool) -> ForwardBuffers:
    """What the Triton scan's forward writes. Made here, below the kernels, so that the planner's meta scan
    (``models.delta_rule.MetaScan``) allocates exactly what a GPU does without Triton."""
    heads, blocks, size, dk, dv = terms.shape
    out, final = terms.u.new_empty(heads, blocks, size, dv), terms.u.new_empty(heads, dk, dv)
    return ForwardBuffers(out, final, terms.u.new_empty(heads, blocks, dk, dv) if save_states else None)


def backward_buffers(terms: BlockTerms) -> BackwardBuffers:
    """What the Triton scan's backward writes (see ``forward_buffers``)."""
    heads, blocks, size, dk, dv = terms.shape
    parts = column_blocks(dv)
    d_u, d_initial = torch.empty_like(terms.u), terms.u.new_empty(heads, dk, dv)
    d_w, d_q, d_k = (terms.w.new_empty(parts, heads, blocks, size, dk) for _ in range(3))
    d_a = terms.a.new_empty(parts, heads, blocks, size, size)
    d_decay = terms.decay.new_empty(parts, heads, blocks)
    return BackwardBuffers(d_w, d_u, d_q, d_a, d_k, d_decay, d_initial)
