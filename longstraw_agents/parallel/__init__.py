"""Parallelism outside the model code: the device mesh and its process groups (``mesh``), and context parallelism
for the engine's state (``context``: who stores which positions, ``EvenShards``, and the messages between the ranks,
``GroupTransport``). Model code and adapters know nothing of it; the engine takes a ``ContextParallel`` holding one
of each (``Engine(model, shards=...)``) and the attention core merges the ranks' partial results."""

from longstraw_agents.parallel.context import ContextParallel, EvenShards, GroupTransport
from longstraw_agents.parallel.mesh import ParallelMesh

__all__ = ["ContextParallel", "EvenShards", "GroupTransport", "ParallelMesh"]
