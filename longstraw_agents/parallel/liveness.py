"""Whether the other processes of a job are alive, told apart from whether they are keeping pace with this one.

A collective cannot tell a peer that is slow (its rollout waits on a tool call that takes minutes) from one that is
gone without closing its connections (its node lost power or dropped off the network): either way the transport
only times out. So every process runs a ``Heartbeat`` beside training: a daemon thread that every ``interval_s``
adds one to its own counter in the job's store and reads every other process's counter. A counter that has not
moved for ``timeout_s`` belongs to a dead process, and a store that has not answered for ``timeout_s`` to a dead job
(the store lives with node 0's launcher). Collectives may then wait as long as a healthy run needs.

As in torchelastic's c10d rendezvous (each node's agent writes a keep-alive into the rendezvous store, and a node
that misses ``keep_alive_max_attempt`` of them is dead), but per process and watched by every process, during
training. Silence is measured on this process's monotonic clock between two of its own reads (a counter that moved
is alive, whenever it moved): no clocks are compared across nodes, and a watch that was itself descheduled for a
while does not take its peers for dead. The thread talks to the store over a connection of its own
(``Store.clone``): on a shared one a blocking store call of the main thread (a group being made waits on its keys)
would hold up the beats.

A heartbeat that stops normally marks its process as left, so that the others do not take a process that finished
for a dead one. Under a torchelastic launcher (torchrun, accelerate launch) the thread also watches that launcher:
a process whose launcher died (its node killed, the launcher's process group with it) would otherwise run on,
orphaned, in a session of its own.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

HEARTBEAT_KEY = "longstraw/heartbeat/"  # in the job's store: one counter per rank
LEFT = b"left"
"""A counter's value once its process has stopped its heartbeat normally."""


def heartbeat_key(rank: int) -> str:
    return f"{HEARTBEAT_KEY}{rank}"


def announce(store: dist.Store, rank: int) -> None:
    """Create this process's counter (before the roster wait, so that every counter exists once all have signed)."""
    store.set(heartbeat_key(rank), "0")


def supervising_launcher() -> int | None:
    """The pid of the torchelastic agent that started this process (torchrun, accelerate launch), or None when
    there is none (the parent of a process that ``multiprocessing`` started is no launcher)."""
    return os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None


@dataclass(frozen=True)
class Silence:
    """What ended a watch: the ranks whose counters stopped moving, for ``seconds`` (at least ``timeout_s``); or,
    with ``store_error``, the store stopped answering ``seconds`` ago (``ranks`` empty)."""

    ranks: tuple[int, ...]
    seconds: float
    store_error: str | None = None


class PeerClocks:
    """When each peer's counter last moved, on this process's monotonic clock (as of the reads that saw it move)."""

    def __init__(self, peers: list[int], now: float):
        self.seen: dict[int, tuple[bytes | None, float]] = dict.fromkeys(peers, (None, now))

    def read(self, values: list[bytes], now: float, timeout_s: float) -> dict[int, float]:
        """Take the peers' counters read at ``now``; returns the peers silent for ``timeout_s`` or longer (and for
        how long), leaving out those that left."""
        for peer, value in zip(self.seen, values, strict=True):
            if value != self.seen[peer][0]:
                self.seen[peer] = (value, now)
        quiet = {peer: now - since for peer, (value, since) in self.seen.items() if value != LEFT}
        return {peer: seconds for peer, seconds in quiet.items() if seconds >= timeout_s}

    @property
    def someone_left(self) -> bool:
        return any(value == LEFT for value, _ in self.seen.values())


class Heartbeat:
    """Beats for ``rank`` of ``world`` and watches the others (see the module docstring). ``on_silence`` is called
    on the thread when a peer or the store falls silent, ``on_launcher_gone`` with the launcher's pid when this
    process's launcher (``launcher_pid``) is gone; the watch ends after either."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world: int,
        interval_s: float,
        timeout_s: float,
        on_silence: Callable[[Silence], None],
        *,
        launcher_pid: int | None = None,
        on_launcher_gone: Callable[[int], None] | None = None,
    ):
        self.store = store.clone()  # type: ignore[attr-defined]  # a connection of its own (missing from the stub)
        self.store.set_timeout(timedelta(seconds=timeout_s))
        self.rank = rank
        self.peers = [peer for peer in range(world) if peer != rank]
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.on_silence = on_silence
        self.launcher_pid = launcher_pid
        self.on_launcher_gone = on_launcher_gone
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"longstraw-heartbeat-{rank}", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self, left: bool = True) -> None:
        """End the beats; with ``left``, mark this process as having left normally (on a store that answers)."""
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + 1.0)  # a store call in flight ends within the store timeout
        if left:
            try:
                self.store.set(heartbeat_key(self.rank), LEFT)
            except RuntimeError:  # (DistError) the store's host is gone: nobody is left to tell
                pass

    def _run(self) -> None:
        keys = [heartbeat_key(peer) for peer in self.peers]
        answered_at = time.monotonic()
        clocks = PeerClocks(self.peers, answered_at)
        store_error: str | None = None
        while not self._stopping.wait(self.interval_s):
            if self.launcher_pid is not None and os.getppid() != self.launcher_pid:
                if self.on_launcher_gone is not None:
                    self.on_launcher_gone(self.launcher_pid)
                return
            if store_error is None:
                try:
                    self.store.add(heartbeat_key(self.rank), 1)
                    values = self.store.multi_get(keys)
                except RuntimeError as err:  # refused, closed or timed out: the connection does not come back
                    store_error = str(err).splitlines()[0]
                else:
                    answered_at = time.monotonic()
                    silent = clocks.read(values, answered_at, self.timeout_s)
                    if silent:
                        self.on_silence(Silence(tuple(silent), max(silent.values())))
                        return
                    continue
            if clocks.someone_left:  # the job is ending: its store may have ended with the process that hosted it
                return
            quiet = time.monotonic() - answered_at
            if quiet >= self.timeout_s:
                self.on_silence(Silence((), quiet, store_error))
                return
