"""Context parallelism as the engine sees it: two protocols, implemented by ``longstraw_agents.parallel``.

- ``Ownership`` says which rank stores each position's state (contiguous shards of the positions);
- ``Transport`` carries the messages between the ranks: the collectives of replicated compute (``attention.Shards``:
  attention partials, top-k candidates, sums) and the point-to-point messages and broadcasts of the sharded
  schedules (a capture, exact mode's wavefront walk).

The engine holds no parallelism code beyond calling these (DESIGN.md, "Who may import whom").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from longstraw_agents.attention import Shards
from longstraw_agents.state import Block


class Ownership(Protocol):
    """The ranks of a group hold contiguous shards of the positions; a position's attention/MLA state is stored by
    its owner only."""

    rank: int
    size: int
    shard_size: int

    def owner(self, position: int) -> int:
        """The rank that stores ``position``'s state."""
        ...

    def shard_end(self, position: int) -> int:
        """The first position after ``position``'s shard (chunks never cross it)."""
        ...

    def fit(self, prompt_len: int, chunk: int) -> None:
        """Re-cut the shards so that a prompt of ``prompt_len`` positions spreads evenly over the ranks."""
        ...


class Transport(Shards, Protocol):
    """Messages between the ranks of the group: ``Shards``' collectives plus point-to-point messages and broadcasts
    of tensors of any number, shapes and dtypes. Every collective is called by every rank in the same order."""

    def send(self, tensors: Sequence[Tensor], dst: int, tag: int, kind: str) -> None:
        """Start sending ``tensors`` to rank ``dst`` (``flush`` waits for the sends); ``kind`` names the payload."""
        ...

    def recv(self, src: int, tag: int, device: torch.device) -> tuple[Tensor, ...]:
        """What rank ``src`` sent with ``tag``."""
        ...

    def flush(self, kind: str | None = None, keep: int = 0) -> None:
        """Wait for this rank's sends (of ``kind``; all but the last ``keep`` messages)."""
        ...

    def broadcast(self, tensor: Tensor, src: int) -> Tensor:
        """``tensor`` as rank ``src`` has it, on every rank (in place)."""
        ...

    def broadcast_tensors(self, tensors: Sequence[Tensor] | None, src: int, device: torch.device) -> tuple[Tensor, ...]:
        """Rank ``src``'s ``tensors`` on every rank (the others pass None)."""
        ...


class StateShards(Protocol):
    """What ``Engine(shards=...)`` takes: who stores which positions, and how the ranks talk."""

    @property
    def ownership(self) -> Ownership: ...

    @property
    def transport(self) -> Transport: ...


@dataclass(frozen=True)
class ChunkOwners:
    """Who stores each of a sequence of chunks: ``owners[j]`` for chunk j, ``mine`` the indices of this rank's,
    ``computing`` every rank owning any (ascending)."""

    owners: list[int]
    mine: list[int]
    computing: list[int]

    @classmethod
    def of(cls, ownership: Ownership, starts: Sequence[int]) -> ChunkOwners:
        """The owners of chunks starting at ``starts``."""
        owners = [ownership.owner(start) for start in starts]
        mine = [j for j, owner in enumerate(owners) if owner == ownership.rank]
        return cls(owners, mine, sorted(set(owners)))


def outgoing_rows(blocks: Sequence[Block]) -> list[Tensor]:
    """The rows of consecutive ``blocks`` (in position order) as one tensor per state tensor, in host memory, where
    point-to-point messages travel (``Transport.send``): views when they lie back to back in one arena on the CPU
    (no copy), else one copy — made once, then shared by every message that carries them."""
    joined: list[Block] = []
    for block in blocks:
        if joined and block.follows(joined[-1]):
            joined[-1] = Block(block.arena, joined[-1].lo, block.hi)
        else:
            joined.append(block)
    parts = [b.views() for b in joined]
    rows = [pieces[0] if len(pieces) == 1 else torch.cat(pieces) for pieces in zip(*parts, strict=True)]
    return [t.detach().to("cpu") for t in rows]
