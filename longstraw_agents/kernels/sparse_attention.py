"""DeepSeek sparse attention (DSA) over MLA's latent rows as two Triton kernels: each query attends to its own
selected rows of one span of the state, read where they are stored, and the result is an output and a log-sum-exp,
so that spans, chunks and context-parallel ranks compose by the attention core's merge.

A row ``[latent ; rope key]`` is a key and — the same row — a value (MLA's absorbed form). One program takes one
query and a block of its heads, walks the query's ``k`` selected positions in tiles, loads the tile's rows by index
(only those the span holds and the query may see), and keeps an online softmax: nothing ``[queries x k x width]``
is gathered and nothing score-sized is written. The backward takes the global output and log-sum-exp (the
ring-attention identity), recomputes the tile's probabilities, returns the queries' gradient, and adds each row's
gradient (as a key and as a value) straight into the span's gradient sink with atomic adds: no gathered gradient
and no scatter afterwards.

The row is split at ``split`` (the latent rank) so that both parts are tiles of power-of-two width (512 + 64 for
GLM-5.2: no padding to 1,024). Products run in full precision (``fast=False``: fp32 without TF32, or fp64 in the
interpreter, the suite's check against the pure-torch path), or on bf16 tensor cores with fp32 sums (``fast``: the
rows and queries are bf16 values, so the score products are exact and only the order of sums changes; the
probabilities are rounded to bf16 for the value product, as FlashAttention does).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from longstraw_agents.kernels import interpreted
from longstraw_agents.kernels.products import dot, operand

MIN_DOT = 16  # tl.dot takes no dimension under 16: smaller ones are padded (masked) up to it
BLOCK_KEYS = 32  # selected rows per tile


def _block(n: int) -> int:
    return max(MIN_DOT, triton.next_power_of_2(max(n, 1)))


def _launch(q: Tensor, rows: Tensor, selected: Tensor, split: int, fast: bool) -> dict[str, Any]:
    """The constants every launch shares."""
    n, heads, width = q.shape
    block_heads = min(64, _block(heads))
    return {
        "grid": (n, triton.cdiv(heads, block_heads)),
        "sizes": {
            "H": heads, "K": selected.shape[1], "M": rows.shape[0], "W1": split, "W2": width - split,
            "BH": block_heads, "BK": BLOCK_KEYS, "BW1": _block(split), "BW2": _block(width - split),
            "FAST": fast, "EMULATE": interpreted(), "ACC": tl.float64 if q.dtype == torch.float64 else tl.float32,
        },
        # 8 warps once a head block's accumulator and a tile of rows are wide (512 latent columns), so that a
        # thread's share stays in registers
        "num_warps": 4 if block_heads * _block(split) <= 16 * 128 else 8,
    }  # fmt: skip


def sparse_forward(
    q: Tensor, rows: Tensor, selected: Tensor, lo: int, first_query: int, split: int, scale: float, fast: bool
) -> tuple[Tensor, Tensor]:
    """``(out [n, H, W], lse [n, H])`` in at least fp32 of queries ``q [n, H, W]`` (positions ``first_query..``)
    over the rows ``[M, W]`` of positions ``lo..lo+M`` among their selected positions ``[n, k]`` (the others, and
    those after the query, are not seen; ``lse`` is -inf where none is)."""
    n, heads, width = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty((n, heads, width), dtype=acc, device=q.device)
    lse = torch.empty((n, heads), dtype=acc, device=q.device)
    launch = _launch(q, rows, selected, split, fast)
    q, rows, selected = q.contiguous(), rows.contiguous(), selected.contiguous()
    _sparse_forward_kernel[launch["grid"]](
        q, rows, selected, out, lse, lo, first_query, scale, num_warps=launch["num_warps"], **launch["sizes"]
    )
    return out, lse


def sparse_backward(
    q: Tensor,
    rows: Tensor,
    selected: Tensor,
    lo: int,
    first_query: int,
    split: int,
    scale: float,
    fast: bool,
    out: Tensor,
    lse: Tensor,
    d_out: Tensor,
    sink: Tensor | None,
) -> Tensor:
    """The queries' gradient ``[n, H, W]`` from this span's rows, for the attention whose (global, over every span)
    output is ``out`` with log normaliser ``lse``; the rows' gradient is added into ``sink [M, W]`` (fp32 or fp64,
    contiguous) when one is given."""
    delta = (d_out.to(out.dtype) * out).sum(-1).contiguous()  # D = rowsum(dO ∘ out) [n, H]
    d_q = torch.empty(out.shape, dtype=out.dtype, device=q.device)
    launch = _launch(q, rows, selected, split, fast)
    q, rows, selected = q.contiguous(), rows.contiguous(), selected.contiguous()
    if sink is not None and not sink.is_contiguous():
        raise ValueError("the sparse kernel adds into a contiguous gradient sink only")
    _sparse_backward_kernel[launch["grid"]](
        q, rows, selected, lse.contiguous(), d_out.contiguous(), delta, d_q, d_q if sink is None else sink,
        lo, first_query, scale, HAS_SINK=sink is not None, num_warps=launch["num_warps"], **launch["sizes"],
    )  # fmt: skip
    return d_q


@triton.jit
def _tile_scores(
    q1, q2, ROWS, SEL, t, i, lo, query_position, scale, K, M, c1, m1, c2, m2,
    W1: tl.constexpr, W2: tl.constexpr, BK: tl.constexpr, FAST: tl.constexpr, EMULATE: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """The tile of query ``i``'s selected positions from ``t``: which of them this span holds and the query sees
    (``ok``), their rows as operands (latent and rope parts, zero where not seen), their row offsets, and the
    scaled scores ``[BH, BK]`` (unmasked)."""
    rk = t + tl.arange(0, BK)
    position = tl.load(SEL + i * K + rk, mask=rk < K, other=-1)
    rel = position - lo
    ok = (rk < K) & (rel >= 0) & (rel < M) & (position <= query_position) & (position >= 0)
    at = ROWS + rel[:, None] * (W1 + W2)
    r1 = operand(tl.load(at + c1[None, :], mask=ok[:, None] & m1[None, :], other=0.0), FAST, EMULATE, ACC)
    r2 = operand(tl.load(at + W1 + c2[None, :], mask=ok[:, None] & m2[None, :], other=0.0), FAST, EMULATE, ACC)
    s = (dot(q1, tl.trans(r1), FAST, EMULATE) + dot(q2, tl.trans(r2), FAST, EMULATE)).to(ACC) * scale
    return ok, rel, r1, r2, s


@triton.jit
def _sparse_forward_kernel(
    Q, ROWS, SEL, OUT, LSE, lo, first_query, scale,
    H, K, M, W1: tl.constexpr, W2: tl.constexpr,
    BH: tl.constexpr, BK: tl.constexpr, BW1: tl.constexpr, BW2: tl.constexpr,
    FAST: tl.constexpr, EMULATE: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64)
    rh = tl.program_id(1) * BH + tl.arange(0, BH)
    c1, c2 = tl.arange(0, BW1), tl.arange(0, BW2)
    mh, m1, m2 = rh < H, c1 < W1, c2 < W2
    q_at = Q + (i * H + rh[:, None]) * (W1 + W2)
    q1 = operand(tl.load(q_at + c1[None, :], mask=mh[:, None] & m1[None, :], other=0.0), FAST, EMULATE, ACC)
    q2 = operand(tl.load(q_at + W1 + c2[None, :], mask=mh[:, None] & m2[None, :], other=0.0), FAST, EMULATE, ACC)
    query_position = first_query + i
    best = tl.full([BH], float("-inf"), dtype=ACC)
    total = tl.zeros([BH], dtype=ACC)
    acc1 = tl.zeros([BH, BW1], dtype=ACC)
    acc2 = tl.zeros([BH, BW2], dtype=ACC)
    for t in tl.range(0, K, BK):
        ok, _, r1, r2, s = _tile_scores(
            q1, q2, ROWS, SEL, t, i, lo, query_position, scale, K, M, c1, m1, c2, m2, W1, W2, BK, FAST, EMULATE, ACC
        )
        s = tl.where(ok[None, :], s, float("-inf"))
        new_best = tl.maximum(best, tl.max(s, 1))
        shift = tl.where(new_best == float("-inf"), 0.0, new_best)  # a row that has seen nothing: no nan
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(best - shift)
        total = total * alpha + tl.sum(p, 1)
        pv = operand(p, FAST, EMULATE, ACC)
        acc1 = acc1 * alpha[:, None] + dot(pv, r1, FAST, EMULATE).to(ACC)
        acc2 = acc2 * alpha[:, None] + dot(pv, r2, FAST, EMULATE).to(ACC)
        best = new_best
    safe_total = tl.where(total == 0, 1.0, total)
    out_at = OUT + (i * H + rh[:, None]) * (W1 + W2)
    tl.store(out_at + c1[None, :], acc1 / safe_total[:, None], mask=mh[:, None] & m1[None, :])
    tl.store(out_at + W1 + c2[None, :], acc2 / safe_total[:, None], mask=mh[:, None] & m2[None, :])
    lse = tl.where(total == 0, float("-inf"), best + tl.log(safe_total))
    tl.store(LSE + i * H + rh, lse, mask=mh)


@triton.jit
def _sparse_backward_kernel(
    Q, ROWS, SEL, LSE, D_OUT, DELTA, D_Q, SINK, lo, first_query, scale,
    H, K, M, W1: tl.constexpr, W2: tl.constexpr,
    BH: tl.constexpr, BK: tl.constexpr, BW1: tl.constexpr, BW2: tl.constexpr,
    FAST: tl.constexpr, EMULATE: tl.constexpr, ACC: tl.constexpr, HAS_SINK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64)
    rh = tl.program_id(1) * BH + tl.arange(0, BH)
    c1, c2 = tl.arange(0, BW1), tl.arange(0, BW2)
    mh, m1, m2 = rh < H, c1 < W1, c2 < W2
    head_at = (i * H + rh[:, None]) * (W1 + W2)
    part1, part2 = mh[:, None] & m1[None, :], mh[:, None] & m2[None, :]
    q1 = operand(tl.load(Q + head_at + c1[None, :], mask=part1, other=0.0), FAST, EMULATE, ACC)
    q2 = operand(tl.load(Q + head_at + W1 + c2[None, :], mask=part2, other=0.0), FAST, EMULATE, ACC)
    do1 = operand(tl.load(D_OUT + head_at + c1[None, :], mask=part1, other=0.0), FAST, EMULATE, ACC)
    do2 = operand(tl.load(D_OUT + head_at + W1 + c2[None, :], mask=part2, other=0.0), FAST, EMULATE, ACC)
    lse = tl.load(LSE + i * H + rh, mask=mh, other=float("-inf")).to(ACC)
    lse = tl.where(lse == float("-inf"), 0.0, lse)  # such a row sees nothing: every p below is 0
    delta = tl.load(DELTA + i * H + rh, mask=mh, other=0.0).to(ACC)
    query_position = first_query + i
    dq1 = tl.zeros([BH, BW1], dtype=ACC)
    dq2 = tl.zeros([BH, BW2], dtype=ACC)
    for t in tl.range(0, K, BK):
        ok, rel, r1, r2, s = _tile_scores(
            q1, q2, ROWS, SEL, t, i, lo, query_position, scale, K, M, c1, m1, c2, m2, W1, W2, BK, FAST, EMULATE, ACC
        )
        p = tl.where(ok[None, :] & mh[:, None], tl.exp(s - lse[:, None]), 0.0)
        dp = (dot(do1, tl.trans(r1), FAST, EMULATE) + dot(do2, tl.trans(r2), FAST, EMULATE)).to(ACC)
        ds = p * (dp - delta[:, None]) * scale
        ds_dot, p_dot = operand(ds, FAST, EMULATE, ACC), operand(p, FAST, EMULATE, ACC)
        dq1 += dot(ds_dot, r1, FAST, EMULATE).to(ACC)
        dq2 += dot(ds_dot, r2, FAST, EMULATE).to(ACC)
        if HAS_SINK:
            # the row is a key (ds^T q) and a value (p^T dO) at once
            dr1 = dot(tl.trans(ds_dot), q1, FAST, EMULATE).to(ACC) + dot(tl.trans(p_dot), do1, FAST, EMULATE).to(ACC)
            dr2 = dot(tl.trans(ds_dot), q2, FAST, EMULATE).to(ACC) + dot(tl.trans(p_dot), do2, FAST, EMULATE).to(ACC)
            sink_at = SINK + rel[:, None] * (W1 + W2)
            tl.atomic_add(sink_at + c1[None, :], dr1, mask=ok[:, None] & m1[None, :])
            tl.atomic_add(sink_at + W1 + c2[None, :], dr2, mask=ok[:, None] & m2[None, :])
    tl.store(D_Q + head_at + c1[None, :], dq1, mask=part1)
    tl.store(D_Q + head_at + W1 + c2[None, :], dq2, mask=part2)
