"""What the requests in flight of ``serving.CompletionServer`` may ask and hold (``ServingLimits``, counted by
``request_bytes``), and how they share its memory (``MemoryBudget``) and its engine (``Turns``). One thread serves
each request.

    budget, turns = MemoryBudget(8 << 30, wait_s=60), Turns()
    with budget.hold(request_bytes(size, [len(prompt)], n, max_tokens, vocab_size)):  # waits for room, or ``Busy``
        while not done:
            with turns.turn():              # first come, first served: requests in flight alternate step by step
                step()
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from longstraw_agents.models import StateSize
from longstraw_agents.torch_sampler import FIRST_RESERVE

DEFAULT_MAX_TOKENS_LIMIT = 16_384
"""A request's ``max_tokens`` at most unless the server says otherwise: a long answer, still bounded in time."""
DEFAULT_BUDGET_SHARE = 0.5
"""The default memory budget's share of the memory free on the model's device when the server starts: the rest is
headroom for what the budget does not count (a prompt's capture activations, the allocator's slack)."""
SESSION_GROWTH = 3
"""A choice's decoded positions are held in the decoder's buffers, which double as they fill: up to twice the
positions decoded, and three times while a growth copies the old buffer into the new one."""
SAMPLING_BYTES_PER_LOGIT = 72
"""Each choice's next-token logits per vocabulary entry while a token is drawn: the model's row (at most 8 bytes)
and the float64 copies that sampling makes (scaled, log-softmax, probabilities, sorted for top-p, cumulative)."""
RETRY_AFTER_S = 1
"""What a ``Busy`` answer tells the client to wait before trying again: the server cannot know when room comes
(it depends on how long the requests in flight decode), and the official clients back off further on repeats."""


class ServingLimits(BaseModel):
    """What one request may ask and what the requests in flight may hold together (``longstraw serve``'s
    ``--max-tokens``, ``--memory-budget`` and ``--queue-timeout``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(DEFAULT_MAX_TOKENS_LIMIT, ge=1)
    """A request's ``max_tokens`` (chat: ``max_completion_tokens``) at most; the context minus the prompt bounds
    it too."""
    memory_budget: int | None = Field(None, ge=1)
    """Bytes of decoding state that the requests in flight may hold together, each counted at the most it can hold
    (``request_bytes``); None: ``DEFAULT_BUDGET_SHARE`` of the memory free on the model's device at start."""
    queue_timeout_s: float = Field(60.0, gt=0, le=86_400)
    """How long a request waits for room in the budget before it is answered 503."""
    max_waiting: int = Field(256, ge=0)
    """Requests waiting for room at most; one more is answered 503 at once."""
    context: int | None = Field(None, ge=2)
    """The longest sequence, prompt and completion (default: the model's, ``models.context_limit``)."""


def request_bytes(size: StateSize, prompt_lengths: Sequence[int], n: int, max_tokens: int, vocab_size: int) -> int:
    """The most memory a request's decoding can hold, from the model's state ``size`` per token: each prompt's
    capture once (its ``n`` choices share it, with the room reserved after it), and per choice its positions in the
    decoder's growing buffers (``SESSION_GROWTH``), its recurrent states (the batch's and a step's new ones) and its
    logits while a token is drawn (``SAMPLING_BYTES_PER_LOGIT``)."""
    prompts = sum(size.total(length + FIRST_RESERVE) for length in prompt_lengths)
    decoded = SESSION_GROWTH * (max_tokens + FIRST_RESERVE) * size.bytes_per_token
    choice = decoded + 2 * size.fixed_bytes + SAMPLING_BYTES_PER_LOGIT * vocab_size
    return prompts + len(prompt_lengths) * n * choice


def default_budget(device: torch.device) -> int:
    """``DEFAULT_BUDGET_SHARE`` of the memory free on ``device`` now."""
    return max(1, int(DEFAULT_BUDGET_SHARE * free_memory(device)))


def free_memory(device: torch.device) -> int:
    """Bytes free on ``device``: the GPU's (``torch.cuda.mem_get_info``), else the host's available memory, within
    the cgroup's limit when the process runs under one (a container)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    free = _meminfo_available()
    limited = _cgroup_room()
    return min(free, limited) if limited is not None else free


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _cgroup_room(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The room left under the cgroup v2 memory limit (None without one)."""
    try:
        limit = (root / "memory.max").read_text().strip()
        used = int((root / "memory.current").read_text())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - used)


class Busy(RuntimeError):
    """No room for the request in time, or too many are waiting: try again later (``RETRY_AFTER_S``)."""


class Turns:
    """The engine for one thread at a time, in the order the threads asked for it (a ticket lock).

    A request takes a turn per decoding step; a thread asking while another holds the turn goes after every thread
    already waiting, so requests in flight alternate step by step and none waits for another to finish. (A plain
    lock is not fair: the thread that releases it usually takes it again at once.)"""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._issued = 0  # tickets handed out
        self._serving = 0  # the ticket whose turn it is

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the engine for the block, after every thread that asked before."""
        self._wait_for(self._ticket())
        try:
            yield
        finally:
            self._next()

    def pass_turn(self) -> None:
        """Inside a turn: let every thread waiting now have its turn first, then go on (a long computation's pause).
        Returns at once when nobody waits."""
        with self._changed:
            if self._issued == self._serving + 1:
                return
        ticket = self._ticket()
        self._next()
        self._wait_for(ticket)

    @property
    def waiting(self) -> int:
        """Threads waiting for a turn (not counting the one holding it)."""
        with self._changed:
            return max(0, self._issued - self._serving - 1)

    def _ticket(self) -> int:
        with self._changed:
            self._issued += 1
            return self._issued - 1

    def _wait_for(self, ticket: int) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._serving == ticket)

    def _next(self) -> None:
        with self._changed:
            self._serving += 1
            self._changed.notify_all()


class MemoryBudget:
    """Bytes that the requests in flight may hold together, each counted at the most it can hold.

    A request is admitted when its bytes fit beside those held, in the order requests arrive (a large one is not
    overtaken by a stream of small ones); it waits at most ``wait_s`` for that, and at most ``max_waiting`` wait at
    once: otherwise ``Busy``. ``exclusive`` waits, in the same line, until nothing is held, and holds everything
    (loading new weights between requests)."""

    def __init__(self, total_bytes: int, wait_s: float, max_waiting: int = 256):
        if total_bytes < 1:
            raise ValueError(f"a memory budget of {total_bytes} bytes holds nothing")
        self.total_bytes, self.wait_s, self.max_waiting = total_bytes, wait_s, max_waiting
        self._changed = threading.Condition()
        self._line: deque[object] = deque()  # tickets of the requests waiting, first come first
        self.held_bytes = 0
        self.holders = 0
        self._exclusive = False

    @property
    def waiting(self) -> int:
        """Requests waiting for room now."""
        with self._changed:
            return len(self._line)

    @contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        """Hold ``nbytes`` for the block, once they fit (``ValueError`` if they never can; ``Busy``)."""
        if nbytes > self.total_bytes:
            raise ValueError(f"{nbytes:,} bytes are more than the whole budget of {self.total_bytes:,}")
        self._admit(lambda: not self._exclusive and self.held_bytes + nbytes <= self.total_bytes, nbytes, False)
        try:
            yield
        finally:
            self._release(nbytes, False)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the whole budget for the block, once the requests in flight have ended (``Busy``)."""
        self._admit(lambda: self.holders == 0, 0, True)
        try:
            yield
        finally:
            self._release(0, True)

    def _admit(self, fits: Callable[[], bool], nbytes: int, exclusive: bool) -> None:
        with self._changed:
            if not self._line and fits():
                self._take(nbytes, exclusive)
                return
            if len(self._line) >= self.max_waiting:
                raise Busy(f"{len(self._line)} requests are waiting for room already")
            ticket = object()
            self._line.append(ticket)
            try:
                if not self._changed.wait_for(lambda: self._line[0] is ticket and fits(), timeout=self.wait_s):
                    raise Busy(
                        f"the requests in flight hold {self.held_bytes:,} of the memory budget's "
                        f"{self.total_bytes:,} bytes; no room came within {self.wait_s:g} s"
                    )
                self._take(nbytes, exclusive)
            finally:
                self._line.remove(ticket)
                self._changed.notify_all()  # the next in line may fit now

    def _take(self, nbytes: int, exclusive: bool) -> None:
        self.held_bytes += nbytes
        self.holders += 1
        self._exclusive = exclusive

    def _release(self, nbytes: int, exclusive: bool) -> None:
        with self._changed:
            self.held_bytes -= nbytes
            self.holders -= 1
            if exclusive:
                self._exclusive = False
            self._changed.notify_all()
