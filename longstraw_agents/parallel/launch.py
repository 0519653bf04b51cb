"""Joining a job started by ``torchrun`` or ``accelerate launch``, on one node or several: both set ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` for every process (and ``GROUP_RANK``, the node's rank,
``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``), and the default process group is built from them here — before accelerate
would build it with its own defaults — so that the collective timeout is the run's. Global ranks place a process in
the mesh; its local rank picks its GPU on its node.

Every process first signs a roster in the job's store (``Roster``: its node, host and a liveness address) and waits
for the others' signatures: a node whose processes never start (a crash at start-up, a missing file, a launcher
that did not join) is named after ``timeout_s`` by every process that did, before any process group exists.

Once joined, a process that dies ends the others, however it dies, while a slow one ends nothing:

- a rank that exits or is killed closes its connections, and the others' next collective with it fails at once;
- a rank whose node is lost without closing them (power, network) stops its ``Heartbeat`` (``liveness``): after
  ``timeout_s`` without one, every other process ends with a ``RankFailure`` naming it. A collective blocked on it
  cannot be interrupted on gloo, so the heartbeat's thread prints the failure (as the CLI prints errors) and ends
  the process; SQLite's transactions and the checkpoint's rename keep what it wrote whole;
- a process whose launcher died (its node killed, ``kill -9`` of the launcher's process group, which torchrun's
  workers are not in) ends too, so that the others see it go instead of an orphan training on;
- while every process beats, a collective waits up to ``collective_s`` (the longest gap a healthy run may have
  between collectives: a rollout's slow tool calls, a checkpoint), which bounds only a rank that hangs.

``failing_clearly`` turns the transport's errors (gloo's "Connection closed by peer", "Timed out waiting 1800000ms
for recv operation") into a ``RankFailure`` that says what was going on, which processes are gone (their liveness
address refuses connections) or that none is (a hang), and which setting bounds the wait.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from itertools import groupby

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from longstraw_agents.parallel.discipline import record_from_env
from longstraw_agents.parallel.liveness import Heartbeat, Silence, announce, supervising_launcher

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
    """Another rank died, fell silent, hung past the collective timeout, or never joined, while this one waited for
    it; or this process's launcher died."""


RESUME_ADVICE = "The checkpoint and the store hold only whole steps and whole groups; resume with --resume."
FAILURE_EXIT_CODE = 2  # the CLI's for an error


@dataclass(frozen=True)
class Timeouts:
    """How long a job's processes wait for each other (``parallel``'s settings): ``liveness_s`` for every process
    to join, and for a process's next heartbeat before it is dead (``timeout_s``); ``heartbeat_s`` between two
    heartbeats; ``collective_s`` for a collective while every process beats (``collective_timeout_s``)."""

    liveness_s: float
    heartbeat_s: float = 5.0
    collective_s: float = 1800.0


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
    heartbeat: Heartbeat | None = None
    doing: list[str | Callable[[], str]] = field(default_factory=list)
    """What this process is doing (``failing_clearly``'s blocks, innermost last), for a failure found meanwhile."""

    @classmethod
    def sign(cls, store: dist.Store, world: int, timeout_s: float) -> Roster:
        """Add this process to the roster in ``store`` and wait for the other ``world - 1``; a ``RankFailure`` naming
        the processes that did not sign within ``timeout_s``."""
        me = Place.here()
        host, family = _address_towards(os.environ.get("MASTER_ADDR", "127.0.0.1"))
        listener = socket.create_server(("", 0), family=family, backlog=max(world, 16))
        entry = {"node": me.node, "local_rank": me.local_rank, "host": me.host, "address": host}
        announce(store, me.rank)  # its heartbeat's counter exists once the roster is whole
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

    def beat(self, store: dist.Store, timeouts: Timeouts) -> None:
        """Start this process's heartbeat (every process has announced its counter: ``announce``, before signing)."""
        world = len(self.places)
        self.heartbeat = Heartbeat(
            store,
            self.me.rank,
            world,
            timeouts.heartbeat_s,
            timeouts.liveness_s,
            self._end_on_silence,
            launcher_pid=supervising_launcher(),
            on_launcher_gone=self._end_with_launcher,
        ).start()

    def _end_on_silence(self, silence: Silence) -> None:
        """The heartbeat found a silent peer or store: print the failure and end this process (a collective blocked
        on a silent peer cannot be interrupted)."""
        assert self.heartbeat is not None
        timeout = f"parallel.timeout_s={self.heartbeat.timeout_s:g}"
        if silence.store_error is None:
            silent = [self.places[rank] for rank in silence.ranks]
            why = (
                f"{describe(silent)} sent no heartbeat for {silence.seconds:.0f} s ({timeout}: its process died or "
                "froze, or its node is unreachable)"
            )
        else:
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            gone = self.gone()
            who = f"{describe(gone)} {'is' if len(gone) == 1 else 'are'} gone" if gone else "its host is unreachable"
            why = f"the job's store at {where} has not answered for {silence.seconds:.0f} s ({timeout}): {who}"
        _end_process(RankFailure(f"{self._doing()}: {self.me} gave up on the other ranks: {why}. {RESUME_ADVICE}"))

    def _end_with_launcher(self, pid: int) -> None:
        _end_process(
            RankFailure(
                f"{self._doing()}: {self.me} lost its launcher (pid {pid}: its node was killed, or the launcher "
                f"alone), so it ends too and the other ranks stop. {RESUME_ADVICE}"
            )
        )

    def _doing(self) -> str:
        doing = list(self.doing)  # (the main thread enters and leaves blocks meanwhile)
        what = doing[-1] if doing else "joining the job"
        return what if isinstance(what, str) else what()

    def close(self) -> None:
        """Stop the heartbeat, marking this process as gone of its own accord, and the liveness listener."""
        if self.heartbeat is not None:
            self.heartbeat.stop(left=True)
        self.listener.close()


def _end_process(failure: RankFailure) -> None:
    print(f"error: {failure}", file=sys.stderr, flush=True)
    os._exit(FAILURE_EXIT_CODE)


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


def init_from_env(timeouts: Timeouts) -> Roster | None:
    """Initialise the default process group from the launcher's environment once every process has signed the
    roster (within ``timeouts.liveness_s``), and start this process's heartbeat; collectives time out after
    ``timeouts.collective_s``. Returns the roster (None for one process, or when a group already exists: no roster
    then). With ``LONGSTRAW_COMM_LOG=<dir>`` set, this process's process group calls are recorded into ``<dir>`` from
    here on (``discipline.record_from_env``: the checker of NCCL's matching discipline; a launcher's children
    inherit the variable)."""
    record_from_env()
    if dist.is_initialized() or world_size() == 1:
        return None
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # the GPU of this node's process
    try:  # torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE), else rank 0 does
        store, rank, world = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeouts.liveness_s)))
    except dist.DistError as err:
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        raise RankFailure(
            f"{Place.here()} could not meet the job's other processes through its store at {where} within "
            f"parallel.timeout_s={timeouts.liveness_s:g} s: {err}"
        ) from None
    roster = Roster.sign(store, world, timeouts.liveness_s)
    roster.beat(store, timeouts)
    with failing_clearly("joining the process group", timeouts.collective_s, roster):
        # the key prefix torch's own env:// initialisation gives the default group
        dist.init_process_group(
            backend(),
            store=dist.PrefixStore("default_pg", store),
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeouts.collective_s),
        )
    return roster


def bound_collectives(timeout_s: float) -> None:
    """Make every process group this process is in time out after ``timeout_s``: torch gives the groups made
    after the default one (a device mesh's, ``new_group``'s) its own default (30 min on gloo, 10 on nccl) instead of
    the default group's. Called once the run's groups are made (a group made later keeps torch's)."""
    timeout = timedelta(seconds=timeout_s)
    for group in list(distributed_c10d._world.pg_names):  # torch lists its groups nowhere public
        distributed_c10d._set_pg_timeout(timeout, group)


def is_collective_failure(err: BaseException) -> bool:
    """An error of the communication backend (a peer gone or silent), not of the computation around it."""
    if isinstance(err, dist.DistError):
        return True
    text = str(err)
    return any(mark in text for mark in ("gloo/transport", "Timed out waiting", "Connection reset by peer", "NCCL"))


@contextlib.contextmanager
def failing_clearly(
    what: str | Callable[[], str], collective_timeout_s: float, roster: Roster | None = None
) -> Iterator[None]:
    """Re-raise a collective's failure inside the block as a ``RankFailure`` naming ``what`` (or what it returns
    then: e.g. the step that was running), this process's place, the processes that are gone (with a ``roster``,
    whose heartbeat names ``what`` too if it ends the process meanwhile) or the collective timeout."""
    if roster is not None:
        roster.doing.append(what)
    try:
        yield
    except RuntimeError as err:
        if isinstance(err, RankFailure) or not is_collective_failure(err):
            raise
        doing = what if isinstance(what, str) else what()
        raise RankFailure(
            f"{doing}: {_me(roster)} gave up on the other ranks: {_who_failed(roster, collective_timeout_s)}. "
            f"{RESUME_ADVICE} Backend error: {err}"
        ) from err
    finally:
        if roster is not None:
            roster.doing.pop()


def _me(roster: Roster | None) -> str:
    if roster is not None:
        return str(roster.me)
    return f"rank {dist.get_rank() if dist.is_initialized() else 0}"


def _who_failed(roster: Roster | None, collective_timeout_s: float) -> str:
    """The gone processes, or what the wait means when every process is still there."""
    within = f"parallel.collective_timeout_s={collective_timeout_s:g} s"
    raise_it = "raise it if a rank legitimately needs longer between collectives, e.g. for a slow tool call"
    if roster is None:
        return f"one of them died, or did not answer within {within} ({raise_it})"
    gone = _gone(roster)
    if gone:
        are = "is" if len(gone) == 1 else "are"
        return f"{describe(gone)} {are} gone (exited or killed, or their node is unreachable)"
    return f"every other process is still running, so one of them hangs: it did not answer within {within} ({raise_it})"
