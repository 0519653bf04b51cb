"""``longstraw train`` launched over several CPU processes by torchrun or accelerate (tests/app/test_distributed.py,
tests/app/test_served.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


LAUNCHERS = {
    # a free port of its own
    "torchrun": ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node"],
    # accelerate's multi-process launcher (torch.distributed.run underneath; with no CUDA the ranks use gloo)
    "accelerate": ["-m", "accelerate.commands.launch", "--multi_gpu"]
    + ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--num_processes"],
}


def launch(launcher: str, config: Path, *extra: str, processes: str) -> subprocess.CompletedProcess[str]:
    """``longstraw train`` on ``processes`` CPU processes; on a timeout the whole process group is killed, so that
    no worker outlives the test."""
    command = [sys.executable, *LAUNCHERS[launcher], processes]
    command += ["--main_process_port", str(free_port())] if launcher == "accelerate" else []
    command += ["-m", "longstraw_agents.cli", "train", str(config), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # gloo on CPU, also on a GPU machine
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    ) as process:
        try:
            out, err = process.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise
    return subprocess.CompletedProcess(command, process.returncode, out, err)
