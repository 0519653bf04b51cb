"""Parallelism outside the model code: the device mesh and its process groups (``mesh``), placement of a policy and
its KL reference in one step (``parallelize``: FSDP2, mixed precision, the reference's sharding), and context
parallelism for the engine's state (``context``: who stores which positions, ``BalancedOwnership``, and the messages
between the ranks, ``GroupTransport``). Model code and adapters know nothing of it; the engine takes a
``ContextParallel`` holding one of each (``Engine(model, shards=...)``) and the attention core merges the ranks'
partial results.

Importing this package changes nothing in torch. Recording every process group call for the checker of NCCL's
matching discipline (``discipline``) is an explicit call: ``discipline.record_to``, or joining a job
(``launch.init_from_env``) with ``LONGSTRAW_COMM_LOG=<dir>`` set."""

from longstraw_agents.parallel.context import BalancedOwnership, ContextParallel, GroupTransport, PairChannels
from longstraw_agents.parallel.mesh import ParallelMesh
from longstraw_agents.parallel.parallelize import Placement, parallelize

__all__ = [
    "BalancedOwnership",
    "ContextParallel",
    "GroupTransport",
    "PairChannels",
    "ParallelMesh",
    "Placement",
    "parallelize",
]
