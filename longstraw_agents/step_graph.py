"""CUDA graphs for the decode step: captured once per shape class of the batch, then replayed.

A batched decode step launches a few hundred small kernels (each layer's projections, norms, attention pieces and
recurrent update) for a handful of new tokens: launching them is the whole cost (42 ms a step for a 1B model at 8
members on an H200, the GPU idle most of the time). Captured in a CUDA graph, a step is one launch. A graph
replays fixed kernels on fixed memory, so the captured function must be a pure function of *static buffers*: it
reads its inputs from tensors that keep their address while the graph lives, writes its results into them, and does
nothing the host waits for or feeds (no ``.item()``, ``.tolist()``, data-dependent shape, host<->device copy or
tensor made from Python data). ``decoding.Decoder`` builds such a function for each *shape class* of its batch (see
there), and one of these runners runs it:

- ``CudaGraphStep``: the class's first step runs eagerly on a side stream — the warm-up, where lazy initialisation
  and Triton autotuning at the new shapes happen; it is a real step and its result is returned — then the function
  is captured with ``torch.cuda.graph``; every later step is one ``replay()``.
- ``EagerStep``: the same function run eagerly: devices without CUDA graphs, and the CPU tests' stand-in for a
  capture.

``host_syncs`` records what a function does that a capture cannot hold. ``CudaGraphStep`` can run its warm-up under
it and run eagerly instead of capturing where it finds anything (an unexpected code path: e.g. a dynamic RoPE that
reads the longest position on the host), so a model that cannot be captured decodes slower, not wrongly.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

StepFunction = Callable[[], Tensor]
"""A step over static buffers: reads its inputs from them, updates them in place, returns the step's output."""

# ops whose output shape depends on values, or that read a value on the host, or make a tensor from Python data
_HOST_OPS: dict[Any, str] = {
    aten._local_scalar_dense: "reads a tensor's value on the host (.item(), int(t), bool(t), `if t`)",
    aten.is_nonzero: "reads a tensor's value on the host (bool(t))",
    aten.equal: "compares tensors on the host (torch.equal)",
    aten.allclose: "compares tensors on the host (torch.allclose)",
    aten.nonzero: "has an output shape that depends on values (nonzero, torch.where(mask))",
    aten.argwhere: "has an output shape that depends on values (argwhere)",
    aten.masked_select: "has an output shape that depends on values (masked_select)",
    aten._unique: "has an output shape that depends on values (torch.unique)",
    aten._unique2: "has an output shape that depends on values (torch.unique)",
    aten.unique_dim: "has an output shape that depends on values (torch.unique)",
    aten.unique_consecutive: "has an output shape that depends on values (torch.unique_consecutive)",
    aten.unique_dim_consecutive: "has an output shape that depends on values (torch.unique_consecutive)",
    aten.lift_fresh: "makes a tensor from Python data (torch.tensor)",
    aten.lift_fresh_copy: "makes a tensor from Python data (torch.tensor)",
}
_INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
_COPIES = {aten._to_copy, aten.copy_}
_REPEATS = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}
_HOST_FUNCTIONS: dict[Any, str] = {
    Tensor.tolist: "reads a tensor's values on the host (.tolist())",
    Tensor.numpy: "reads a tensor's values on the host (.numpy())",
}
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}


def _op_reason(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why an aten call cannot be captured in a CUDA graph (None: it can)."""
    packet = func.overloadpacket
    if packet in _HOST_OPS:
        return _HOST_OPS[packet]
    if packet in _INDEXING and any(
        isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] or ())
    ):
        return "indexes with a boolean mask (its shape depends on values; use torch.where or masked_fill)"
    if func in _REPEATS and kwargs.get("output_size") is None:
        return "repeats by a tensor of counts without output_size (its shape depends on values)"
    if packet in _COPIES:
        source = args[1] if packet is aten.copy_ else args[0]
        target = args[0].device if packet is aten.copy_ else kwargs.get("device") or source.device
        if isinstance(source, Tensor) and (source.device.type == "cpu") != (torch.device(target).type == "cpu"):
            return f"copies between the host and the device ({source.device} -> {target})"
    return None


class _DispatchRecorder(TorchDispatchMode):
    def __init__(self, found: list[str]):
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = _op_reason(func, args, kwargs)
        if reason is not None:
            self.found.append(f"{func}: {reason}")
        return func(*args, **kwargs)


class _FunctionRecorder(TorchFunctionMode):
    """What the dispatcher never sees: ``.tolist()`` of a CPU tensor reads its memory directly."""

    def __init__(self, found: list[str]):
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_FUNCTIONS:
            self.found.append(f"{func.__name__}: {_HOST_FUNCTIONS[func]}")
        elif func in _FROM_DATA and args and not isinstance(args[0], Tensor):
            self.found.append(f"{func.__name__}: makes a tensor from Python data")
        return func(*args, **kwargs)


@contextmanager
def host_syncs() -> Iterator[list[str]]:
    """Record, in the list it yields, each call inside the block that a CUDA graph cannot capture: a read of a value
    on the host, a data-dependent shape, a host<->device copy, a tensor made from Python data. The calls still run
    (the block's results are what they would be without it); on CPU it finds what would fail on a GPU."""
    found: list[str] = []
    with _FunctionRecorder(found), _DispatchRecorder(found):
        yield found


class StepGraph(ABC):
    """Runs one shape class's step function (``fn() -> Tensor``, see ``StepFunction``) step after step.

    refused: why the step is not captured where a capture was asked for (it then runs eagerly), else None."""

    refused: str | None = None

    def __init__(self, fn: StepFunction):
        self.fn = fn

    @abstractmethod
    def __call__(self) -> Tensor:
        """One step: its output. A replayed graph's output is its static buffer: read it before the next call."""

    @property
    def captured(self) -> bool:
        """Whether later calls replay a CUDA graph."""
        return False


class EagerStep(StepGraph):
    """The step function run eagerly at every call."""

    def __call__(self) -> Tensor:
        return self.fn()


class CudaGraphStep(StepGraph):
    """The first call runs the function eagerly on a side stream (the warm-up: a real step) and captures it; later
    calls replay the graph.

    check: run the warm-up under ``host_syncs``; where it finds anything, nothing is captured and every call runs
    eagerly (``refused`` says why, and a RuntimeWarning says it once). Unchecked, such a step fails its capture,
    and a failed capture can leave the CUDA context unusable: check a model's first capture at least."""

    def __init__(self, fn: StepFunction, device: torch.device, check: bool = True):
        super().__init__(fn)
        self.device, self.check = device, check
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: Tensor | None = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self) -> Tensor:
        if self.graph is not None:
            self.graph.replay()
            assert self.output is not None
            return self.output
        if self.refused is not None:
            return self.fn()
        return self._warm_up_and_capture()

    def _warm_up_and_capture(self) -> Tensor:
        current = torch.cuda.current_stream(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            if self.check:
                with host_syncs() as found:
                    out = self.fn()
            else:
                out, found = self.fn(), []
        current.wait_stream(stream)
        out.record_stream(current)  # (made on the side stream, read on this one)
        if found:
            self._refuse(f"the step {found[0]}" + (f" (and {len(found) - 1} more)" if len(found) > 1 else ""))
            return out
        graph = torch.cuda.CUDAGraph()
        # thread-local: other threads of the process (a trainer beside a served policy) may allocate meanwhile
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            output = self.fn()
        self.graph, self.output = graph, output
        return out

    def _refuse(self, reason: str) -> None:
        self.refused = reason
        warnings.warn(f"decoding runs without CUDA graphs: {reason}", RuntimeWarning, stacklevel=4)
