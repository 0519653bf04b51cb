"""Context parallelism as the engine sees it: two protocols, implemented by ``longstraw_agents.parallel``.

- ``Ownership`` says which rank stores each new position's state (recorded per chunk in the state);
- ``Transport`` carries the messages between the ranks: the collectives of replicated compute (``attention.Shards``:
  attention partials, top-k candidates, sums) and the point-to-point messages and broadcasts of the sharded
  schedules (a capture, exact mode's wavefront walk).

The engine holds no parallelism code beyond calling these (DESIGN.md, "Who may import whom").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from longstraw_agents.attention import Shards
from longstraw_agents.models.base import PastBlock
from longstraw_agents.state import Block


class Ownership(Protocol):
    """Which rank of the group stores each new position's state (attention/MLA rows, DSA index keys: its owner
    only). The engine records every chunk's owner in its ``ChunkRecord``, so a state carries its own placement and
    siblings may be placed differently."""

    rank: int
    size: int

    def cut(self, n: int, balanced: bool = True) -> list[tuple[int, int, int]]:
        """A sharded extend (a capture) of ``n`` positions: ``(lo, hi, owner)`` offsets of contiguous runs in
        position order, each rank's positions about ``n / N``. ``balanced``: each rank's attention work about
        even too (a rank may get several runs); otherwise one run per rank in rank order."""
        ...

    def assign(self, held: Sequence[int], lengths: Sequence[int]) -> list[int]:
        """A replicated extend (a turn, a branch) of pieces of ``lengths`` positions after a path whose ranks hold
        ``held`` positions each: the owner of each piece (every rank of the group gets the same answer to the same
        calls in the same order; an answer may depend on the earlier calls')."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What the answers depend on of the earlier calls (a checkpoint's: a resumed run places as the
        uninterrupted one did, so that its partials merge in the same order)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Transport(Shards, Protocol):
    """Messages between the ranks of the group: ``Shards``' collectives plus point-to-point messages and broadcasts
    of tensors of any number, shapes and dtypes. Every collective is called by every rank in the same order."""

    def stage(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """``tensors`` as ``send`` would send them (host copies, where the transport stages messages through host
        memory): a message for several ranks, staged once."""
        ...

    def send(self, tensors: Sequence[Tensor], dst: int, tag: int, kind: str) -> None:
        """Start sending ``tensors`` to rank ``dst`` (``flush`` waits for the sends); ``kind`` names the payload.
        The tensors must not change until then."""
        ...

    def recv(self, src: int, tag: int, device: torch.device, on_host: int = 0) -> tuple[Tensor, ...]:
        """What rank ``src`` sent with ``tag``, on ``device`` but its first ``on_host`` tensors (metadata read on
        the host, e.g. ``outgoing_runs``' header: read from a device it would wait for the device)."""
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
    def of(cls, owners: Sequence[int], rank: int) -> ChunkOwners:
        """The chunks of ``owners`` as rank ``rank`` sees them."""
        return cls(list(owners), [j for j, owner in enumerate(owners) if owner == rank], sorted(set(owners)))


def in_position_order(blocks: list[PastBlock]) -> list[PastBlock]:
    """Past blocks as the mixers read them: by position (DSA's top-k breaks ties by it), whichever ranks sent them."""
    return sorted(blocks, key=lambda block: block.start)


RUNS_HEADER = 1  # a runs message's tensors read on the host: its header


def outgoing_runs(blocks: Sequence[tuple[int, Block]]) -> list[Tensor]:
    """Positioned ``blocks`` as a message: an int64 ``[runs, 2]`` tensor on the host of the (first position,
    length) of each run of consecutive positions in one arena, then each run's tensors — views of the arena (no
    copy; ``Transport.stage`` copies them to the host where messages travel through it). A rank's rows need not be
    contiguous in positions (its share of a capture and of later extends) and DSA selects keys by position;
    ``incoming_runs`` reads it."""
    runs: list[tuple[int, Block]] = []
    for position, block in blocks:
        if runs and runs[-1][0] + runs[-1][1].length == position and block.follows(runs[-1][1]):
            first, joined = runs[-1]
            runs[-1] = (first, Block(joined.arena, joined.lo, block.hi))
        else:
            runs.append((position, block))
    header = torch.tensor([[position, block.length] for position, block in runs], dtype=torch.int64).reshape(-1, 2)
    return [header, *(t.detach() for _, block in runs for t in block.views())]


def incoming_runs(message: Sequence[Tensor]) -> list[tuple[int, tuple[Tensor, ...]]]:
    """What ``outgoing_runs`` sent: ``(first position, rows)`` per run (received with ``on_host=RUNS_HEADER``)."""
    runs = message[0].tolist()
    per = (len(message) - 1) // max(len(runs), 1)  # the state's tensors
    return [(position, tuple(message[1 + k * per : 1 + (k + 1) * per])) for k, (position, _) in enumerate(runs)]
