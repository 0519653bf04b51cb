"""parallel/launch.py: a dp=2 training step in which one rank dies, hangs or falls silent at the step's first
collective (after its backward): the other rank raises a ``RankFailure`` naming the step, itself, the dead rank (or
that none died) and the setting that bounded the wait; a rank that dies or hangs is named within its bound and the
survivor can still tear down its process group, while one whose heartbeat stops (its node lost without closing its
connections) ends the survivor's process within ``parallel.timeout_s``, whatever the collective timeout. And the
roster every process signs when it joins: it names the processes that never joined, and those whose liveness
listener is closed."""

from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from data_parallel_worker import make_trainer, share, step_groups

from longstraw_agents.parallel import ParallelMesh
from longstraw_agents.parallel.launch import (
    FAILURE_EXIT_CODE,
    ROSTER_KEY,
    Place,
    RankFailure,
    Roster,
    Timeouts,
    describe,
    failing_clearly,
    init_from_env,
)

pytestmark = pytest.mark.distributed

TIMEOUT_S = 3.0  # what bounds the wait: the collective timeout, or the heartbeat's for a silent rank
LONG_S = 600.0  # a bound never reached


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _fail_at_the_first_collective(how: str, release: Path, roster: Roster) -> None:
    """Rank 1's end: exit at once; or wait without a collective until the test releases it, beating (it hangs) or
    not (its node is lost: no heartbeat, no connection closed)."""
    if how == "dies":
        os._exit(0)
    if how == "falls silent":
        assert roster.heartbeat is not None
        roster.heartbeat.stop(left=False)
    while not release.exists():
        time.sleep(0.05)
    os._exit(0)


def _worker(rank: int, port: int, out: str, how: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    AcceleratorState._reset_state(reset_partial_state=True)  # a forked child inherits the parent's 1-process state
    GradientState._reset_state()
    silent = how == "falls silent"
    timeouts = Timeouts(TIMEOUT_S if silent else LONG_S, 0.2, LONG_S if silent else TIMEOUT_S)
    roster = init_from_env(timeouts)
    assert roster is not None
    mesh = ParallelMesh.build(dp=2, cp=1)
    trainer = make_trainer("group", Accelerator(cpu=True), mesh)
    groups = share(step_groups(trainer), mesh)
    if rank == 1:  # dies, hangs or falls silent after its backward, where the gradients would be summed
        release = Path(out + ".release")
        trainer._sum_gradients_across_processes = lambda *_: _fail_at_the_first_collective(how, release, roster)
    start = time.monotonic()
    try:
        with failing_clearly("step 1", timeouts.collective_s, roster):
            trainer.train_step(groups)
    except RankFailure as err:
        result = {"error": str(err), "seconds": time.monotonic() - start}
    else:
        result = {"error": None, "seconds": time.monotonic() - start}
    dist.destroy_process_group()
    torch.save(result, out)
    Path(out + ".release").touch()


@pytest.mark.stops_a_rank("rank 1 dies or hangs before the step's first collective")
@pytest.mark.parametrize("how", ["dies", "hangs"])
def test_a_rank_that_dies_or_hangs_mid_step_gives_the_other_a_clear_error(tmp_path: Path, how: str) -> None:
    out = str(tmp_path / "rank0.pt")
    start_method = "spawn" if torch.cuda.is_initialized() else "fork"
    mp.start_processes(_worker, args=(_free_port(), out, how), nprocs=2, start_method=start_method)
    result = torch.load(out)
    assert result["error"] is not None
    assert f"step 1: rank 0 (node 0, host {socket.gethostname()}) gave up on the other ranks" in result["error"]
    if how == "dies":  # its liveness listener refuses connections: it is named
        assert f"rank 1 (node 0, host {socket.gethostname()}) is gone" in result["error"]
    else:  # its heartbeat goes on: the collective's own timeout ends the wait
        assert "every other process is still running, so one of them hangs" in result["error"]
        assert "parallel.collective_timeout_s=3 s" in result["error"]
    # Bounded by the timeout (generous margin for a loaded machine); a dead peer is noticed without waiting for it.
    assert result["seconds"] < 10 * TIMEOUT_S


@pytest.mark.stops_a_rank("rank 1 falls silent before the step's first collective")
def test_a_rank_that_falls_silent_ends_the_other_within_the_heartbeat_timeout(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Rank 0 waits in a collective that would wait 600 s; rank 1's heartbeat stops and rank 0's process ends,
    printing the failure, once rank 1 has been silent for 3 s."""
    start = time.monotonic()
    start_method = "spawn" if torch.cuda.is_initialized() else "fork"
    args = (_free_port(), str(tmp_path / "rank0.pt"), "falls silent")
    with pytest.raises(mp.ProcessExitedException) as ended:
        mp.start_processes(_worker, args=args, nprocs=2, start_method=start_method)
    assert (ended.value.error_index, ended.value.exit_code) == (0, FAILURE_EXIT_CODE)
    assert time.monotonic() - start < LONG_S / 10  # (the collective timeout never ended it)
    host = socket.gethostname()
    [line] = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error: ")]
    assert line.startswith(f"error: step 1: rank 0 (node 0, host {host}) gave up on the other ranks: rank 1 ")
    assert re.search(r"sent no heartbeat for \d+ s \(parallel.timeout_s=3: its process died or froze", line)
    assert line.endswith("resume with --resume.")


def test_the_roster_names_the_processes_that_never_joined(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 of 2 nodes of 2 processes, in a store where rank 1 signed and node 1's ranks never did."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set(f"{ROSTER_KEY}1", json.dumps({"node": 0, "local_rank": 1, "host": "a", "address": "127.0.0.1"}))
    with pytest.raises(
        RankFailure, match=r"rank 0 \(node 0, host .*\) waited .* to join: ranks 2, 3 \(node 1\) did not"
    ):
        Roster.sign(store, world=4, timeout_s=0.2)


def test_the_roster_names_the_processes_that_are_gone() -> None:
    """A process whose liveness listener is closed is gone; one that listens but never accepts (hung) is not."""
    hung = socket.create_server(("127.0.0.1", 0))
    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    places = [Place(0, 0, 0, "a"), Place(1, 0, 1, "a"), Place(2, 1, 0, "b")]
    addresses = [("127.0.0.1", 1), hung.getsockname(), ("127.0.0.1", closed_port)]
    roster = Roster(places[0], places, addresses, hung)
    try:
        assert roster.gone() == [places[2]]
        assert describe(roster.gone()) == "rank 2 (node 1, host b)"
    finally:
        roster.close()
