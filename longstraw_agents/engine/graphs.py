"""Exact mode's memory budget: the autograd graphs of the last capture chunks that fit it (``GraphBank``)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from longstraw_agents.memory import MemoryTracker
from longstraw_agents.state import ChunkRecord, StateGrad


@dataclass(frozen=True, eq=False)
class KeptGraph:
    """A chunk evaluated under autograd during capture: its final hidden states and new state entries (in the
    graph), and the bytes its forward left alive (the graph's saved tensors and these outputs)."""

    hidden: Tensor
    new: list[tuple[Tensor, ...]]
    nbytes: int


class GraphBank:
    """The autograd graphs of the last capture chunks that fit ``budget_bytes`` (``EngineConfig.graph_budget_bytes``).

    Chunks are added in capture order; when the kept graphs exceed the budget, the oldest are dropped (their
    chunks will be recomputed), so what stays is the last chunks — the first the reverse walk reaches. The graphs
    read the state with ``grad``'s sinks, so backpropagating through one feeds the same buffers recomputation would.
    A bank of budget 0 keeps nothing.
    """

    def __init__(self, budget_bytes: int, grad: StateGrad):
        self.budget_bytes, self.grad = budget_bytes, grad
        self._graphs: dict[int, KeptGraph] = {}  # by id of the chunk record, in insertion (capture) order
        self.nbytes = 0

    @staticmethod
    def measuring() -> MemoryTracker:
        """Counts the storages a chunk's forward allocates; those still alive after it (``current_bytes``) are what
        its graph and outputs hold."""
        return MemoryTracker()

    def add(self, record: ChunkRecord, new: list[tuple[Tensor, ...]], hidden: Tensor, nbytes: int) -> None:
        self._graphs[id(record)] = KeptGraph(hidden, new, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.budget_bytes and self._graphs:
            oldest = next(iter(self._graphs))
            self.nbytes -= self._graphs.pop(oldest).nbytes

    def pop(self, record: ChunkRecord) -> KeptGraph | None:
        graph = self._graphs.pop(id(record), None)
        if graph is not None:
            self.nbytes -= graph.nbytes
        return graph

    def __len__(self) -> int:
        return len(self._graphs)

    def __contains__(self, record: object) -> bool:
        return id(record) in self._graphs
