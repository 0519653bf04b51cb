"""Joining a job started by ``torchrun`` or ``accelerate launch``: both set ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` for every process, and the default process group is built from them here —
before accelerate would build it with its own defaults — so that the collective timeout is the run's.

The timeout is what turns a dead or hung rank into an error on the others: with gloo every collective waits at most
``timeout_s`` and then raises on each surviving rank (with nccl the watchdog aborts the communicator after it).
"""

from __future__ import annotations

import os
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
