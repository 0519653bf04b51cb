"""The gated delta rule's scan across blocks as two Triton kernels (forward and backward), one launch each.

The chunked delta rule (``models/delta_rule.py``) computes every block's terms at once with batched torch ops; what
is left is a scan over the blocks of a sequence, per head, through the ``[D_k, D_v]`` state ``S``:

    V_c = U_c - W_c S_c                       (the block's values, corrected by what the state already predicts)
    O_c = Q_c S_c + A_c V_c                   (its outputs: the state read, plus attention within the block)
    S_{c+1} = d_c S_c + K_c^T V_c             (decay, then write)

In pure torch that is a Python loop of small matmuls, several kernel launches per block and layer: at 4,096-token
chunks, 64 blocks of 64 positions, launch overhead dominated the hybrid family's GPU time. Here one program per
(head, block of ``D_v`` columns) walks all blocks with its slice of the state in registers. The columns of ``D_v``
are independent in the forward; in the backward, the gradients that sum over them (``dQ``, ``dK``, ``dW``, ``dA``,
``dd``) are written per column block and summed by the caller.

The backward recomputes the states block by block (a forward with ``save_states``) rather than keeping them from the
forward: a chunk's graph then holds only the block terms, as the pure-torch scan's does. Products run in full
precision (``input_precision="ieee"``: no TF32), so the kernel equals the pure-torch scan up to summation order; in
fp64 (Triton's interpreter on CPU, the suite's check) to rounding.

Backward, walking the blocks in reverse with ``dS = dS_{c+1}`` (the gradient of the state after block ``c``):

    dV_c = A_c^T dO_c + K_c dS                dU_c = dV_c         dW_c = -dV_c S_c^T
    dA_c = dO_c V_c^T     dQ_c = dO_c S_c^T   dK_c = V_c dS^T     dd_c = sum(S_c * dS)
    dS_c = d_c dS + Q_c^T dO_c - W_c^T dV_c
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from longstraw_agents.kernels.delta_terms import (
    BLOCK_V,
    BlockTerms,
    backward_buffers,
    column_blocks,
    forward_buffers,
    tile,
)


def _sizes(terms: BlockTerms) -> dict[str, Any]:
    heads, blocks, size, dk, dv = terms.shape
    return {
        "N": blocks, "C": size, "DK": dk, "DV": dv,
        "BC": tile(size), "BK": tile(dk), "BV": min(tile(dv), BLOCK_V),
    }  # fmt: skip


def _grid(terms: BlockTerms) -> tuple[int, int]:
    return terms.shape[0], column_blocks(terms.shape[-1])


def _warps(sizes: dict[str, Any]) -> int:
    """8 warps where a block's key tiles are large ([64, 128]: three of them live at once), so that a thread's share
    stays in registers; 4 otherwise."""
    return 8 if sizes["BC"] * sizes["BK"] >= 64 * 128 else 4


def scan_forward(
    terms: BlockTerms, initial: Tensor | None, *, save_states: bool = False
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Outputs ``[H, N, C, D_v]``, the final state ``[H, D_k, D_v]`` and, with ``save_states``, the state before
    each block ``[H, N, D_k, D_v]``."""
    out, final, states = forward_buffers(terms, save_states)
    sizes = _sizes(terms)
    _scan_forward_kernel[_grid(terms)](
        terms.w, terms.u, terms.q, terms.a, terms.k, terms.decay,
        final if initial is None else initial.contiguous(), out, final,
        final if states is None else states,  # (unused without save_states)
        HAS_INITIAL=initial is not None, SAVE_STATES=save_states, num_warps=_warps(sizes), **sizes,
    )  # fmt: skip
    return out, final, states


def scan_backward(
    terms: BlockTerms, initial: Tensor | None, d_out: Tensor, d_final: Tensor | None
) -> tuple[BlockTerms, Tensor]:
    """The gradients of ``terms`` and of the initial state, given those of the outputs and the final state."""
    _, _, states = scan_forward(terms, initial, save_states=True)
    assert states is not None
    sizes = _sizes(terms)
    d = backward_buffers(terms)
    _scan_backward_kernel[_grid(terms)](
        terms.w, terms.u, terms.q, terms.a, terms.k, terms.decay, states, d_out.contiguous(),
        d.d_initial if d_final is None else d_final.contiguous(),
        d.d_initial, d.d_w, d.d_u, d.d_q, d.d_a, d.d_k, d.d_decay, terms.shape[0],
        HAS_D_FINAL=d_final is not None, num_warps=_warps(sizes), **sizes,
    )  # fmt: skip
    return d.grads(), d.d_initial


class TritonScan(torch.autograd.Function):
    """The scan as one autograd node: ``apply(w, u, q, a, k, decay, initial)`` -> ``(out, final)``."""

    @staticmethod
    def forward(ctx: Any, *inputs: Tensor | None) -> tuple[Tensor, Tensor]:
        *parts, initial = inputs
        terms = BlockTerms(*(t.contiguous() for t in parts))  # type: ignore[union-attr]
        out, final, _ = scan_forward(terms, initial)
        ctx.save_for_backward(*terms, initial)
        return out, final

    @staticmethod
    def backward(ctx: Any, d_out: Tensor, d_final: Tensor | None) -> tuple[Tensor | None, ...]:
        *parts, initial = ctx.saved_tensors
        grads, d_initial = scan_backward(BlockTerms(*parts), initial, d_out, d_final)
        return (*grads, d_initial if initial is not None else None)


@triton.jit
def _scan_forward_kernel(
    W, U, Q, A, K, DECAY, INITIAL, OUT, FINAL, STATES,
    N, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_INITIAL: tl.constexpr, SAVE_STATES: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0).to(tl.int64)
    rc = tl.arange(0, BC)
    rk = tl.arange(0, BK)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    mc, mk, mv = rc < C, rk < DK, rv < DV
    state_at = rk[:, None] * DV + rv[None, :]
    state_mask = mk[:, None] & mv[None, :]
    if HAS_INITIAL:
        s = tl.load(INITIAL + h * DK * DV + state_at, mask=state_mask, other=0.0)
    else:
        s = tl.zeros([BK, BV], dtype=U.dtype.element_ty)
    for c in tl.range(0, N):
        row = (h * N + c) * C + rc
        w = tl.load(W + row[:, None] * DK + rk[None, :], mask=mc[:, None] & mk[None, :], other=0.0)
        q = tl.load(Q + row[:, None] * DK + rk[None, :], mask=mc[:, None] & mk[None, :], other=0.0)
        k = tl.load(K + row[:, None] * DK + rk[None, :], mask=mc[:, None] & mk[None, :], other=0.0)
        u = tl.load(U + row[:, None] * DV + rv[None, :], mask=mc[:, None] & mv[None, :], other=0.0)
        a = tl.load(A + row[:, None] * C + rc[None, :], mask=mc[:, None] & mc[None, :], other=0.0)
        decay = tl.load(DECAY + h * N + c)
        if SAVE_STATES:
            tl.store(STATES + (h * N + c) * DK * DV + state_at, s, mask=state_mask)
        v = u - tl.dot(w, s, input_precision="ieee")
        o = tl.dot(q, s, input_precision="ieee") + tl.dot(a, v, input_precision="ieee")
        tl.store(OUT + row[:, None] * DV + rv[None, :], o, mask=mc[:, None] & mv[None, :])
        s = s * decay + tl.dot(tl.trans(k), v, input_precision="ieee")
    tl.store(FINAL + h * DK * DV + state_at, s, mask=state_mask)


@triton.jit
def _scan_backward_kernel(
    W, U, Q, A, K, DECAY, STATES, D_OUT, D_FINAL,
    D_INITIAL, D_W, D_U, D_Q, D_A, D_K, D_DECAY, H,
    N, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_D_FINAL: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1).to(tl.int64)
    rc = tl.arange(0, BC)
    rk = tl.arange(0, BK)
    rv = part * BV + tl.arange(0, BV)
    mc, mk, mv = rc < C, rk < DK, rv < DV
    state_at = rk[:, None] * DV + rv[None, :]
    state_mask = mk[:, None] & mv[None, :]
    if HAS_D_FINAL:
        ds = tl.load(D_FINAL + h * DK * DV + state_at, mask=state_mask, other=0.0)
    else:
        ds = tl.zeros([BK, BV], dtype=U.dtype.element_ty)
    for step in tl.range(0, N):
        c = N - 1 - step
        row = (h * N + c) * C + rc
        part_row = ((part * H + h) * N + c) * C + rc  # this column block's share of a summed gradient
        key_mask = mc[:, None] & mk[None, :]
        value_mask = mc[:, None] & mv[None, :]
        w = tl.load(W + row[:, None] * DK + rk[None, :], mask=key_mask, other=0.0)
        q = tl.load(Q + row[:, None] * DK + rk[None, :], mask=key_mask, other=0.0)
        k = tl.load(K + row[:, None] * DK + rk[None, :], mask=key_mask, other=0.0)
        u = tl.load(U + row[:, None] * DV + rv[None, :], mask=value_mask, other=0.0)
        a = tl.load(A + row[:, None] * C + rc[None, :], mask=mc[:, None] & mc[None, :], other=0.0)
        do = tl.load(D_OUT + row[:, None] * DV + rv[None, :], mask=value_mask, other=0.0)
        decay = tl.load(DECAY + h * N + c)
        s = tl.load(STATES + (h * N + c) * DK * DV + state_at, mask=state_mask, other=0.0)
        v = u - tl.dot(w, s, input_precision="ieee")
        dv = tl.dot(tl.trans(a), do, input_precision="ieee") + tl.dot(k, ds, input_precision="ieee")
        tl.store(D_U + row[:, None] * DV + rv[None, :], dv, mask=value_mask)
        d_a = tl.dot(do, tl.trans(v), input_precision="ieee")
        tl.store(D_A + part_row[:, None] * C + rc[None, :], d_a, mask=mc[:, None] & mc[None, :])
        d_q = tl.dot(do, tl.trans(s), input_precision="ieee")
        tl.store(D_Q + part_row[:, None] * DK + rk[None, :], d_q, mask=key_mask)
        d_k = tl.dot(v, tl.trans(ds), input_precision="ieee")
        tl.store(D_K + part_row[:, None] * DK + rk[None, :], d_k, mask=key_mask)
        d_w = -tl.dot(dv, tl.trans(s), input_precision="ieee")
        tl.store(D_W + part_row[:, None] * DK + rk[None, :], d_w, mask=key_mask)
        tl.store(D_DECAY + (part * H + h) * N + c, tl.sum(s * ds))
        read_back = tl.dot(tl.trans(w), dv, input_precision="ieee")
        ds = ds * decay + tl.dot(tl.trans(q), do, input_precision="ieee") - read_back
    tl.store(D_INITIAL + h * DK * DV + state_at, ds, mask=state_mask)
