"""parallel/discipline.py: the analyzer on hand-written logs (a clean schedule, a three-rank wait cycle, a pair
received out of order, shape and dtype changes, collectives in different orders, a coalesced batch that makes a
cyclic exchange safe), the recorder in real gloo runs that complete by tag but break NCCL's discipline, and the
suite's check of every distributed test (tests/conftest.py)."""

from __future__ import annotations

import importlib
import json
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from discipline_worker import run

from longstraw_agents.parallel import discipline
from longstraw_agents.parallel.discipline import LOG_ENV, Violation, check, read_logs, record_from_env, record_to

pytest_plugins = ("pytester",)  # the suite's own check, run on a small suite

GROUP = {"group": "0", "ranks": [0, 1, 2]}


def send(peer: int, shape: tuple[int, ...] = (4,), dtype: str = "float32", **extra: Any) -> dict[str, Any]:
    return {"op": "send", "kind": "send", "peer": peer, "inputs": [[list(shape), dtype]], **GROUP, **extra}


def recv(peer: int, shape: tuple[int, ...] = (4,), dtype: str = "float32", **extra: Any) -> dict[str, Any]:
    return {"op": "recv", "kind": "recv", "peer": peer, "outputs": [[list(shape), dtype]], **GROUP, **extra}


def collective(kind: str, shape: tuple[int, ...] = (4,), **extra: Any) -> dict[str, Any]:
    return {"op": kind, "kind": kind, "inputs": [[list(shape), "float32"]], **GROUP, **extra}


def write_logs(directory: Path, schedule: dict[int, list[dict[str, Any]]], world: str = "w") -> Path:
    """One JSON-lines log per rank, as the recorder writes them."""
    directory.mkdir(parents=True, exist_ok=True)
    for rank, events in schedule.items():
        header = {"world": world, "rank": rank, "size": len(schedule), "pid": rank}
        lines = [json.dumps(header), *(json.dumps(event) for event in events)]
        (directory / f"rank{rank}-{world}.jsonl").write_text("\n".join(lines) + "\n")
    return directory


def kinds(violations: list[Violation]) -> list[str]:
    return [v.kind for v in violations]


# --- the analyzer on hand-written logs ---------------------------------------------------------------------------


def test_a_clean_schedule_has_no_violation(tmp_path: Path) -> None:
    """Rank 0 sends to 1 and 2, rank 1 forwards to 2, everyone all-reduces: each receive is at its sender's turn."""
    schedule = {
        0: [send(1), send(2), collective("allreduce")],
        1: [recv(0), send(2), collective("allreduce")],
        2: [recv(0), recv(1), collective("allreduce")],
    }
    assert check(write_logs(tmp_path, schedule)) == []


THREE_RANK_CYCLE = {
    0: [send(1), send(2)],
    1: [send(2), recv(0)],  # sends before receiving
    2: [recv(0), recv(1)],
}


def test_three_ranks_that_each_wait_for_the_next_form_a_cycle(tmp_path: Path) -> None:
    (violation,) = check(write_logs(tmp_path, THREE_RANK_CYCLE))
    assert violation.kind == "wait cycle"
    assert violation.communicator == "communicator '0' (ranks 0, 1, 2)"
    steps = str(violation).split("; ")
    assert steps == [
        "wait cycle on communicator '0' (ranks 0, 1, 2): rank 0 waits at #0 send to rank 1 [float32[4]] for rank 1's "
        "#1 recv from rank 0 [float32[4]]",
        "rank 1 waits at #0 send to rank 2 [float32[4]] for rank 2's #1 recv from rank 1 [float32[4]]",
        "rank 2 waits at #0 recv from rank 0 [float32[4]] for rank 0's #1 send to rank 2 [float32[4]]",
    ]


def test_a_coalesced_batch_makes_the_cyclic_exchange_safe(tmp_path: Path) -> None:
    """Rank 1 posts its send and receive as one batch (batch_isend_irecv): both progress together."""
    batched = dict(THREE_RANK_CYCLE)
    batched[1] = [send(2, batch=1), recv(0, batch=1)]
    assert check(write_logs(tmp_path, batched)) == []


def test_a_pairwise_exchange_deadlocks_unless_batched(tmp_path: Path) -> None:
    one_by_one = {0: [send(1), recv(1)], 1: [send(0), recv(0)], 2: []}
    assert kinds(check(write_logs(tmp_path / "a", one_by_one))) == ["wait cycle"]
    batched = {0: [send(1, batch=7), recv(1, batch=7)], 1: [send(0, batch=3), recv(0, batch=3)], 2: []}
    assert check(write_logs(tmp_path / "b", batched)) == []


def test_after_a_deadlock_the_check_goes_on_to_the_next(tmp_path: Path) -> None:
    """Both ranks send first, a message of two parts, then again: the cycle is let through (as gloo's tags would)
    and the next found; the parts of one message make one deadlock."""
    schedule = {
        0: [send(1, tag=1), send(1, tag=1), recv(1, tag=2), recv(1, tag=2), send(1, tag=3), recv(1, tag=4)],
        1: [send(0, tag=2), send(0, tag=2), recv(0, tag=1), recv(0, tag=1), send(0, tag=4), recv(0, tag=3)],
        2: [],
    }
    (violation,) = check(write_logs(tmp_path, schedule))
    assert violation.kind == "wait cycle" and violation.detail.startswith("rank 0 waits at #0 send to rank 1 tag 1")
    assert violation.detail.endswith(
        ". Let through, 1 more follow, from rank 0 at #4 send to rank 1 tag 3 [float32[4]]"
    )


def test_a_collective_and_a_message_can_wait_for_each_other(tmp_path: Path) -> None:
    """Rank 0 all-reduces before sending; rank 1 receives before all-reducing (rank 2 is in the collective too)."""
    schedule = {
        0: [collective("allreduce"), send(1)],
        1: [recv(0), collective("allreduce")],
        2: [collective("allreduce")],
    }
    (violation,) = check(write_logs(tmp_path, schedule))
    assert violation.kind == "wait cycle"
    assert (
        "rank 0 waits at #0 allreduce" in violation.detail and "rank 1 waits at #0 recv from rank 0" in violation.detail
    )


def test_receives_in_another_order_than_the_sends_are_found(tmp_path: Path) -> None:
    """Different shapes: the first receive gets the wrong message's size. Equal shapes: the tags tell."""
    by_shape = {0: [send(1, (2,), tag=1), send(1, (3,), tag=2)], 1: [recv(0, (3,), tag=2), recv(0, (2,), tag=1)]}
    (violation,) = check(write_logs(tmp_path / "shape", {**by_shape, 2: []}))
    assert violation.kind == "message mismatch"
    assert violation.detail == (
        "message 0 from rank 0 to rank 1: rank 0 posts #0 send to rank 1 tag 1 [float32[2]], rank 1 receives it with "
        "#0 recv from rank 0 tag 2 [float32[3]] (gloo pairs messages by tag, NCCL by posting order)"
    )
    by_tag = {0: [send(1, tag=1), send(1, tag=2)], 1: [recv(0, tag=2), recv(0, tag=1)], 2: []}
    assert kinds(check(write_logs(tmp_path / "tag", by_tag))) == ["message mismatch"]


@pytest.mark.parametrize(
    ("sent", "received"),
    [(((2, 3), "float64"), ((6,), "float64")), (((4,), "float64"), ((4,), "int64"))],
    ids=["shape", "dtype"],
)
def test_a_message_received_with_another_shape_or_dtype_is_found(tmp_path: Path, sent, received) -> None:
    schedule = {0: [send(1, *sent)], 1: [recv(0, *received)], 2: []}
    (violation,) = check(write_logs(tmp_path, schedule))
    assert violation.kind == "message mismatch" and "message 0 from rank 0 to rank 1" in violation.detail


def test_collectives_in_different_orders_on_two_members_are_found(tmp_path: Path) -> None:
    schedule = {
        0: [collective("allreduce", (2,)), collective("broadcast", (3,), root=0)],
        1: [collective("broadcast", (3,), root=0), collective("allreduce", (2,))],
        2: [collective("allreduce", (2,)), collective("broadcast", (3,), root=0)],
    }
    (violation,) = check(write_logs(tmp_path, schedule))
    assert violation.kind == "collective mismatch"
    assert violation.detail.startswith("collective 0 differs: rank 0 posts #0 allreduce [float32[2]]; ")
    assert "rank 1 posts #0 broadcast root 0 [float32[3]]" in violation.detail


@pytest.mark.parametrize(
    "change",
    [{"inputs": [[[4], "float64"]]}, {"inputs": [[[5], "float32"]]}, {"reduce_op": "MAX"}, {"root": 1}],
    ids=["dtype", "shape", "reduction", "root"],
)
def test_a_collective_whose_members_disagree_is_found(tmp_path: Path, change: dict[str, Any]) -> None:
    kind = "broadcast" if "root" in change else "allreduce"
    common = {"root": 0} if kind == "broadcast" else {"reduce_op": "SUM"}
    schedule = {rank: [collective(kind, **{**common, **(change if rank == 2 else {})})] for rank in range(3)}
    assert kinds(check(write_logs(tmp_path, schedule))) == ["collective mismatch"]


def test_counterparts_never_posted_are_unmatched_unless_a_rank_stops_on_purpose(tmp_path: Path) -> None:
    schedule = {0: [send(1), send(1), collective("allreduce")], 1: [recv(0)], 2: [collective("allreduce")]}
    log = write_logs(tmp_path, schedule)
    violations = check(log)
    assert kinds(violations) == ["unmatched", "unmatched"]
    assert "allreduce" in violations[0].detail and "never posted by rank(s) 1" in violations[0].detail
    assert violations[1].detail == "rank 0 posts 2 sends to rank 1, which posts 1 receives"
    assert check(log, allow_unfinished=True) == []


def test_worlds_sharing_a_directory_are_checked_apart(tmp_path: Path) -> None:
    """Two runs one after the other (torchrun, then a resume): each world's rank 0 matches its own rank 1."""
    write_logs(tmp_path, {0: [send(1)], 1: [recv(0)], 2: []}, world="first")
    write_logs(tmp_path, {0: [recv(1, (2,))], 1: [send(0, (2,))], 2: []}, world="second")
    assert len(read_logs(tmp_path)) == 2
    assert check(tmp_path) == []


def test_a_receive_from_any_source_is_unsupported(tmp_path: Path) -> None:
    anysource = {"op": "recv_anysource", "kind": "recv_anysource", "outputs": [[[4], "float32"]], **GROUP}
    assert kinds(check(write_logs(tmp_path, {0: [anysource], 1: [], 2: []}))) == ["unsupported"]


def test_a_partial_last_line_of_a_killed_process_is_skipped(tmp_path: Path) -> None:
    write_logs(tmp_path, {0: [send(1)], 1: [recv(0)]})
    with (tmp_path / "rank1-w.jsonl").open("a") as log:
        log.write('{"op":"send","kind":"se')
    assert [len(ops) for ops in read_logs(tmp_path)[0].values()] == [1, 1]


# --- the recorder ------------------------------------------------------------------------------------------------


def test_recording_patches_the_process_group_only_while_active(tmp_path: Path, monkeypatch) -> None:
    """The methods come back as they were, still bound to a group: a collective after a recording works."""
    monkeypatch.delenv(LOG_ENV, raising=False)
    original = dist.ProcessGroup.allreduce
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with record_to(tmp_path / "outer"):
            patched = dist.ProcessGroup.allreduce
            assert patched is not original
            with record_to(tmp_path / "inner"):
                assert discipline._RECORDER.destinations[-1] == (tmp_path / "inner").resolve()
            assert discipline._RECORDER.destinations[-1] == (tmp_path / "outer").resolve()
            dist.all_reduce(torch.ones(2))
        assert dist.ProcessGroup.allreduce is original
        summed = torch.ones(2)
        dist.all_reduce(summed)
        dist.barrier()
        assert summed.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()
    monkeypatch.setenv(LOG_ENV, str(tmp_path / "env"))
    recording = record_from_env()
    assert recording is not None and record_from_env() is None  # once per destination
    recording.stop()


def _run(tmp_path: Path, scenario: str, world: int, start_method: str = "fork") -> Path:
    """``scenario`` on ``world`` gloo processes, recorded into a log directory of its own."""
    log_dir = tmp_path / f"{scenario}-log"
    with record_to(log_dir):  # forked workers inherit it (spawned ones through the environment)
        args = (world, str(tmp_path / f"{scenario}-store"), scenario)
        mp.start_processes(run, args=args, nprocs=world, start_method=start_method)
    return log_dir


@pytest.mark.distributed
def test_a_real_three_rank_cycle_that_gloo_completes_is_found(tmp_path: Path) -> None:
    (violation,) = check(_run(tmp_path, "three_rank_cycle", 3))
    assert violation.kind == "wait cycle"
    assert "rank 0 waits at #0 send to rank 1 [float32[4]] for rank 1's #1 recv from rank 0" in violation.detail


@pytest.mark.distributed
def test_real_receives_out_of_tag_order_are_found(tmp_path: Path) -> None:
    (violation,) = check(_run(tmp_path, "receives_out_of_order", 2))
    assert violation.kind == "message mismatch" and "tag 1" in violation.detail and "tag 2" in violation.detail


@pytest.mark.distributed
def test_real_shape_and_dtype_changes_are_found(tmp_path: Path) -> None:
    violations = check(_run(tmp_path, "shape_and_dtype_changes", 2))
    assert kinds(violations) == ["message mismatch", "message mismatch"]
    details = sorted(v.detail for v in violations)
    assert "float64[2, 3]" in details[0] and "float64[6]" in details[0]
    assert "float64[4]" in details[1] and "int64[4]" in details[1]


@pytest.mark.distributed
def test_real_collectives_in_another_order_are_found(tmp_path: Path) -> None:
    (violation,) = check(_run(tmp_path, "collectives_in_another_order", 2))
    assert violation.kind == "collective mismatch"
    assert "rank 0 posts #0 allreduce [float32[2, 3]]; rank 1 posts #0 allreduce [float32[6]]" in violation.detail


@pytest.mark.distributed
def test_a_real_ring_is_safe_batched_and_cyclic_one_by_one(tmp_path: Path) -> None:
    assert check(_run(tmp_path, "ring_batched", 3)) == []
    assert kinds(check(_run(tmp_path, "ring_one_by_one", 3))) == ["wait cycle"]


def _method(name: str, former: str) -> str:
    """The ProcessGroup method torch's function reaches: ``name``, or before torch had it, ``former``."""
    return name if hasattr(dist.ProcessGroup, name) else former


@pytest.mark.distributed
def test_a_real_clean_run_records_every_call_and_has_no_violation(tmp_path: Path) -> None:
    importlib.import_module("torch._dynamo")  # a functional collective's first call imports it: once, not per worker
    log_dir = _run(tmp_path, "clean", 3)
    assert check(log_dir) == []
    (world,) = read_logs(log_dir)
    ops = {rank: [(op.op, op.communicator.ranks, op.batch is not None) for op in world[rank]] for rank in world}
    assert ops[0] == [
        ("send", (0, 1, 2), True),  # batch_isend_irecv: one batch, also on gloo
        ("recv", (0, 1, 2), True),
        ("allreduce", (0, 1, 2), False),
        ("broadcast", (0, 1, 2), False),
        (_method("all_gather_single", "_allgather_base"), (0, 1, 2), False),
        (_method("reduce_scatter_single", "_reduce_scatter_base"), (0, 1, 2), False),
        ("allreduce", (0, 1), False),  # the subgroup, under its own name
        ("functional.all_reduce", (0, 1, 2), False),
        ("barrier", (0, 1, 2), False),
        ("barrier", (0, 1, 2), False),
    ]
    assert [op for op in ops[2] if op[1] == (0, 1)] == []
    broadcast = world[2][3]
    assert broadcast.root == 1 and broadcast.inputs == [((4,), "float32")]


@pytest.mark.distributed
def test_spawned_workers_record_through_the_environment_once_they_join(tmp_path: Path, monkeypatch) -> None:
    """A worker started with spawn (as torchrun's are: a fresh interpreter) imports every module of
    longstraw_agents.parallel with $LONGSTRAW_COMM_LOG set, which patches nothing, then joins the job
    (``launch.init_from_env``), which records into it. One process: the import of torch is the cost."""
    log_dir = tmp_path / "env-log"
    monkeypatch.setenv(LOG_ENV, str(log_dir))
    scenario = "joins_after_importing_the_package"
    mp.start_processes(run, args=(1, str(tmp_path / "store"), scenario), nprocs=1, start_method="spawn")
    (world,) = read_logs(log_dir)
    assert [op.op for op in world[0]] == ["allreduce", "barrier"]


# --- the suite's check (tests/conftest.py) -----------------------------------------------------------------------

SUITE = """
import json
import os
from pathlib import Path

import pytest

SEND = {"op": "send", "kind": "send", "group": "0", "ranks": [0, 1], "peer": 1, "inputs": [[[4], "float32"]]}
RECV = {"op": "recv", "kind": "recv", "group": "0", "ranks": [0, 1], "peer": 0, "outputs": [[[4], "float32"]]}
EXCHANGE = {0: [SEND, dict(RECV, peer=1)], 1: [dict(SEND, peer=0), RECV]}  # both send first: a cycle
FORWARD = {0: [SEND], 1: [RECV]}


def log(schedule):
    directory = Path(os.environ["LONGSTRAW_COMM_LOG"])  # what the workers would inherit
    for rank, events in schedule.items():
        lines = [{"world": "w", "rank": rank, "size": 2, "pid": rank}, *events]
        (directory / f"rank{rank}.jsonl").write_text("".join(json.dumps(line) + "\\n" for line in lines))


@pytest.mark.distributed
def test_clean():
    log(FORWARD)


@pytest.mark.distributed
def test_cycle():
    log(EXCHANGE)


@pytest.mark.distributed
@pytest.mark.known_nccl_violation("both ranks send first")
def test_known():
    log(EXCHANGE)


@pytest.mark.distributed
@pytest.mark.known_nccl_violation("fixed since")
def test_fixed():
    log(FORWARD)


@pytest.mark.distributed
def test_unmatched():
    log({0: [SEND], 1: []})


@pytest.mark.distributed
@pytest.mark.stops_a_rank("rank 1 dies before it receives")
def test_stopped():
    log({0: [SEND], 1: []})


def test_not_distributed():
    assert "LONGSTRAW_COMM_LOG" not in os.environ
"""


def test_the_suite_fails_distributed_tests_that_break_the_discipline(pytester: pytest.Pytester) -> None:
    """tests/conftest.py: violations fail a distributed test, listed; a known one warns, and its marker must go once
    the run is clean; a test that stops a rank on purpose may leave messages unmatched; other tests run without a
    log."""
    repo = Path(__file__).resolve().parents[2]
    pytester.makeconftest((repo / "tests" / "conftest.py").read_text())
    markers = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    pytester.makeini("[pytest]\nmarkers =\n" + "".join(f"    {m}\n" for m in markers))
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--strict-markers")
    result.assert_outcomes(passed=4, failed=3, warnings=1)
    result.stdout.fnmatch_lines(
        [
            "*_ test_cycle _*",
            "the messages of this test break NCCL's matching discipline:",
            "  - wait cycle on communicator '0' (ranks 0, 1): rank 0 waits at #0 send to rank 1 *",
            "*_ test_fixed _*",
            "marked known_nccl_violation, but its messages keep NCCL's discipline: remove the marker",
            "*_ test_unmatched _*",
            "the messages of this test break NCCL's matching discipline:",
            "  - unmatched on communicator '0' (ranks 0, 1): rank 0 posts 1 sends to rank 1, which posts 0 receives",
            "*PytestWarning: known NCCL discipline violation (both ranks send first):",
        ]
    )
