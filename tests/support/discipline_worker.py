"""Schedules for the discipline checker's real runs (tests/parallel/test_discipline.py): each rank of a small gloo
world posts the messages one scenario names. The mis-ordered ones complete on gloo (it pairs messages by tag, and
equal byte counts hide a shape or dtype change), and break NCCL's matching discipline."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def three_rank_cycle(rank: int) -> None:
    """Rank 0 sends to 1 then 2; rank 1 sends to 2 before receiving from 0; rank 2 receives from 0 then 1: under
    rendezvous in posting order each waits for the next."""
    x = torch.zeros(4)
    if rank == 0:
        _wait([dist.isend(x, 1), dist.isend(x, 2)])
    elif rank == 1:
        sent = dist.isend(x, 2)
        dist.recv(x, 0)
        _wait([sent])
    else:
        dist.recv(x, 0)
        dist.recv(x, 1)


def receives_out_of_order(rank: int) -> None:
    """Rank 0 sends tag 1 then tag 2; rank 1 receives tag 2 first: gloo pairs them by tag, NCCL would swap them."""
    if rank == 0:
        _wait([dist.isend(torch.full((4,), 1.0), 1, tag=1), dist.isend(torch.full((4,), 2.0), 1, tag=2)])
    else:
        second, first = torch.empty(4), torch.empty(4)
        dist.recv(second, 0, tag=2)
        dist.recv(first, 0, tag=1)


def shape_and_dtype_changes(rank: int) -> None:
    """0 -> 1: float64 [2, 3] received as float64 [6]; 1 -> 0: float64 [4] received as int64 [4] (same bytes)."""
    if rank == 0:
        _wait([dist.isend(torch.zeros(2, 3, dtype=torch.float64), 1)])
        dist.recv(torch.empty(4, dtype=torch.int64), 1)
    else:
        dist.recv(torch.empty(6, dtype=torch.float64), 0)
        _wait([dist.isend(torch.zeros(4, dtype=torch.float64), 0)])


def collectives_in_another_order(rank: int) -> None:
    """Two all-reduces of the same size, [2, 3] and [6], posted in opposite orders by the two ranks."""
    shapes = [(2, 3), (6,)] if rank == 0 else [(6,), (2, 3)]
    for shape in shapes:
        dist.all_reduce(torch.ones(shape))


def ring_exchange(rank: int, batched: bool) -> None:
    """Each rank sends to the next and receives from the previous: one batch keeps it safe; posted one by one,
    every rank's first operation is a send whose receiver is itself sending."""
    world = dist.get_world_size()
    out, into = torch.full((3,), float(rank)), torch.empty(3)
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    if batched:
        _wait(dist.batch_isend_irecv([dist.P2POp(dist.isend, out, nxt), dist.P2POp(dist.irecv, into, prev)]))
    else:
        _wait([dist.isend(out, nxt), dist.irecv(into, prev)])


def clean(rank: int) -> None:
    """A batched ring, then one call of each collective family on the world and on a subgroup, and a functional
    all-reduce (DTensor's path)."""
    world = dist.get_world_size()
    ring_exchange(rank, batched=True)
    x = torch.ones(4)
    dist.all_reduce(x)
    dist.broadcast(x, src=1)
    gathered = torch.empty(4 * world)
    dist.all_gather_into_tensor(gathered, x)
    dist.reduce_scatter_tensor(torch.empty(4), gathered)
    pair = dist.new_group([0, 1])
    if rank < 2:
        dist.all_reduce(x, group=pair)
    funcol.all_reduce(x, "sum", dist.group.WORLD).sum().item()  # (reading it waits for it)
    dist.barrier()


def joins_after_importing_the_package(rank: int) -> None:
    """A spawned worker (a fresh interpreter, as torchrun's children are) with $LONGSTRAW_COMM_LOG inherited from the
    parent: importing every module of longstraw_agents.parallel leaves torch's process groups as they were; joining
    the job (``launch.init_from_env``, which returns at once here: the group exists) starts the recording, and the
    all-reduce after it is logged."""
    untouched = dist.ProcessGroup.allreduce, dist.batch_isend_irecv
    import longstraw_agents.parallel

    for module in pkgutil.walk_packages(longstraw_agents.parallel.__path__, "longstraw_agents.parallel."):
        importlib.import_module(module.name)
    if (dist.ProcessGroup.allreduce, dist.batch_isend_irecv) != untouched:
        raise AssertionError("importing longstraw_agents.parallel patched torch.distributed")
    from longstraw_agents.parallel.launch import Timeouts, init_from_env

    init_from_env(Timeouts(liveness_s=60.0))
    if dist.ProcessGroup.allreduce is untouched[0]:
        raise AssertionError("joining with $LONGSTRAW_COMM_LOG set did not start the recording")
    dist.all_reduce(torch.ones(2))


SCENARIOS: dict[str, Callable[[int], None]] = {
    "three_rank_cycle": three_rank_cycle,
    "receives_out_of_order": receives_out_of_order,
    "shape_and_dtype_changes": shape_and_dtype_changes,
    "collectives_in_another_order": collectives_in_another_order,
    "ring_one_by_one": lambda rank: ring_exchange(rank, batched=False),
    "ring_batched": lambda rank: ring_exchange(rank, batched=True),
    "clean": clean,
    "joins_after_importing_the_package": joins_after_importing_the_package,
}


def run(rank: int, world: int, store: str, scenario: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    torch.set_num_threads(1)
    SCENARIOS[scenario](rank)
    dist.barrier()  # no rank leaves while another still waits for its messages
    dist.destroy_process_group()


def _wait(works: list[dist.Work | None]) -> None:
    for work in works:
        if work is not None:
            work.wait()
