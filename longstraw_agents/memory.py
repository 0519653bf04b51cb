"""Peak live tensor bytes, measured on any device (CPU and meta included) by watching every op's outputs.

``MemoryTracker`` is a ``TorchDispatchMode``: each tensor an op produces (forward or backward, under autograd or
not) is recorded by its storage, counted once per storage however many views share it, and released through
``weakref.finalize`` on the storage's Python object, which torch keeps exactly as long as the storage lives (while
any tensor views it, autograd's saved tensors included, and not after a ``.data`` swap took it from its tensor).
Only storages that ops allocate under the tracker are counted: an output sharing an input's storage (a view, an
alias, an in-place or ``out=`` result) allocates nothing, so tensors that existed before the tracker started
(parameters, pre-allocated ``.grad`` buffers, a captured state) are never counted, however they are viewed or
updated in place, unless ``baseline`` includes them.

Two allocations are not ops, and the tracker follows them too: a storage grown or shrunk by
``UntypedStorage.resize_`` (FSDP2 frees a gathered unit's weights by resizing their storage to zero and gathers
them again into the same storage), and a DTensor's local shard (a DTensor op's output is counted by the bytes of
the rank's local tensor, not the global shape). ``roles`` attributes the bytes: give, per role, a function returning
that role's tensors (weights, gradients, optimizer state, ...); ``peak_roles`` then holds each role's bytes at the
peak (looked up whenever the peak has risen by ``resolution`` of itself since the last look, so within that of the
true peak), the rest under ``"other"``, and ``role_peaks`` the most each held at those looks and at each
``snapshot()`` (call it where a role is at its most between peaks, e.g. after an optimizer step). A tensor that
joins a role by assignment (``p.grad = t``) counts under it from the next look on. For tests and benchmarks on
small models (each look walks every role's tensors). A dispatch mode is a thread's own: a thread working for the
watched code (``parallel.lanes``' serving threads) enters it too, and the counts are locked.

Placement: the counts above are the device's. A storage allocated inside ``host_placement()`` — where offloading
code puts what it keeps on the host (FSDP2's offloaded shards, their gradients, the optimizer's step) — counts in
``host_bytes`` / ``host_peak_bytes`` instead, for its whole life; on a GPU those are the CPU tensors, on a CPU
machine, where host and device are one memory, the tag is what tells them apart.

>>> import torch
>>> with MemoryTracker() as mem:
...     x = torch.zeros(1000)      # 4,000 bytes
...     y = x + 1                  # 4,000 more
>>> mem.peak_bytes
8000
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

OTHER = "other"


@dataclass
class _Live:
    nbytes: int = 0
    host: bool = False  # allocated inside ``host_placement``


class _Placement(threading.local):
    """How deep inside ``host_placement`` blocks this thread is now (a thread's own: another's allocations meanwhile
    are not the host's)."""

    depth = 0


_PLACEMENT = _Placement()


@contextlib.contextmanager
def host_placement(on: bool = True) -> Iterator[None]:
    """Allocations in the block are the host's (offloaded), not the device's, for open ``MemoryTracker``s (with
    ``on`` False the block changes nothing: for code that offloads or not)."""
    _PLACEMENT.depth += on
    try:
        yield
    finally:
        _PLACEMENT.depth -= on


Roles = Mapping[str, Callable[[], Iterable[torch.Tensor]]]


class MemoryTracker(TorchDispatchMode):
    """Tracks the bytes of tensor storages created inside the context: ``current_bytes``, ``peak_bytes``;
    ``peak_roles`` with ``roles``."""

    def __init__(self, baseline: int = 0, roles: Roles | None = None, resolution: float = 1e-3):
        super().__init__()
        self._live: dict[int, _Live] = {}
        self.baseline = baseline
        self.current_bytes = baseline
        self.peak_bytes = baseline
        self.host_bytes = 0
        self.host_peak_bytes = 0
        self.roles = dict(roles or {})
        self.resolution = resolution
        self.peak_roles: dict[str, int] = {}
        self.role_peaks: dict[str, int] = {}
        self._looked_at = 0  # current_bytes at the last look at the roles at a peak
        self._lock = threading.RLock()  # (reentrant: a storage's finalizer may run inside a count, on its thread)

    def __enter__(self) -> MemoryTracker:
        _STORAGE_RESIZES.watch(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _STORAGE_RESIZES.unwatch(self)
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = {id(t): _storage_key(t) for t in _tensors((args, kwargs))}
        inputs = set(before.values())
        out = func(*args, **(kwargs or {}))
        with self._lock:
            self._count_outputs(out, before, inputs)
        return out

    def _count_outputs(self, out: Any, before: dict[int, int], inputs: set[int]) -> None:
        for item in _tensors(out):
            key = _storage_key(item)
            entry = self._live.get(key)
            if entry is not None:
                self._resize(entry, _local(item).untyped_storage().nbytes())  # out= / resize_ can grow it in place
            if before.get(id(item)) == key:
                continue  # an input returned on its own storage (in place, out=): already counted if it counts
            # An output on an input's storage (view, alias, in-place or out= result) allocated nothing: it joins
            # that storage's count if it is tracked, but never starts one, so parameters and pre-allocated
            # .grad buffers stay uncounted however they are viewed or updated. Only fresh storages start counting.
            if entry is not None or key not in inputs:
                self._track(item, key)

    def _track(self, tensor: torch.Tensor, key: int) -> None:
        if key not in self._live:
            self._count(_local(tensor).untyped_storage(), key)

    def _count(self, storage: torch.UntypedStorage, key: int) -> None:
        """Start counting ``storage`` (not counted yet) until it dies."""
        self._live[key] = entry = _Live(host=_PLACEMENT.depth > 0)
        self._resize(entry, storage.nbytes())
        # torch keeps one Python object per live storage: it dies with the storage, whatever tensors held it
        weakref.finalize(storage, self._release, key)

    def _resize(self, entry: _Live, nbytes: int) -> None:
        if entry.host:
            self.host_bytes += nbytes - entry.nbytes
            entry.nbytes = nbytes
            self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)
            return
        self.current_bytes += nbytes - entry.nbytes
        entry.nbytes = nbytes
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            if self.roles and self.current_bytes > self._looked_at * (1 + self.resolution):
                self._looked_at = self.current_bytes
                self.peak_roles = self.snapshot()

    def storage_resized(self, storage: torch.UntypedStorage) -> None:
        """A storage was resized in place (``UntypedStorage.resize_``): a counted one changes size; one that grows
        from nothing (FSDP2 gathering into the storage it freed before this tracker opened) starts to count."""
        key = storage._cdata
        with self._lock:
            entry = self._live.get(key)
            if entry is not None:
                self._resize(entry, storage.nbytes())
            elif storage.nbytes():
                self._count(storage, key)

    def snapshot(self) -> dict[str, int]:
        """Each role's bytes on the device now (storages this tracker counts, or that existed before it:
        ``baseline``'s; a host-placed storage counts nothing), the rest under ``other``; each role's most so far is
        kept in ``role_peaks``."""
        taken: set[int] = set()
        by_role = {}
        for role, tensors in self.roles.items():
            nbytes = 0
            for t in tensors():
                key = _storage_key(t)
                if key not in taken:
                    taken.add(key)
                    entry = self._live.get(key)
                    if entry is None:
                        nbytes += _local(t).untyped_storage().nbytes()
                    elif not entry.host:
                        nbytes += entry.nbytes
            by_role[role] = nbytes
        by_role[OTHER] = self.current_bytes - sum(by_role.values())
        for role, nbytes in by_role.items():
            self.role_peaks[role] = max(self.role_peaks.get(role, 0), nbytes)
        return by_role

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is not None:
                self._resize(entry, 0)

    def reset_peak(self) -> None:
        self.peak_bytes = self._looked_at = self.current_bytes
        self.host_peak_bytes = self.host_bytes
        self.role_peaks = {}
        if self.roles:
            self.peak_roles = self.snapshot()


class _StorageResizes:
    """Reports ``UntypedStorage.resize_`` to the trackers open now: the method is replaced while any is open (a
    storage resize is no op a dispatch mode sees)."""

    def __init__(self) -> None:
        self.trackers: list[MemoryTracker] = []
        self.original = torch._C.StorageBase.resize_  # type: ignore[attr-defined]

    def watch(self, tracker: MemoryTracker) -> None:
        if not self.trackers:
            original = self.original

            def resize_(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
                out = original(storage, size)
                for open_tracker in tuple(self.trackers):
                    open_tracker.storage_resized(storage)
                return out

            torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        self.trackers.append(tracker)

    def unwatch(self, tracker: MemoryTracker) -> None:
        self.trackers.remove(tracker)
        if not self.trackers:
            del torch.UntypedStorage.resize_  # the inherited method again


_STORAGE_RESIZES = _StorageResizes()


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or results, in order: what ``tree_flatten`` finds there (tensors, possibly in
    lists and tuples — a ``torch.return_types`` result is one — or a dict's values), without its generic traversal,
    which cost the tracker's ops more than the ops themselves."""
    found: list[torch.Tensor] = []
    _collect(value, found)
    return found


def _collect(value: Any, found: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, list | tuple):
        for item in value:
            _collect(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _collect(item, found)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``tensor``'s bytes on this rank: a DTensor's local shard."""
    return tensor._local_tensor if type(tensor) is DTensor else tensor


def _storage_key(tensor: torch.Tensor) -> int:
    """The StorageImpl pointer: stable for the storage's lifetime and shared by all its views, also on meta (a
    DTensor's: its local shard's). Called for every input and output of every op: kept to one call."""
    if type(tensor) is DTensor:
        tensor = tensor._local_tensor
    return tensor.untyped_storage()._cdata


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        seen[_storage_key(t)] = _local(t).untyped_storage().nbytes()
    return sum(seen.values())
