"""Batched decoding on the model side: one new token for each of B members in one forward.

Members of a group share their captured prompt (their *prefix*): a growing layer's queries attend to it together —
the group's rows stacked as ``n = g`` queries in ONE call of the attention core's ``partial_attention`` (cascade /
Hydragen-style shared-prefix decoding, so the prefix's keys are read once per step for the whole group) — and to
their own later positions separately, and the partials are merged by log-sum-exp. Everything position-wise
(projections, norms, MLPs, the LM head) runs over the B rows at once; recurrent layers step B independent states.

Blocks are read in *groups*: rows of the batch that read the same blocks of state — a group's members their shared
prefix, or one member its own positions from before the session — with one ``partial_attention`` call per group;
a row may be in several groups (its prefix's and its own), its partial results merged. Nothing of the state is
copied for a session. The positions decoded in the session live in batch buffers ``[B, capacity, *shape]``, so a
step does no per-member work for them: a growing mixer writes its new position at each member's session length
(``write_session``) and attends over the buffers padded to the longest member.

With context parallelism (``Attention.shards``) the blocks are this rank's share only: their partial results are
merged over the ranks (``Shards.merge_partials``; DSA's candidates with ``merge_topk``) before the session's
positions, which every rank computes (a decode step is replicated), are merged in once. This module holds what a
mixer's ``decode`` reads and the attention pieces the mixers share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from longstraw_agents.attention import Attention, KVBlock, merge, partial_attention, softmax_dtype

BlockTensors = tuple[Tensor, ...]
"""One block of a growing layer's state: its per-position tensors (views of the state), position first."""

PositionedBlock = tuple[int, BlockTensors]
"""A block and the position of its first row (with context parallelism a rank's blocks are not back to back)."""


@dataclass(frozen=True)
class DecodeGroup:
    """Rows of the batch that read the same blocks: the members of a group their shared prefix, or one member its
    own positions from before the session (with context parallelism, the ones this rank stores)."""

    rows: Tensor  # [g] long


@dataclass(frozen=True)
class DecodeBatch:
    """What the layers share about one decode step.

    positions: ``[B]`` the position of each member's new token.
    groups: the groups of rows reading the same blocks (``DecodeContext.blocks`` holds each one's), in position
        order for every row (a prefix's group before its members' own).
    session_start: ``[B]`` the position of each member's first session slot.
    session_lengths: ``[B]`` session positions before the new one: the new one goes to that slot.
    session_mask: ``[B, L]`` the session slots each member's query sees (the new one included), ``L`` the longest
        (a static step's: the buffers' capacity, so that its shapes stay put).
    regime: the family's decode path for this step (``FamilyAdapter.decode_regime`` of the longest member's reach,
        e.g. DSA's dense attention while no member sees more than its top-k keys).
    """

    positions: Tensor
    groups: tuple[DecodeGroup, ...]
    session_start: Tensor
    session_lengths: Tensor
    session_mask: Tensor
    regime: int = 0

    @property
    def size(self) -> int:
        return int(self.positions.shape[0])


@dataclass
class DecodeContext:
    """What one layer reads for a decode step.

    Growing layers: ``blocks[j]``, group j's blocks held here with their positions; ``session``, the members'
    session buffers (one per state tensor; ``write_session`` adds the new position). Recurrent layers:
    ``recurrent``, the members' states stacked ``[B, ...]`` (what ``decode`` returns as ``new``)."""

    blocks: list[list[PositionedBlock]] = field(default_factory=list)
    session: tuple[Tensor, ...] = ()
    recurrent: tuple[Tensor, ...] = ()


@dataclass
class DecodeInput:
    """A mixer's input for a decode step: ``x [B, hidden]`` (one new token per member), its RoPE tables
    ``[B, rot]``, the step, the layer's context, scratch shared by the layers of one forward, the attention op
    (its ``shards``: the other context-parallel ranks)."""

    x: Tensor
    rope: tuple[Tensor, Tensor]
    batch: DecodeBatch
    context: DecodeContext
    shared: dict[str, Any]
    attention: Attention


def write_session(inp: DecodeInput, new: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """Store each member's new position (``new``: one ``[B, *shape]`` per state tensor) in its session buffers and
    return their first ``L`` slots, ``[B, L, *shape]`` (``inp.batch.session_mask [B, L]`` says which are seen)."""
    batch = inp.batch
    rows = torch.arange(batch.size, device=batch.session_lengths.device)
    for buffer, values in zip(inp.context.session, new, strict=True):
        buffer[rows, batch.session_lengths] = values.to(buffer.dtype)
    length = batch.session_mask.shape[1]
    return tuple(buffer[:, :length] for buffer in inp.context.session)


def own_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Each member's query over its own (few, ragged) positions: matmul math in softmax precision.

    q ``[B, H, D]``; keys ``[B, L, H_kv, D]``, values ``[B, L, H_kv, Dv]``, mask ``[B, L]`` (every row sees at least
    one key: its new position). Returns ``(out [B, H, Dv], lse [B, H])``."""
    batch, heads, _ = q.shape
    kv_heads = keys.shape[2]
    sdt = softmax_dtype(q.dtype)
    qg = q.to(sdt).view(batch, kv_heads, heads // kv_heads, -1)  # the query heads of one KV head together
    scores = torch.matmul(qg, keys.to(sdt).permute(0, 2, 3, 1)) * scale  # [B, H_kv, G, L]
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), values.to(sdt).transpose(1, 2))  # [B, H_kv, G, Dv]
    return out.reshape(batch, heads, -1), lse.reshape(batch, heads)


KVOf = Callable[[BlockTensors], tuple[Tensor, Tensor]]
"""A block's keys and values ``[M, H_kv, *]`` from its tensors."""


def kv_pair(block: BlockTensors) -> tuple[Tensor, Tensor]:
    """K/V layers keep keys and values as a block's first two tensors."""
    return block[0], block[1]


def cascade_attention(
    q: Tensor, keys: Tensor, values: Tensor, inp: DecodeInput, scale: float, kv_of: KVOf = kv_pair
) -> Tensor:
    """Decode attention of one layer: member b's query ``q[b] [H, D]`` over its groups' blocks and its session
    positions ``keys[b], values[b] [L, H_kv, *]`` (``write_session``'s buffers, new position included).

    Each group's blocks are read once: the group's queries are stacked as the rows of one ``partial_attention``
    call, merged into its rows' partial results — over the ranks with context parallelism — and then with the
    session's. Returns ``[B, H, Dv]`` in q's dtype."""
    earlier = blocks_partial(q, values.shape[-1], inp, scale, kv_of)
    out, _ = merge(earlier, *own_attention(q, keys, values, inp.batch.session_mask, scale))
    return out.to(q.dtype)


def blocks_partial(q: Tensor, width: int, inp: DecodeInput, scale: float, kv_of: KVOf) -> tuple[Tensor, Tensor]:
    """``(out [B, H, width], lse [B, H])`` of the queries over their groups' blocks (every rank's, with context
    parallelism), in softmax precision; a row that reads none has lse -inf."""
    batch, heads = q.shape[0], q.shape[1]
    out = torch.zeros((batch, heads, width), dtype=softmax_dtype(q.dtype), device=q.device)
    lse = torch.full((batch, heads), float("-inf"), dtype=out.dtype, device=q.device)
    for group, blocks in zip(inp.batch.groups, inp.context.blocks, strict=True):
        if blocks:  # (with context parallelism this rank may hold none of them)
            part = partial_attention(q[group.rows], [KVBlock(*kv_of(b)) for _, b in blocks], inp.attention, scale)
            out[group.rows], lse[group.rows] = merge((out[group.rows], lse[group.rows]), *part)
    if inp.attention.shards is not None:
        return inp.attention.shards.merge_partials((out, lse), tuple(out.shape), lse)
    return out, lse
