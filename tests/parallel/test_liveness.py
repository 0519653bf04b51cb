"""parallel/liveness.py: a peer is silent when its counter has not moved for the timeout between this process's own
reads (whenever it moved, and however late those reads came), and never once it left; heartbeats through a real
TCPStore in this process find a peer that stopped beating and a store that went away."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch.distributed as dist

from longstraw_agents.parallel.liveness import LEFT, Heartbeat, PeerClocks, Silence, announce

WAIT_S = 30.0  # generous: a bound against hangs, never reached by a working watch


def test_a_peer_is_silent_when_its_counter_stands_still_for_the_timeout() -> None:
    clocks = PeerClocks([1, 2], now=0.0)
    assert clocks.read([b"0", b"0"], now=1.0, timeout_s=5.0) == {}
    assert clocks.read([b"1", b"0"], now=4.0, timeout_s=5.0) == {}  # rank 1 moved at 4
    assert clocks.read([b"1", b"0"], now=5.0, timeout_s=5.0) == {}  # rank 2 quiet since the first read, at 1
    assert clocks.read([b"1", b"0"], now=8.5, timeout_s=5.0) == {2: 7.5}
    # A watch that was itself held up for long sees the counters that moved meanwhile as alive.
    assert clocks.read([b"9", b"3"], now=60.0, timeout_s=5.0) == {}


def test_a_peer_that_left_is_never_silent() -> None:
    clocks = PeerClocks([1, 2], now=0.0)
    clocks.read([b"4", b"4"], now=1.0, timeout_s=5.0)
    assert not clocks.someone_left
    assert clocks.read([LEFT, b"5"], now=2.0, timeout_s=5.0) == {}
    assert clocks.read([LEFT, b"6"], now=100.0, timeout_s=5.0) == {}
    assert clocks.someone_left


def _master() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


class Found:
    """The silences a heartbeat reports."""

    def __init__(self) -> None:
        self.silences: list[Silence] = []
        self.event = threading.Event()

    def __call__(self, silence: Silence) -> None:
        self.silences.append(silence)
        self.event.set()


def test_heartbeats_find_the_peer_that_stopped_beating_and_not_the_one_that_left() -> None:
    store = _master()
    for rank in range(3):
        announce(store, rank)
    found = [Found() for _ in range(3)]
    beats = [Heartbeat(store, rank, 3, 0.05, 1.0, found[rank]).start() for rank in range(3)]
    beats[2].stop(left=True)  # finished: the others do not wait for it
    beats[1].stop(left=False)  # its node gone: no last word
    assert found[0].event.wait(WAIT_S)
    [silence] = found[0].silences
    assert silence.ranks == (1,) and silence.store_error is None and silence.seconds >= 1.0
    beats[0].stop()
    assert not found[1].silences and not found[2].silences


def test_a_heartbeat_finds_its_store_gone() -> None:
    master = _master()
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=10))
    announce(client, 0)
    announce(client, 1)
    found = Found()
    beat = Heartbeat(client, 0, 2, 0.05, 1.0, found).start()
    other = Heartbeat(client, 1, 2, 0.05, 1.0, Found()).start()
    del master  # the process that hosted the store is gone
    assert found.event.wait(WAIT_S)
    [silence] = found.silences
    assert silence.ranks == () and silence.store_error is not None and silence.seconds >= 1.0
    beat.stop()
    other.stop()
