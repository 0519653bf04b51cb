"""Batched decoding on the model side: one new token for each of B members in one forward.

Members of a group share their captured prompt (their *prefix*): a growing layer's queries attend to it together —
the group's rows stacked as ``n = g`` queries in ONE call of the attention core's ``partial_attention`` (cascade /
Hydragen-style shared-prefix decoding, so the prefix's keys are read once per step for the whole group) — and to
their own later positions separately, and the partials are merged by log-sum-exp. Everything position-wise
(projections, norms, MLPs, the LM head) runs over the B rows at once; recurrent layers step B independent states.

A member's own positions (after its prefix) live in batch buffers ``[B, capacity, *shape]`` for the duration of a
decode session (``longstraw_agents.decoding.Decoder``), so a step does no per-member work: a growing mixer writes
its new position at each member's own length (``write_own``) and attends over the buffers padded to the longest
member. This module holds what a mixer's ``decode`` reads and the attention pieces the mixers share.
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


@dataclass(frozen=True)
class DecodeGroup:
    """Members (rows of the batch) that share a prefix of ``length`` positions (their group's prompt)."""

    rows: Tensor  # [g] long
    length: int


@dataclass(frozen=True)
class DecodeBatch:
    """What the layers share about one decode step.

    positions: ``[B]`` the position of each member's new token.
    groups: the groups of rows sharing a prefix (a member in no group attends to its own positions only).
    own_start: ``[B]`` where each member's own positions begin (its prefix length; 0 without a prefix).
    own_lengths: ``[B]`` own positions before the new one: the new one goes to that slot of the own buffers.
    own_mask: ``[B, L]`` the slots each member's query sees (its own positions and the new one), ``L`` the longest.
    """

    positions: Tensor
    groups: tuple[DecodeGroup, ...]
    own_start: Tensor
    own_lengths: Tensor
    own_mask: Tensor

    @property
    def size(self) -> int:
        return int(self.positions.shape[0])


@dataclass
class DecodeContext:
    """What one layer reads for a decode step.

    Growing layers: ``shared[j]``, the blocks of group j's prefix; ``own``, the members' own-position buffers
    ``[B, capacity, *shape]`` (one per state tensor; ``write_own`` adds the new position). Recurrent layers:
    ``recurrent``, the members' states stacked ``[B, ...]`` (what ``decode`` returns as ``new``)."""

    shared: list[list[BlockTensors]] = field(default_factory=list)
    own: tuple[Tensor, ...] = ()
    recurrent: tuple[Tensor, ...] = ()


@dataclass
class DecodeInput:
    """A mixer's input for a decode step: ``x [B, hidden]`` (one new token per member), its RoPE tables
    ``[B, rot]``, the step, the layer's context, scratch shared by the layers of one forward, the attention op."""

    x: Tensor
    rope: tuple[Tensor, Tensor]
    batch: DecodeBatch
    context: DecodeContext
    shared: dict[str, Any]
    attention: Attention


def write_own(inp: DecodeInput, new: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """Store each member's new position (``new``: one ``[B, *shape]`` per state tensor) in its own buffers and
    return the buffers up to the longest member, ``[B, L, *shape]`` (``inp.batch.own_mask`` says which slots)."""
    batch = inp.batch
    rows = torch.arange(batch.size, device=batch.own_lengths.device)
    for buffer, values in zip(inp.context.own, new, strict=True):
        buffer[rows, batch.own_lengths] = values.to(buffer.dtype)
    length = batch.own_mask.shape[1]
    return tuple(buffer[:, :length] for buffer in inp.context.own)


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
    """Decode attention of one layer: member b's query ``q[b] [H, D]`` over its group's prefix and over its own
    positions ``keys[b], values[b] [L, H_kv, *]`` (``write_own``'s buffers, new position included).

    Each group's prefix is read once: the group's queries are stacked as the rows of one ``partial_attention``
    call. The groups' rows are disjoint, so their partials fill one tensor, merged once with the own part.
    Returns ``[B, H, Dv]`` in q's dtype."""
    batch = inp.batch
    acc = own_attention(q, keys, values, batch.own_mask, scale)
    if batch.groups:
        shared_out, shared_lse = torch.zeros_like(acc[0]), torch.full_like(acc[1], float("-inf"))
        for group, blocks in zip(batch.groups, inp.context.shared, strict=True):
            out, lse = partial_attention(q[group.rows], [KVBlock(*kv_of(b)) for b in blocks], inp.attention, scale)
            shared_out[group.rows], shared_lse[group.rows] = out.to(shared_out.dtype), lse.to(shared_lse.dtype)
        acc = merge(acc, shared_out, shared_lse)
    return acc[0].to(q.dtype)
