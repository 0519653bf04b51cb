"""Parallelism outside the model code: the device mesh and its process groups (``mesh``), and context parallelism
for the engine's state (``context``: who stores which positions, ``BalancedOwnership``, and the messages between the
ranks, ``GroupTransport``). Model code and adapters know nothing of it; the engine takes a ``ContextParallel``
holding one of each (``Engine(model, shards=...)``) and the attention core merges the ranks' partial results.

With ``LONGSTRAW_COMM_LOG=<dir>`` set, importing this package records every process group call into ``<dir>``
(``discipline``: the checker of NCCL's matching discipline on CPU runs)."""

from longstraw_agents.parallel.context import BalancedOwnership, ContextParallel, GroupTransport, PairChannels
from longstraw_agents.parallel.discipline import record_from_env
from longstraw_agents.parallel.mesh import ParallelMesh

record_from_env()

__all__ = ["BalancedOwnership", "ContextParallel", "GroupTransport", "PairChannels", "ParallelMesh"]
