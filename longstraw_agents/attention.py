"""The one attention primitive: exact softmax attention over key blocks, merged by log-sum-exp.

A query attends to several blocks of keys — the captured prefix (one block per stored arena), the branch's own
keys (causal), or sequence shards that live on other ranks. Each block yields a partial result ``(out, lse)``:
the softmax-weighted values normalised within the block and the log of the block's normaliser. Merging partials
with their log-sum-exp (flash-decoding style) gives exactly the attention over the union of the blocks, and it is
differentiable end to end, so gradients reach every block's keys and values.

Shapes: queries are ``[H_kv, R, D]`` where R folds the query heads of one KV group with the query positions
(``R = groups * n``, group-major), keys ``[M, H_kv, D]`` and values ``[M, H_kv, Dv]`` (position first, as stored
in the state). The MLA adapter uses the same primitive with ``H_kv = 1`` (all heads share the compressed latent).

Memory: a block's partial is an autograd function that saves its inputs and ``(out, lse)`` only — never the
``[R, M]`` probabilities — and recomputes them in backward (FlashAttention's trick, here in plain torch). So the
graph of a chunk attending to a prefix of P keys costs O(chunk·D) per block instead of O(chunk·P), and a recomputed
prefix chunk in exact mode stays small however long the prefix is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

# Score elements (heads x query rows x keys) one partial materialises at most: long key blocks are split into
# pieces so that the transient attention memory of a chunk is bounded by the chunk, whatever the prefix length.
DEFAULT_SCORE_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class Partial:
    """Attention of queries over one block of keys: values normalised within the block, and the log normaliser."""

    out: Tensor  # [H_kv, R, Dv]
    lse: Tensor  # [H_kv, R]; about finfo.min where a query sees no key of the block


def softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics are kept in at least fp32 (bf16/fp16 models), in fp64 for fp64 models."""
    return torch.promote_types(dtype, torch.float32)


def block_scores(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """Scaled dot products ``[H_kv, R, M]`` of queries ``[H_kv, R, D]`` with keys ``[M, H_kv, D]`` (the scale is
    applied to the queries: R x D multiplies instead of R x M)."""
    return torch.matmul(q * scale, k.permute(1, 2, 0))


def _scores(pairs: Sequence[Tensor], scale: float, dtype: torch.dtype, mask: Tensor | None) -> Tensor:
    scores = sum(block_scores(q, k, scale) for q, k in zip(pairs[0::2], pairs[1::2], strict=True))
    assert isinstance(scores, Tensor), "at least one query/key pair"
    scores = scores.to(dtype)
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(dtype).min)
    return scores


def _softmax_with_lse(scores: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax over the last dim and its log normaliser with one exp pass (``logsumexp`` then ``exp(s - lse)``
    would exponentiate the scores twice, the costliest elementwise op of attention). Consumes ``scores``."""
    peak = scores.amax(dim=-1, keepdim=True)
    probs = scores.sub_(peak).exp_()
    total = probs.sum(dim=-1, keepdim=True)
    return probs.div_(total), (peak + total.log()).squeeze(-1)


class _BlockAttention(torch.autograd.Function):
    """``(out, lse)`` of softmax attention over one block, saving inputs and outputs only (no probabilities).

    Inputs: ``scale``, ``mask`` (bool, broadcastable to ``[H_kv, R, M]``, or None), values ``v [M, H_kv, Dv]``,
    then query/key pairs ``q_i [H_kv, R, D_i], k_i [M, H_kv, D_i]`` whose scaled dot products are summed (one pair
    for standard attention; MLA sums its latent and rope parts).
    """

    @staticmethod
    def forward(ctx, scale: float, mask: Tensor | None, v: Tensor, *pairs: Tensor):
        sdt = softmax_dtype(v.dtype)
        probs, lse = _softmax_with_lse(_scores(pairs, scale, sdt, mask))
        out = torch.matmul(probs.to(v.dtype), v.transpose(0, 1))
        ctx.scale, ctx.has_mask = scale, mask is not None
        ctx.save_for_backward(v, out, lse, *(() if mask is None else (mask,)), *pairs)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out: Tensor | None, d_lse: Tensor | None):
        v, out, lse, *rest = ctx.saved_tensors
        mask = rest.pop(0) if ctx.has_mask else None
        pairs = rest
        sdt = lse.dtype
        probs = torch.exp(_scores(pairs, ctx.scale, sdt, mask) - lse.unsqueeze(-1))  # hidden keys: exactly 0
        d_scores = torch.zeros_like(probs)
        d_v = None
        if d_out is not None:
            d_v = torch.matmul(probs.to(v.dtype).transpose(1, 2), d_out).permute(1, 0, 2)  # [M, H_kv, Dv]
            d_probs = torch.matmul(d_out, v.permute(1, 2, 0)).to(sdt)  # [H_kv, R, M]
            row = (d_out * out).sum(dim=-1, dtype=sdt).unsqueeze(-1)
            d_scores = probs * (d_probs - row)
        if d_lse is not None:
            d_scores = d_scores + probs * d_lse.to(sdt).unsqueeze(-1)
        if mask is not None:  # hidden keys get no gradient (a fully hidden row has uniform, not zero, probs)
            d_scores = d_scores.masked_fill(~mask, 0.0)
        grads = []
        for q, k in zip(pairs[0::2], pairs[1::2], strict=True):  # scores = (q * scale) k^T
            ds = d_scores.to(q.dtype)
            grads.append(torch.matmul(ds, k.permute(1, 0, 2)) * ctx.scale)  # d q: [H_kv, R, D]
            grads.append(torch.matmul(ds.transpose(1, 2), q * ctx.scale).permute(1, 0, 2))  # d k: [M, H_kv, D]
        return None, None, d_v, *grads


def block_partial(pairs: Sequence[tuple[Tensor, Tensor]], v: Tensor, scale: float, mask: Tensor | None = None):
    """Partial attention over one block from query/key pairs (scores summed over pairs) and values ``v``."""
    flat = [t for pair in pairs for t in pair]
    out, lse = _BlockAttention.apply(scale, mask, v, *flat)
    return Partial(out=out, lse=lse)


def merge(acc: Partial | None, part: Partial) -> Partial:
    """Exact attention over the union of two sets of blocks from their partials (log-sum-exp weights)."""
    if acc is None:
        return part
    lse = torch.logaddexp(acc.lse, part.lse)
    w_acc = torch.exp(acc.lse - lse).unsqueeze(-1).to(acc.out.dtype)
    w_part = torch.exp(part.lse - lse).unsqueeze(-1).to(part.out.dtype)
    return Partial(out=acc.out * w_acc + part.out * w_part, lse=lse)


def causal_mask(n_queries: int, n_keys: int, groups: int, device: torch.device) -> Tensor:
    """Mask ``[1, groups*n, n_keys]`` for the block holding the queries' own keys (the last ``n_queries`` keys)."""
    q_pos = torch.arange(n_queries, device=device) + (n_keys - n_queries)
    k_pos = torch.arange(n_keys, device=device)
    visible = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # [n, M]
    return visible.repeat(groups, 1).unsqueeze(0)


def split_keys(length: int, rows: int, max_elements: int = DEFAULT_SCORE_ELEMENTS) -> list[slice]:
    """Slices covering ``length`` keys such that ``rows x keys`` per slice stays within ``max_elements``."""
    limit = max(1, max_elements // max(rows, 1))
    return [slice(lo, min(lo + limit, length)) for lo in range(0, length, limit)]


def attend(
    q: Tensor,
    past: list[tuple[Tensor, Tensor]],
    own: tuple[Tensor, Tensor],
    scale: float,
    groups: int,
    max_score_elements: int = DEFAULT_SCORE_ELEMENTS,
) -> Tensor:
    """Causal attention of ``q`` over earlier key/value blocks (all visible) and its own block (causal).

    ``q``: ``[H_kv, groups*n, D]``; each block is ``(k [M, H_kv, D], v [M, H_kv, Dv])``.
    Returns ``[H_kv, groups*n, Dv]``.
    """
    n = q.shape[1] // groups
    acc = None
    for k, v in past:
        for piece in split_keys(k.shape[0], q.shape[0] * q.shape[1], max_score_elements):
            acc = merge(acc, block_partial([(q, k[piece])], v[piece], scale))
    k_own, v_own = own
    mask = causal_mask(n, k_own.shape[0], groups, q.device)
    acc = merge(acc, block_partial([(q, k_own)], v_own, scale, mask))
    return acc.out
