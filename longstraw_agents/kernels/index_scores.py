"""DSA's lightning indexer scores as one Triton kernel: ``scores[t, s] = sum_h w_h(t) relu(scale q_h(t) . k(s))``.

One program takes a block of queries and a block of keys and walks the heads, adding each head's weighted, rectified
product into one accumulator: the per-head scores ``[queries, heads, keys]`` never exist, in registers or in memory
(as DeepSeek's own indexer kernel). Products in full precision (``fast=False``: fp32 without TF32, fp64 in the
interpreter) or on bf16 tensor cores with fp32 sums (``fast``: the queries and keys are bf16 values, so every
product is exact and only the order of the sums changes). The heads are summed in order, from the first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from longstraw_agents.kernels import interpreted
from longstraw_agents.kernels.products import dot, operand

MIN_DOT = 16  # tl.dot takes no dimension under 16
BLOCK_QUERIES = 64
BLOCK_KEYS = 64


def index_scores(q: Tensor, w: Tensor, keys: Tensor, scale: float, fast: bool) -> Tensor:
    """``[n, m]`` scores of queries ``q [n, H, D]`` with head weights ``w [n, H]`` over ``keys [m, D]``, in at least
    fp32 (``q``'s dtype when wider)."""
    n, heads, dim = q.shape
    m = keys.shape[0]
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.empty((n, m), dtype=acc, device=q.device)
    if n == 0 or m == 0:
        return scores
    grid = (triton.cdiv(n, BLOCK_QUERIES), triton.cdiv(m, BLOCK_KEYS))
    _index_scores_kernel[grid](
        q.contiguous(), w.contiguous().to(acc), keys.contiguous(), scores, n, m, scale,
        H=heads, D=dim, BD=max(MIN_DOT, triton.next_power_of_2(dim)), BN=BLOCK_QUERIES, BM=BLOCK_KEYS,
        FAST=fast, EMULATE=interpreted(), ACC=tl.float64 if acc == torch.float64 else tl.float32,
    )  # fmt: skip
    return scores


@triton.jit
def _index_scores_kernel(
    Q, W, KEYS, SCORES, n, m, scale,
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
    FAST: tl.constexpr, EMULATE: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    rn = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    rm = tl.program_id(1).to(tl.int64) * BM + tl.arange(0, BM)
    rd = tl.arange(0, BD)
    mn, mm, md = rn < n, rm < m, rd < D
    k = tl.load(KEYS + rm[:, None] * D + rd[None, :], mask=mm[:, None] & md[None, :], other=0.0)
    kt = tl.trans(operand(k, FAST, EMULATE, ACC))
    acc = tl.zeros([BN, BM], dtype=ACC)
    for h in tl.static_range(H):
        q = tl.load(Q + (rn[:, None] * H + h) * D + rd[None, :], mask=mn[:, None] & md[None, :], other=0.0)
        dots = dot(operand(q, FAST, EMULATE, ACC), kt, FAST, EMULATE).to(ACC)
        weight = tl.load(W + rn * H + h, mask=mn, other=0.0)
        acc += weight[:, None] * tl.maximum(dots * scale, 0.0)
    tl.store(SCORES + rn[:, None] * m + rm[None, :], acc, mask=mn[:, None] & mm[None, :])
