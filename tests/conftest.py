"""Shared pytest set-up: deterministic torch, small thread pools (CI has 2 cores), and NCCL's matching discipline
checked on every test marked ``distributed``."""

from __future__ import annotations

import os
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# Tiny models on 2 cores: one intra-op thread per test process (pytest runs two workers) is far faster than two
# threads contending — measured 30x on the hybrid family's decode loop under load.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The tests that do run two threads (tests/trainer/test_learning.py) share the cores with the other worker: OpenMP's
# threads then sleep when they wait rather than spin (measured: 6x less CPU time and 4x less wall time for the two-
# thread cases). Read when torch loads OpenMP, so set before anything imports torch; only waiting changes, no result.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Without a GPU, Triton's kernels run in its interpreter on CPU tensors (tests/kernels): it reads the variable when a
# kernel is defined, so it is set before anything imports Triton. Nothing picks a Triton kernel for CPU tensors on its
# own (models/delta_rule.py), so only the tests that call the kernels run them.


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:  # the agent side runs without torch
        return False
    return torch.cuda.is_available()


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config: pytest.Config) -> None:
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _heavy_files_first(items)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # the agent side runs without torch
        has_cuda = False
    if has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _heavy_files_first(items: list[pytest.Item]) -> None:
    """The files with a test marked ``distributed`` or ``slow`` first, each file's tests in their order: xdist
    (``--dist loadfile --no-loadscope-reorder``, the Makefile's) hands out whole files in this order, so the long
    ones start early instead of leaving one worker alone with the last of them."""
    heavy = {item.path for item in items if {"distributed", "slow"} & set(item.keywords)}
    items.sort(key=lambda item: item.path not in heavy)


# --- NCCL's discipline on every distributed test ------------------------------------------------------------------
# Gloo matches messages by tag; NCCL in posting order, one stream per communicator (longstraw_agents/parallel/
# discipline.py). Every process group call of a test marked ``distributed`` is logged — in this process (and the
# processes it forks) by patching, in torchrun children through $LONGSTRAW_COMM_LOG, which they inherit and act on
# when they join the job (parallel.launch.init_from_env) — and checked once the test body has run. Hooks
# rather than a fixture: the log must be in place before a module-scoped fixture starts the workers.


@dataclass
class _CommLog:
    directory: Path
    recording: Any  # discipline.Recording
    previous_env: str | None


_COMM_LOG = pytest.StashKey[_CommLog]()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    if item.get_closest_marker("distributed") is not None:
        from longstraw_agents.parallel import discipline

        directory = item.config._tmp_path_factory.mktemp("comm-log")  # kept like tmp_path, for a look
        previous = os.environ.get(discipline.LOG_ENV)
        os.environ[discipline.LOG_ENV] = str(directory)
        item.stash[_COMM_LOG] = _CommLog(directory, discipline.record_to(directory), previous)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    result = yield  # a failing test keeps its own failure: its log may stop anywhere
    log = item.stash.get(_COMM_LOG, None)
    failure = _check_comm_log(item, log.directory) if log is not None else None
    if log is not None and failure is not None:
        pytest.fail(f"{failure}\n(logs: {log.directory})", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    try:
        return (yield)
    finally:
        log = item.stash.get(_COMM_LOG, None)
        if log is not None:
            from longstraw_agents.parallel import discipline

            log.recording.stop()
            if log.previous_env is None:
                os.environ.pop(discipline.LOG_ENV, None)
            else:
                os.environ[discipline.LOG_ENV] = log.previous_env


def _check_comm_log(item: pytest.Item, directory: Path) -> str | None:
    """Why the test fails NCCL's discipline (None: it keeps it). A test marked ``known_nccl_violation`` warns with
    the findings instead, and fails when a run that recorded messages is clean: the marker must go."""
    from longstraw_agents.parallel import discipline

    known = item.get_closest_marker("known_nccl_violation")
    stops_a_rank = item.get_closest_marker("stops_a_rank") is not None
    violations = discipline.check(directory, allow_unfinished=stops_a_rank)
    listed = "\n".join(f"  - {v}" for v in violations)
    if known is None:
        return f"the messages of this test break NCCL's matching discipline:\n{listed}" if violations else None
    if not known.args:
        return "known_nccl_violation needs the reason as its argument"
    if violations:
        item.warn(pytest.PytestWarning(f"known NCCL discipline violation ({known.args[0]}):\n{listed}"))
        return None
    if any(ops for world in discipline.read_logs(directory) for ops in world.values()):
        return "marked known_nccl_violation, but its messages keep NCCL's discipline: remove the marker"
    return None
