"""The one attention primitive: exact softmax attention over key blocks, merged by log-sum-exp.

A query attends to several blocks of keys — the captured prefix (one block per stored arena), the branch's own
keys (causal), or sequence shards that live on other ranks. Each block yields a partial result ``(out, lse)``:
the softmax-weighted values normalised within the block and the log of the block's normaliser. Merging partials
with their log-sum-exp (flash-decoding style) gives exactly the attention over the union of the blocks, and it is
differentiable end to end, so gradients reach every block's keys and values.

Shapes: queries are ``[H_kv, R, D]`` where R folds the query heads of one KV group with the query positions
(``R = groups * n``, group-major), keys ``[M, H_kv, D]`` and values ``[M, H_kv, Dv]`` (position first, as stored
in the state). The MLA adapter uses the same primitive with ``H_kv = 1`` (all heads share the compressed latent).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# Keys a partial covers at most: long blocks are split so that a chunk's scores stay bounded whatever the prefix.
MAX_KEYS_PER_PARTIAL = 8192


@dataclass(frozen=True)
class Partial:
    """Attention of queries over one block of keys: values normalised within the block, and the log normaliser."""

    out: Tensor  # [H_kv, R, Dv]
    lse: Tensor  # [H_kv, R]; about finfo.min where a query sees no key of the block


def softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics are kept in at least fp32 (bf16/fp16 models), in fp64 for fp64 models."""
    return torch.promote_types(dtype, torch.float32)


def block_scores(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """Scaled dot products ``[H_kv, R, M]`` of queries ``[H_kv, R, D]`` with keys ``[M, H_kv, D]``."""
    return torch.matmul(q, k.permute(1, 2, 0)) * scale


def partial_from_scores(scores: Tensor, v: Tensor, mask: Tensor | None = None) -> Partial:
    """Softmax over the block given its scores ``[H_kv, R, M]``; ``mask`` (broadcastable, True = visible).

    Hidden keys get the most negative finite score (as transformers does) rather than -inf: a query that sees no
    key of the block then gets a finite log normaliser whose merge weight underflows to exactly 0, and no NaN can
    reach the gradients.
    """
    scores = scores.to(softmax_dtype(scores.dtype))
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).to(v.dtype)
    out = torch.matmul(probs, v.transpose(0, 1))  # [H_kv, R, M] @ [H_kv, M, Dv]
    return Partial(out=out, lse=lse)


def merge(acc: Partial | None, part: Partial) -> Partial:
    """Exact attention over the union of two sets of blocks from their partials (log-sum-exp weights)."""
    if acc is None:
        return part
    lse = torch.logaddexp(acc.lse, part.lse)
    w_acc = torch.exp(acc.lse - lse).unsqueeze(-1).to(acc.out.dtype)
    w_part = torch.exp(part.lse - lse).unsqueeze(-1).to(part.out.dtype)
    return Partial(out=acc.out * w_acc + part.out * w_part, lse=lse)


def merge_all(partials: list[Partial]) -> Partial:
    acc = None
    for part in partials:
        acc = merge(acc, part)
    if acc is None:
        raise ValueError("nothing to merge")
    return acc


def causal_mask(n_queries: int, n_keys: int, groups: int, device: torch.device) -> Tensor:
    """Mask ``[1, groups*n, n_keys]`` for the block holding the queries' own keys (the last ``n_queries`` keys)."""
    q_pos = torch.arange(n_queries, device=device) + (n_keys - n_queries)
    k_pos = torch.arange(n_keys, device=device)
    visible = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # [n, M]
    return visible.repeat(groups, 1).unsqueeze(0)


def split_keys(length: int, limit: int | None = None) -> list[slice]:
    """Slices of at most ``limit`` (default ``MAX_KEYS_PER_PARTIAL``) keys covering ``length`` keys."""
    limit = limit or MAX_KEYS_PER_PARTIAL
    return [slice(lo, min(lo + limit, length)) for lo in range(0, length, limit)]


def attend(
    q: Tensor,
    past: list[tuple[Tensor, Tensor]],
    own: tuple[Tensor, Tensor],
    scale: float,
    groups: int,
) -> Tensor:
    """Causal attention of ``q`` over earlier key/value blocks (all visible) and its own block (causal).

    ``q``: ``[H_kv, groups*n, D]``; each block is ``(k [M, H_kv, D], v [M, H_kv, Dv])``.
    Returns ``[H_kv, groups*n, Dv]``.
    """
    n = q.shape[1] // groups
    acc = None
    for k, v in past:
        for piece in split_keys(k.shape[0]):
            acc = merge(acc, partial_from_scores(block_scores(q, k[piece], scale), v[piece]))
    k_own, v_own = own
    mask = causal_mask(n, k_own.shape[0], groups, q.device)
    acc = merge(acc, partial_from_scores(block_scores(q, k_own, scale), v_own, mask))
    return acc.out
