"""``serving.limits``: the engine's turns go first come first served, the memory budget admits requests in arrival
order, makes them wait or answers ``Busy``, and counts a request at no less than it holds."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from waiting import WAIT_S, started, wait_until

from longstraw_agents.memory import MemoryTracker
from longstraw_agents.models import state_size
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.sampler import SamplingConfig
from longstraw_agents.serving.limits import (
    Busy,
    MemoryBudget,
    ServingLimits,
    Turns,
    _cgroup_room,
    free_memory,
    request_bytes,
)
from longstraw_agents.torch_sampler import BatchDecoding, TorchSampler

# --- turns -------------------------------------------------------------------------------------------------------


def test_turns_go_to_the_threads_in_the_order_they_asked() -> None:
    turns, order = Turns(), []

    def take(name: str) -> None:
        with turns.turn():
            order.append(name)

    with turns.turn():
        threads = []
        for count, name in enumerate("bcd", start=1):
            threads.append(started(lambda name=name: take(name)))
            wait_until(lambda count=count: turns.waiting == count)  # each asks after the one before
        order.append("a")
    for thread in threads:
        thread.join(WAIT_S)
    assert order == ["a", "b", "c", "d"]


def test_passing_a_turn_lets_every_waiting_thread_go_first() -> None:
    turns, order = Turns(), []

    def other() -> None:
        with turns.turn():
            order.append("other")

    with turns.turn():
        turns.pass_turn()  # nobody waits: it goes on at once
        thread = started(other)
        wait_until(lambda: turns.waiting == 1)
        turns.pass_turn()
        order.append("holder")
    thread.join(WAIT_S)
    assert order == ["other", "holder"]


# --- the memory budget ---------------------------------------------------------------------------------------------


def test_a_request_that_does_not_fit_waits_for_room_then_goes() -> None:
    budget, admitted = MemoryBudget(100, wait_s=WAIT_S), threading.Event()

    def second() -> None:
        with budget.hold(60):
            admitted.set()

    with budget.hold(60):
        thread = started(second)
        wait_until(lambda: budget.waiting == 1)
        assert not admitted.is_set() and budget.held_bytes == 60
    thread.join(WAIT_S)
    assert admitted.is_set() and budget.held_bytes == 0 and budget.holders == 0


def test_requests_are_admitted_in_arrival_order_a_large_one_is_not_overtaken() -> None:
    budget, order = MemoryBudget(100, wait_s=WAIT_S), []

    def request(name: str, nbytes: int) -> None:
        with budget.hold(nbytes):
            order.append(name)

    with budget.hold(50):
        large = started(lambda: request("large", 80))
        wait_until(lambda: budget.waiting == 1)
        small = started(lambda: request("small", 10))  # it would fit now, but the large one came first
        wait_until(lambda: budget.waiting == 2)
        assert order == []
    large.join(WAIT_S)
    small.join(WAIT_S)
    assert order == ["large", "small"]


def test_no_room_in_time_or_a_full_line_is_busy_and_too_much_ever_is_a_value_error() -> None:
    budget = MemoryBudget(100, wait_s=0.01, max_waiting=1)
    with budget.hold(100):
        with pytest.raises(Busy, match="hold 100 of the memory budget's 100 bytes; no room came within 0.01 s"):
            with budget.hold(1):
                pass
        patient = MemoryBudget(100, wait_s=WAIT_S, max_waiting=0)
        with patient.hold(100), pytest.raises(Busy, match="waiting"), patient.hold(1):
            pass
    with pytest.raises(ValueError, match="101 bytes are more than the whole budget of 100"), budget.hold(101):
        pass
    assert budget.held_bytes == 0 and budget.waiting == 0


def test_an_exclusive_hold_waits_for_the_requests_in_flight_and_keeps_new_ones_out() -> None:
    budget, events = MemoryBudget(100, wait_s=WAIT_S), []

    def exclusive() -> None:
        with budget.exclusive():
            events.append("exclusive")

    def later() -> None:
        with budget.hold(1):
            events.append("later")

    with budget.hold(1):
        first = started(exclusive)
        wait_until(lambda: budget.waiting == 1)
        second = started(later)
        wait_until(lambda: budget.waiting == 2)
        events.append("in flight ends")
    first.join(WAIT_S)
    second.join(WAIT_S)
    assert events == ["in flight ends", "exclusive", "later"]


# --- what a request counts -----------------------------------------------------------------------------------------


def test_a_request_holds_no_more_than_it_is_counted_for() -> None:
    """Decoding a request's choices to their limit (the server's ``BatchDecoding``), measured by ``MemoryTracker``:
    the peak stays under ``request_bytes``, which is not wildly above it either."""
    model = tiny_model("llama", dtype=torch.float64, hidden=16, layers=1)
    prompt, n, max_tokens = list(range(10, 30)), 2, 70  # past FIRST_RESERVE: the decoder's buffers grow once
    sampler = TorchSampler(model, [7], SamplingConfig(max_new_tokens=max_tokens, seed=0))
    with MemoryTracker() as memory:
        decoding = BatchDecoding(sampler, sampler.fork(prompt, n), keep_states=False)
        while not decoding.done:
            decoding.step()
    counted = request_bytes(state_size(model.config, torch.float64), [len(prompt)], n, max_tokens, 256)
    assert memory.peak_bytes <= counted <= 5 * memory.peak_bytes


def test_request_bytes_count_each_prompt_once_and_every_choice() -> None:
    size = state_size(tiny_model("llama", dtype=torch.float64).config, torch.float64)

    def counted(prompts: list[int], n: int, max_tokens: int = 50) -> int:
        return request_bytes(size, prompts, n, max_tokens, 256)

    assert counted([100], 4) - counted([100], 1) == 3 * (counted([100], 2) - counted([100], 1))  # n share a prompt
    assert counted([100, 100], 1) == 2 * counted([100], 1)
    assert counted([200], 1) - counted([100], 1) == 100 * size.bytes_per_token
    assert counted([100], 1, 150) - counted([100], 1) == 3 * 100 * size.bytes_per_token  # the buffers' growth


def test_limits_refuse_unknown_fields_and_free_memory_reads_the_cgroup(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="max_tokenz"):
        ServingLimits(max_tokenz=5)  # type: ignore[call-arg]
    assert ServingLimits().max_tokens == 16_384
    (tmp_path / "memory.max").write_text("1000\n")
    (tmp_path / "memory.current").write_text("400\n")
    assert _cgroup_room(tmp_path) == 600
    (tmp_path / "memory.max").write_text("max\n")
    assert _cgroup_room(tmp_path) is None and _cgroup_room(tmp_path / "none") is None
    assert free_memory(torch.device("cpu")) > 0
