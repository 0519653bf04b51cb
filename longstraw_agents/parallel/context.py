"""Context parallelism for the engine's state: the ranks of a process group each hold a share of every path's
positions.

Two types, as the engine sees them (``longstraw_agents.engine.shards``; the cut itself, ``cut_runs``, is one of the
rules of ``engine.schedule``): ``BalancedOwnership`` says who stores what — a capture is cut into 2N parts, rank r
computing the r-th and the (2N - 1 - r)-th (``cut_runs``: even in positions and attention work; exact mode's
wavefront walk walks the same cut back), and the pieces of later turns and branches go to the rank holding the least
of their path, so that a member whose own history grows long keeps it spread; a rank stores the attention K/V, MLA
rows and DSA index keys of its own positions, ``state / N`` (± a chunk per path), and the state records each chunk's
owner — and ``GroupTransport`` carries the messages over the process group.
``ContextParallel`` holds one of each (what ``Engine(shards=...)`` takes). Two schedules use them (the engine picks
one per call; docs/distributed.md):

- **Sharded compute** (a capture, and exact mode's reverse walk over it): each rank evaluates only its own chunks,
  a run (its consecutive chunks) and a layer at a time, and the ranks meet in a wavefront through point-to-point
  messages (``send`` / ``recv``): a layer's earlier rows go from the ranks that hold them to the ranks whose runs
  read them (forward), their K/V gradient comes back to the owner (backward), GatedDeltaNet states and their
  gradients pass from run to run; the owners ``broadcast_tensors`` the recurrent states every rank's later work reads.
- **Replicated compute** (short extends: turns, branch replays): every rank computes the same tokens and the
  collectives below combine what each contributes, all called by every rank in the same order:

  - attention (``merge_partials``): each rank attends to its own blocks; the partials ``(out, lse)`` are
    all-gathered and merged by log-sum-exp in rank order (an all-gather rather than a ring: the queries are
    replicated, so one collective per layer and chunk gives every rank the result, and K/V stays in place); in
    backward each rank adds its blocks' ``dq`` and the sum is all-reduced (``sum_``), while ``dK``/``dV`` stay in
    the owner's state gradient;
  - DSA (``merge_topk``): each rank selects the top-k over its shard; the candidates are all-gathered and merged
    into the global top-k (ties to the earlier position, as in one process);
  - a replicated reverse walk (``broadcast``): the gradient waiting for a chunk's K/V lives on its owner and is
    broadcast before the replicated recomputation backpropagates it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from longstraw_agents.attention import merge
from longstraw_agents.engine.schedule import cut_runs

_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool)


@dataclass
class BalancedOwnership:
    """The engine's ``Ownership``: every path's positions spread evenly over the ranks.

    - A sharded extend (a capture; ``Engine.sharded`` says which) is cut into runs of ``n / 2N`` positions (within
      one), rank r computing the r-th and the (2N - 1 - r)-th (``cut_runs``): its positions and its attention work
      are even, for a prompt (a short one too, instead of sitting on the first rank), a long turn or a member's long
      history captured at once; exact mode's wavefront walk walks that cut back. With ``balanced=False``, N runs in
      rank order.
    - A replicated extend's pieces (turns, branches, decoded tokens: computed by every rank) go one by one to the
      rank that holds the fewest positions of the path so far: a member whose own history grows turn by turn keeps
      it spread over every rank, within a piece per rank of even. Ties go to the rank given the fewest positions
      this way so far (then the lowest): the G members of a group, whose paths are alike, put their turns on
      different ranks, so that the ranks' memory stays even too (every rank makes the same calls: the counts agree).
    """

    rank: int
    size: int
    given: list[int] = field(default_factory=list)  # positions assign gave each rank so far

    def __post_init__(self) -> None:
        self.given = self.given or [0] * self.size

    def cut(self, n: int, balanced: bool = True) -> list[tuple[int, int, int]]:
        return cut_runs(n, self.size, balanced)

    def assign(self, held: Sequence[int], lengths: Sequence[int]) -> list[int]:
        held, owners = list(held), []
        for length in lengths:
            owner = min(range(self.size), key=lambda r: (held[r], self.given[r], r))
            owners.append(owner)
            held[owner] += length
            self.given[owner] += length
        return owners

    def state_dict(self) -> dict[str, Any]:
        return {"size": self.size, "given": list(self.given)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["size"] != self.size:
            raise ValueError(f"an ownership over {state['size']} ranks does not resume over {self.size}")
        self.given = list(state["given"])


class PairChannels:
    """A communicator of its own for each ordered pair of ranks of a group: the point-to-point messages from rank
    ``a`` to rank ``b`` travel alone on ``channel(a, b)``, in posting order.

    NCCL runs a communicator's operations in posting order and matches a pair's sends and receives by order alone,
    so on one communicator the wavefront's rows (to later ranks), their gradients (back to earlier ones) and the
    FSDP gathers between them would wait for each other (``parallel.discipline`` finds those cycles). On a channel
    of one sender and one receiver, the only order that matters is the order of that pair's messages, which the
    sender posts in the order the receiver takes them.

    ``over`` makes them with ``torch.distributed.new_group``, which every process of the job calls in the same
    order: for every group of a mesh dimension at once (``ParallelMesh`` does), or for a group that is the whole
    job. Made once per job and group (cached)."""

    _made: dict[tuple[int, tuple[tuple[int, ...], ...]], PairChannels] = {}

    def __init__(self, channels: dict[tuple[int, int], dist.ProcessGroup]):
        self._channels = channels  # (sending global rank, receiving global rank) -> its communicator

    @classmethod
    def over(cls, groups: Sequence[Sequence[int]]) -> PairChannels:
        """The channels of every ordered pair in each of ``groups`` (global ranks; every process passes them all)."""
        key = (id(dist.group.WORLD), tuple(tuple(g) for g in groups))
        if key not in cls._made:
            me, channels = dist.get_rank(), {}
            for ranks in key[1]:
                for a in ranks:
                    for b in ranks:
                        if a == b:
                            continue
                        group = dist.new_group([a, b])  # a collective call of every process, members or not
                        if me in (a, b):
                            channels[a, b] = group
            cls._made[key] = cls(channels)
        return cls._made[key]

    @classmethod
    def of(cls, group: dist.ProcessGroup) -> PairChannels:
        """The channels of ``group``, which must span the whole job (a sub-group's are made for every group of its
        mesh dimension at once: ``ParallelMesh.context_parallel``)."""
        ranks = dist.get_process_group_ranks(group)
        if len(ranks) != dist.get_world_size():
            raise ValueError(
                f"the pair channels of a group of {len(ranks)} of {dist.get_world_size()} processes are made by "
                "every process for every group of its mesh dimension: pass channels=PairChannels.over(...) "
                "(ParallelMesh.context_parallel does)"
            )
        return cls.over([ranks])

    def channel(self, src: int, dst: int) -> dist.ProcessGroup:
        """The communicator of messages from global rank ``src`` to global rank ``dst``."""
        return self._channels[src, dst]


class ContextParallel:
    """The engine's ``StateShards`` over ``group`` (the ``cp`` dimension of a ``ParallelMesh``): who stores which
    positions (``ownership``) and the messages between the ranks (``transport``: collectives on ``group``,
    point-to-point messages on ``channels``, by default ``PairChannels.of(group)``; ``host_staged``: see
    ``GroupTransport``)."""

    def __init__(self, group: dist.ProcessGroup, channels: PairChannels | None = None, host_staged: bool = False):
        self.transport = GroupTransport(group, channels, host_staged)
        self.ownership = BalancedOwnership(self.transport.rank, self.transport.size)


class GroupTransport:
    """The engine's ``Transport`` over a process group: collectives, point-to-point messages and broadcasts, with
    the bytes this rank sent by kind (``sent_bytes``) and the time it waited for others (``waited_s``). The
    point-to-point messages travel on ``channels`` (a communicator per ordered pair: ``PairChannels``).

    A message's payload travels where its tensors are: device tensors device to device (NCCL under
    ``parallel.launch``'s ``cpu:gloo,cuda:nccl``), host tensors over gloo; its length and header always on the host
    (the receiver allocates from them without waiting for its device). NCCL matches a pair's messages in posting
    order, which a pair channel's single sender keeps (``PairChannels``; every distributed test checks it with
    ``parallel.discipline``). ``host_staged``: copy every payload to host memory first and send it over gloo, which
    matches by tag (the schedule as it was built on CPUs; a fallback where device messages misbehave)."""

    def __init__(self, group: dist.ProcessGroup, channels: PairChannels | None = None, host_staged: bool = False):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.channels = channels if channels is not None else PairChannels.of(group)
        self.host_staged = host_staged
        self._me = dist.get_global_rank(group, self.rank)
        # this rank's sends, by what they carry
        kinds = ["partials", "dq", "topk", "state_grad", "rows", "parent_rows", "context_rows", "recurrent"]
        kinds += ["param_grads", "metrics"]
        self.sent_bytes: dict[str, int] = dict.fromkeys(kinds, 0)
        self.waited_s = 0.0  # time blocked in point-to-point receives and broadcasts (idle, in a wavefront)
        # per kind, the messages in flight: each one's works and the tensors they read (kept alive until done)
        self._pending: dict[str, list[tuple[list[dist.Work | None], list[Tensor]]]] = {}

    def merge_partials(
        self, acc: tuple[Tensor, Tensor] | None, out_shape: tuple[int, ...], lse: Tensor
    ) -> tuple[Tensor, Tensor]:
        if acc is None:  # this rank holds none of the keys: a partial that weighs nothing
            acc = (lse.new_zeros(out_shape), torch.full_like(lse, float("-inf")))
        outs = [torch.empty_like(acc[0]) for _ in range(self.size)]
        lses = [torch.empty_like(acc[1]) for _ in range(self.size)]
        dist.all_gather(outs, acc[0].contiguous(), group=self.group)
        dist.all_gather(lses, acc[1].contiguous(), group=self.group)
        self.sent_bytes["partials"] += _nbytes(acc[0]) + _nbytes(acc[1])
        merged = None
        for out, part_lse in zip(outs, lses, strict=True):  # rank order: the same result on every rank
            merged = merge(merged, out, part_lse)
        assert merged is not None
        return merged

    def sum_(self, tensor: Tensor, kind: str) -> Tensor:
        dist.all_reduce(tensor, group=self.group)
        self.sent_bytes[kind] += _nbytes(tensor)
        return tensor

    def broadcast(self, tensor: Tensor, src: int) -> Tensor:
        dist.broadcast(tensor, src=dist.get_global_rank(self.group, src), group=self.group)
        if src == self.rank:
            self.sent_bytes["state_grad"] += _nbytes(tensor)
        return tensor

    def merge_topk(
        self, running: tuple[Tensor, Tensor] | None, n: int, k: int, like: Tensor
    ) -> tuple[Tensor, Tensor] | None:
        """Pad each rank's candidates to ``k`` (score -inf, position -1: never visible), all-gather them, and keep
        the best ``k``, earlier positions first on ties (as one process: a rank's positions need not all precede
        the next rank's)."""
        scores = torch.full((n, k), float("-inf"), dtype=like.dtype, device=like.device)
        positions = torch.full((n, k), -1, dtype=torch.long, device=like.device)
        if running is not None:
            scores[:, : running[0].shape[1]] = running[0]
            positions[:, : running[1].shape[1]] = running[1]
        all_scores = [torch.empty_like(scores) for _ in range(self.size)]
        all_positions = [torch.empty_like(positions) for _ in range(self.size)]
        dist.all_gather(all_scores, scores, group=self.group)
        dist.all_gather(all_positions, positions, group=self.group)
        self.sent_bytes["topk"] += _nbytes(scores) + _nbytes(positions)
        cat_scores, cat_positions = torch.cat(all_scores, 1), torch.cat(all_positions, 1)
        by_position = torch.sort(cat_positions, dim=1, stable=True).indices  # then by score, stably: ties by position
        cat_scores, cat_positions = cat_scores.gather(1, by_position), cat_positions.gather(1, by_position)
        order = torch.sort(cat_scores, dim=1, descending=True, stable=True).indices[:, :k]
        return cat_scores.gather(1, order), cat_positions.gather(1, order)

    # --- point to point (the wavefront) and broadcasts of tensors of any shape ---------------------------------
    # A message is its header's length (one int64), the header (count, then per tensor dtype code, whether it is on
    # the device, ndim, dims) and the tensors.
    def stage(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """``tensors`` as ``send`` sends them: host copies where messages are staged through host memory, else the
        tensors themselves. A message for several ranks is staged once (``send`` leaves host tensors as they
        are)."""
        return [t.detach().to("cpu") if self.host_staged else t.detach() for t in tensors]

    def send(self, tensors: Sequence[Tensor], dst: int, tag: int, kind: str) -> None:
        """Start sending ``tensors`` (any dtypes and shapes) to rank ``dst`` of the group; ``flush`` waits for it.
        ``kind``: what they carry, for ``sent_bytes``. Until then the tensors must not change (device payloads are
        read in place: views of the state's arenas, whose rows a schedule never rewrites)."""
        peer = dist.get_global_rank(self.group, dst)
        channel = self.channels.channel(self._me, peer)
        payload = [t.contiguous() for t in self.stage(tensors)]
        header = _header(payload)
        message = [torch.tensor([header.numel()]), header, *payload]
        works = [dist.isend(t, peer, group=channel, tag=tag) for t in message]
        self._pending.setdefault(kind, []).append((works, message))
        self.sent_bytes[kind] += sum(_nbytes(t) for t in payload)

    def recv(self, src: int, tag: int, device: torch.device, on_host: int = 0) -> tuple[Tensor, ...]:
        """What rank ``src`` sent with ``tag`` (blocks until its host part arrives; a device payload's receive is
        queued on the device, which ``waited_s`` does not see), on ``device`` but its first ``on_host`` tensors."""
        peer = dist.get_global_rank(self.group, src)
        channel = self.channels.channel(peer, self._me)
        began = time.perf_counter()
        length = torch.empty(1, dtype=torch.int64)
        dist.recv(length, peer, group=channel, tag=tag)
        header = torch.empty(int(length), dtype=torch.int64)
        dist.recv(header, peer, group=channel, tag=tag)
        out = []
        for k, (dtype, on_device, shape) in enumerate(_parse(header)):
            t = torch.empty(shape, dtype=dtype, device=device if on_device else "cpu")
            dist.recv(t, peer, group=channel, tag=tag)
            out.append(t if k < on_host or on_device else t.to(device))
        self.waited_s += time.perf_counter() - began
        return tuple(out)

    def flush(self, kind: str | None = None, keep: int = 0) -> None:
        """Wait until the sends this rank started (of ``kind``, or all) have been received, all but the last
        ``keep`` messages (a window: their buffers are freed, the latest may still be on their way)."""
        began = time.perf_counter()
        for name in [kind] if kind is not None else list(self._pending):
            messages = self._pending.get(name, [])
            while len(messages) > keep:
                works, _ = messages.pop(0)
                for work in works:
                    if work is not None:  # (None: the peer is this rank; never here)
                        work.wait()
        self.waited_s += time.perf_counter() - began

    def broadcast_tensors(self, tensors: Sequence[Tensor] | None, src: int, device: torch.device) -> tuple[Tensor, ...]:
        """Rank ``src``'s ``tensors`` (any dtypes and shapes; None on the other ranks) on every rank: on ``device``
        where the sender's are on a device, on the host where its are (the collective then runs over gloo on every
        rank alike)."""
        peer = dist.get_global_rank(self.group, src)
        began = time.perf_counter()
        header = _header(list(tensors)) if tensors is not None else None
        length = torch.tensor([header.numel() if header is not None else 0])
        dist.broadcast(length, src=peer, group=self.group)
        if header is None:
            header = torch.empty(int(length), dtype=torch.int64)
        dist.broadcast(header, src=peer, group=self.group)
        if tensors is not None:
            out = tuple(t.contiguous() for t in tensors)
            self.sent_bytes["recurrent"] += sum(_nbytes(t) for t in out)
        else:
            parsed = _parse(header)  # (each where the sender's is: host tensors stay on the host, over gloo)
            out = tuple(torch.empty(shape, dtype=dtype, device=device if on else "cpu") for dtype, on, shape in parsed)
        for t in out:
            dist.broadcast(t, src=peer, group=self.group)
        self.waited_s += time.perf_counter() - began
        return out


def _header(tensors: Sequence[Tensor]) -> Tensor:
    """The int64 header that lets a receiver allocate ``tensors``: count, then (dtype code, on the device, ndim,
    *shape) each."""
    slots = [len(tensors)]
    for t in tensors:
        slots += [_DTYPES.index(t.dtype), int(t.device.type != "cpu"), t.dim(), *t.shape]
    return torch.tensor(slots, dtype=torch.int64)


def _parse(header: Tensor) -> list[tuple[torch.dtype, bool, tuple[int, ...]]]:
    """``_header``'s tensors: (dtype, whether the sender's was on a device, shape) each."""
    slots = header.tolist()
    found, at = [], 1
    for _ in range(slots[0]):
        dtype, on_device, ndim = _DTYPES[slots[at]], bool(slots[at + 1]), slots[at + 2]
        found.append((dtype, on_device, tuple(slots[at + 3 : at + 3 + ndim])))
        at += 3 + ndim
    return found


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()
