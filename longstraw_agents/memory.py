"""Peak live tensor bytes, measured on any device (CPU and meta included) by watching every op's outputs.

``MemoryTracker`` is a ``TorchDispatchMode``: each tensor an op produces (forward or backward, under autograd or
not) is recorded by its storage, counted once per storage however many views share it, and released through
``weakref.finalize`` when the last tensor on that storage dies — torch keeps a tensor's Python object alive while
autograd still holds the tensor, so saved activations count until the graph frees them. Tensors that existed
before the tracker started (parameters, a captured state) are not counted, unless ``baseline`` includes them.

>>> with MemoryTracker() as mem:
...     loss = model(x).sum(); loss.backward()
>>> mem.peak_bytes
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
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self._track(item)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata  # the StorageImpl pointer: stable for the storage's lifetime, also on meta
        entry = self._live.get(key)
        if entry is None:
            entry = self._live[key] = _Live(nbytes=storage.nbytes(), tensors=0)
            self.current_bytes += entry.nbytes
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        entry.tensors += 1
        weakref.finalize(tensor, self._release, key)

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


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())
