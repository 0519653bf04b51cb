"""What each byte a rank holds during a training step is for: the roles a ``MemoryTracker`` attributes its bytes to,
named as the planner's categories, so that a measured peak compares with ``longstraw plan`` category by category.

    with step_roles(model, optimizer) as roles, MemoryTracker(roles=roles) as tracker:
        trainer.train_step(groups)
    tracker.peak_roles, tracker.role_peaks   # bytes by role at the peak, and the most each held

- ``weights``, ``gradients``: this rank's shards of the parameters (DTensors under FSDP2) and their gradients, or the
  parameters themselves when nothing is sharded;
- ``optimizer state``: the optimizer's tensors (AdamW's moments);
- ``gathered weights``, ``gathered gradients``: what FSDP2 holds whole (``parallel.fsdp.whole_now``), gathers in
  flight included;
- ``captured state``: the engine states alive (every ``State`` made inside the block);
- everything else is the tracker's ``other``: graphs, a capture's working set, messages, reductions in flight.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from longstraw_agents.memory import Roles
from longstraw_agents.parallel.fsdp import is_sharded, whole_now
from longstraw_agents.state import State, observe_states


@contextlib.contextmanager
def step_roles(model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[Roles]:
    """The roles of a step on ``model`` (sharded or not) stepped by ``optimizer``; states are seen while open."""
    states: weakref.WeakSet[State] = weakref.WeakSet()
    parameters = list(model.parameters())  # (FSDP2's sharded parameters: the same objects for the model's life)
    sharded = is_sharded(model)

    roles: Roles = {
        "weights": lambda: parameters,
        "gradients": lambda: [p.grad for p in parameters if p.grad is not None],
        "optimizer state": lambda: [
            t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0
        ],
        "gathered weights": lambda: whole_now(model)[0] if sharded else [],
        "gathered gradients": lambda: whole_now(model)[1] if sharded else [],
        "captured state": lambda: [t for state in list(states) for t in state.tensors()],
    }
    with observe_states(states.add):
        yield roles
