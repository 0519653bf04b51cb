"""Joining a job started by ``torchrun`` or ``accelerate launch``, on one node or several: both set ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` for every process (and ``GROUP_RANK``, the node's rank,
``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``), and the default process group is built from them here — before accelerate
would build it with its own defaults — so that the collective timeout is the run's. Global ranks place a process in
the mesh; its local rank picks its GPU on its node.

Every process first signs a roster in the job's store (``Roster``: its node, host and a liveness address) and waits
for the others' signatures: a node whose processes never start (a crash at start-up, a missing file, a launcher
that did not join) is named after ``timeout_s`` by every process that did, before any process group exists.

The timeout is also what turns a dead or hung rank into an error on the others: with gloo every collective waits at
most ``timeout_s`` and then raises on each surviving rank (with nccl the watchdog aborts the communicator after it);
a rank that exits closes its connections, and the others' next collective fails at once. ``failing_clearly`` turns
those transport errors (gloo's "Timed out waiting 3000ms for recv operation", "Connection reset by peer") into a
``RankFailure`` that says what was going on, which processes are gone (their liveness address refuses connections)
and which setting bounds the wait.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from itertools import groupby

import torch
import torch.distributed as dist

ROSTER_KEY = "longstraw/roster/"  # in the job's store: one entry per rank
PROBE_TIMEOUT_S = 5.0
"""How long a liveness probe waits for a connection: a live process's kernel answers in milliseconds, so a node
that does not within this is unreachable."""


def world_size() -> int:
    """The number of processes the launcher started (1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def processes_per_node() -> int:
    """The processes the launcher started on this node (``LOCAL_WORLD_SIZE``; without it, every process)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size())))


def backend() -> str:
    """gloo for CPU tensors, and nccl for CUDA ones where there is CUDA."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


@dataclass(frozen=True)
class Place:
    """Where a process of the job runs: its global rank, its node (the launcher's node rank: torchrun's
    ``GROUP_RANK``, accelerate's ``--machine_rank``), its rank on that node and the host's name (None for a process
    that never said: one that did not join)."""

    rank: int
    node: int = 0
    local_rank: int = 0
    host: str | None = None

    @classmethod
    def here(cls) -> Place:
        """This process's place, from the launcher's environment."""
        env = os.environ
        return cls(int(env.get("RANK", "0")), int(env.get("GROUP_RANK", "0")), int(env.get("LOCAL_RANK", "0")), _host())

    def __str__(self) -> str:
        return f"rank {self.rank} ({_node_text(self.node, self.host)})"


def describe(places: Sequence[Place]) -> str:
    """Processes grouped by node: ``ranks 2, 3 (node 1, host b); rank 5 (node 2, host c)``."""
    parts = []
    for (node, host), members in groupby(sorted(places, key=lambda p: (p.node, p.rank)), lambda p: (p.node, p.host)):
        ranks = [p.rank for p in members]
        label = "rank" if len(ranks) == 1 else "ranks"
        parts.append(f"{label} {', '.join(map(str, ranks))} ({_node_text(node, host)})")
    return "; ".join(parts)


def _node_text(node: int, host: str | None) -> str:
    return f"node {node}" if host is None else f"node {node}, host {host}"


def _host() -> str:
    return socket.gethostname()


class RankFailure(RuntimeError):
    """Another rank died, hung past the collective timeout, or never joined, while this one waited for it."""


@dataclass
class Roster:
    """Every process of the job: where it runs, and the address of its liveness listener — a socket each process
    listens on for as long as it lives. Connecting to it is refused once the process is gone (the kernel closes its
    sockets), while a process that merely hangs still accepts (the kernel completes the handshake without it), so
    after a failed collective the survivors can say who is gone."""

    me: Place
    places: list[Place]
    addresses: list[tuple[str, int]]
    listener: socket.socket

    @classmethod
    def sign(cls, store: dist.Store, world: int, timeout_s: float) -> Roster:
        """Add this process to the roster in ``store`` and wait for the other ``world - 1``; a ``RankFailure`` naming
        the processes that did not sign within ``timeout_s``."""
        me = Place.here()
        host, family = _address_towards(os.environ.get("MASTER_ADDR", "127.0.0.1"))
        listener = socket.create_server(("", 0), family=family, backlog=max(world, 16))
        entry = {"node": me.node, "local_rank": me.local_rank, "host": me.host, "address": host}
        store.set(f"{ROSTER_KEY}{me.rank}", json.dumps({**entry, "port": listener.getsockname()[1]}))
        keys = [f"{ROSTER_KEY}{rank}" for rank in range(world)]
        try:
            store.wait(keys, timedelta(seconds=timeout_s))
        except dist.DistError:  # a timeout, or the store's host gone
            listener.close()
            raise RankFailure(
                f"{me} waited parallel.timeout_s={timeout_s:g} s for the job's {world} processes to join: "
                f"{_absent(store, keys)} (see that node's log: its processes failed before joining, or did not "
                "start)"
            ) from None
        entries = [json.loads(value) for value in store.multi_get(keys)]
        places = [Place(rank, e["node"], e["local_rank"], e["host"]) for rank, e in enumerate(entries)]
        return cls(me, places, [(e["address"], e["port"]) for e in entries], listener)

    def gone(self) -> list[Place]:
        """The other processes whose liveness listener refuses a connection, or does not answer (their node is
        unreachable) within ``PROBE_TIMEOUT_S``."""
        others = [rank for rank in range(len(self.places)) if rank != self.me.rank]
        if not others:
            return []
        with ThreadPoolExecutor(max_workers=min(len(others), 64)) as pool:
            alive = list(pool.map(lambda rank: _answers(self.addresses[rank]), others))
        return [self.places[rank] for rank, answered in zip(others, alive, strict=True) if not answered]

    def close(self) -> None:
        self.listener.close()


def _absent(store: dist.Store, keys: Sequence[str]) -> str:
    """Who did not sign the roster (their nodes as the launchers number them: a node's processes on consecutive
    ranks)."""
    try:
        missing = [rank for rank, key in enumerate(keys) if not store.check([key])]
    except dist.DistError:
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        return f"the job's store at {where} stopped answering (the node that hosts it is gone)"
    if not missing:
        return "the last of them joined just as the wait ended"
    per_node = processes_per_node()
    return f"{describe([Place(rank, node=rank // per_node) for rank in missing])} did not"


def _address_towards(master: str) -> tuple[str, socket.AddressFamily]:
    """This node's address on the route to ``master`` (the interface the other nodes reach it by) and its family.
    A UDP socket's ``connect`` sends nothing: it only picks the route."""
    family, _, _, _, target = socket.getaddrinfo(master, 1, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(target)
        return str(probe.getsockname()[0]), family


EXIT_GRACE_S = 1.0
"""How long a failed collective waits for an exiting peer's liveness listener to close: a process's sockets close
in an order its kernel picks, so its collective connections can fail before its listener stops answering."""


def _gone(roster: Roster) -> list[Place]:
    """``roster.gone()``, probed again over ``EXIT_GRACE_S`` while every other process still answers."""
    deadline = time.monotonic() + EXIT_GRACE_S
    gone = roster.gone()
    while not gone and time.monotonic() < deadline:
        time.sleep(0.1)
        gone = roster.gone()
    return gone


def _answers(address: tuple[str, int]) -> bool:
    try:
        with socket.create_connection(address, timeout=PROBE_TIMEOUT_S):
            return True
    except OSError:  # refused (the process is gone), or no answer (its node is)
        return False


def init_from_env(timeout_s: float) -> Roster | None:
    """Initialise the default process group from the launcher's environment, collectives timing out after
    ``timeout_s``, once every process has signed the roster; returns the roster (None for one process, or when a
    group already exists: no roster then)."""
    if dist.is_initialized() or world_size() == 1:
        return None
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # the GPU of this node's process
    timeout = timedelta(seconds=timeout_s)
    try:  # torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE), else rank 0 does
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    except dist.DistError as err:
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        raise RankFailure(
            f"{Place.here()} could not meet the job's other processes through its store at {where} within "
            f"parallel.timeout_s={timeout_s:g} s: {err}"
        ) from None
    roster = Roster.sign(store, world, timeout_s)
    with failing_clearly("joining the process group", timeout_s, roster):
        # the key prefix torch's own env:// initialisation gives the default group
        dist.init_process_group(
            backend(), store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world, timeout=timeout
        )
    return roster


def is_collective_failure(err: BaseException) -> bool:
    """An error of the communication backend (a peer gone or silent), not of the computation around it."""
    if isinstance(err, dist.DistError):
        return True
    text = str(err)
    return any(mark in text for mark in ("gloo/transport", "Timed out waiting", "Connection reset by peer", "NCCL"))


@contextlib.contextmanager
def failing_clearly(what: str | Callable[[], str], timeout_s: float, roster: Roster | None = None) -> Iterator[None]:
    """Re-raise a collective's failure inside the block as a ``RankFailure`` naming ``what`` (or what it returns
    then: e.g. the step that was running), this process's place, the processes that are gone (with a ``roster``)
    and the timeout."""
    try:
        yield
    except RuntimeError as err:
        if isinstance(err, RankFailure) or not is_collective_failure(err):
            raise
        doing = what if isinstance(what, str) else what()
        raise RankFailure(
            f"{doing}: {_me(roster)} gave up on the other ranks: {_who_failed(roster, timeout_s)}. The checkpoint and "
            f"the store hold only whole steps and whole groups; resume with --resume. Backend error: {err}"
        ) from err


def _me(roster: Roster | None) -> str:
    if roster is not None:
        return str(roster.me)
    return f"rank {dist.get_rank() if dist.is_initialized() else 0}"


def _who_failed(roster: Roster | None, timeout_s: float) -> str:
    """The gone processes, or what the silence means when every process is still there."""
    within = f"parallel.timeout_s={timeout_s:g} s"
    if roster is None:
        return (
            f"one of them died, or did not answer within {within} (raise it if a rank legitimately needs longer "
            "between collectives)"
        )
    gone = _gone(roster)
    if gone:
        are = "is" if len(gone) == 1 else "are"
        return f"{describe(gone)} {are} gone (exited or killed, or their node is unreachable)"
    return (
        f"every other process is still running, so one of them hangs, or did not answer within {within} (raise it "
        "if a rank legitimately needs longer between collectives)"
    )
