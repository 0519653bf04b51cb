"""Peak live tensor bytes, measured on any device (CPU and meta included) by watching every op's outputs.

``MemoryTracker`` is a ``TorchDispatchMode``: each tensor an op produces (forward or backward, under autograd or
not) is recorded by its storage, counted once per storage however many views share it, and released through
``weakref.finalize`` when the last tensor on that storage dies — torch keeps a tensor's Python object alive while
autograd still holds the tensor, so saved activations count until the graph frees them. Only storages that ops
allocate under the tracker are counted: an output sharing an input's storage (a view, an alias, an in-place or
``out=`` result) allocates nothing, so tensors that existed before the tracker started (parameters, pre-allocated
``.grad`` buffers, a captured state) are never counted, however they are viewed or updated in place, unless
``baseline`` includes them.

>>> import torch
>>> with MemoryTracker() as mem:
...     x = torch.zeros(1000)      # 4,000 bytes
...     y = x + 1                  # 4,000 more
>>> mem.peak_bytes
8000
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass
class _Live:
    nbytes: int
    tensors: int


class MemoryTracker(TorchDispatchMode):
    """Tracks the bytes of tensor storages created inside the context: ``current_bytes``, ``peak_bytes``."""

    def __init__(self, baseline: int = 0):
        super().__init__()
        self._live: dict[int, _Live] = {}
        self.baseline = baseline
        self.current_bytes = baseline
        self.peak_bytes = baseline

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = {id(t): _storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        inputs = set(before.values())
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if not isinstance(item, torch.Tensor):
                continue
            key = _storage_key(item)
            entry = self._live.get(key)
            if entry is not None:
                self._resize(entry, item.untyped_storage().nbytes())  # out= / resize_ can grow a storage in place
            if before.get(id(item)) == key:
                continue  # an input returned on its own storage (in place, out=): already counted if it counts
            # An output on an input's storage (view, alias, in-place or out= result) allocated nothing: it joins
            # that storage's count if it is tracked, but never starts one, so parameters and pre-allocated
            # .grad buffers stay uncounted however they are viewed or updated. Only fresh storages start counting.
            if entry is not None or key not in inputs:
                self._track(item, key)
        return out

    def _track(self, tensor: torch.Tensor, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            entry = self._live[key] = _Live(nbytes=0, tensors=0)
            self._resize(entry, tensor.untyped_storage().nbytes())
        entry.tensors += 1
        weakref.finalize(tensor, self._release, key)

    def _resize(self, entry: _Live, nbytes: int) -> None:
        self.current_bytes += nbytes - entry.nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        entry.nbytes = nbytes

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry.tensors -= 1
        if entry.tensors == 0:
            self.current_bytes -= entry.nbytes
            del self._live[key]

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes


def _storage_key(tensor: torch.Tensor) -> int:
    """The StorageImpl pointer: stable for the storage's lifetime and shared by all its views, also on meta."""
    return tensor.untyped_storage()._cdata


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        seen[_storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())
