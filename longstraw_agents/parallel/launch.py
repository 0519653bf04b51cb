"""Joining a job started by ``torchrun`` or ``accelerate launch``: both set ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` for every process, and the default process group is built from them here —
before accelerate would build it with its own defaults — so that the collective timeout is the run's.

The timeout is what turns a dead or hung rank into an error on the others: with gloo every collective waits at most
``timeout_s`` and then raises on each surviving rank (with nccl the watchdog aborts the communicator after it); a
rank that exits closes its connections, and the others' next collective fails at once. ``failing_clearly`` turns
those transport errors (gloo's "Timed out waiting 3000ms for recv operation", "Connection reset by peer") into a
``RankFailure`` that says what was going on and which setting bounds the wait.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist


def world_size() -> int:
    """The number of processes the launcher started (1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def backend() -> str:
    """gloo for CPU tensors, and nccl for CUDA ones where there is CUDA."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def init_from_env(timeout_s: float) -> bool:
    """Initialise the default process group from the launcher's environment, collectives timing out after
    ``timeout_s``; returns whether it did (False for one process, or when a group already exists)."""
    if dist.is_initialized() or world_size() == 1:
        return False
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend(), timeout=timedelta(seconds=timeout_s))
    return True


class RankFailure(RuntimeError):
    """Another rank died, or hung past the collective timeout, while this one waited for it."""


def is_collective_failure(err: BaseException) -> bool:
    """An error of the communication backend (a peer gone or silent), not of the computation around it."""
    if isinstance(err, dist.DistError):
        return True
    text = str(err)
    return any(mark in text for mark in ("gloo/transport", "Timed out waiting", "Connection reset by peer", "NCCL"))


@contextlib.contextmanager
def failing_clearly(what: str | Callable[[], str], timeout_s: float) -> Iterator[None]:
    """Re-raise a collective's failure inside the block as a ``RankFailure`` naming ``what`` (or what it returns
    then: e.g. the step that was running) and the timeout."""
    try:
        yield
    except RuntimeError as err:
        if not is_collective_failure(err):
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        doing = what if isinstance(what, str) else what()
        raise RankFailure(
            f"{doing}: rank {rank} gave up on the other ranks: one of them died, or did not answer within "
            f"parallel.timeout_s={timeout_s:g} s (raise it if a rank legitimately needs longer between collectives). "
            f"The checkpoint and the store hold only whole steps and whole groups; resume with --resume. "
            f"Backend error: {err}"
        ) from err
