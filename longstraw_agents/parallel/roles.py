"""What each byte a rank holds during a training step is for: the roles a ``MemoryTracker`` attributes its bytes to,
named as the planner's categories, so that a measured peak compares with ``longstraw plan`` category by category.

    with MemoryTracker() as tracker, step_roles(model, optimizer, on_state=tracker.snapshot) as roles:
        tracker.roles = roles
        trainer.train_step(groups)
        tracker.snapshot()                   # the gradient shards, all reduced
    tracker.peak_roles, tracker.role_peaks   # bytes by role at the peak, and the most each held

- ``weights``, ``gradients``: this rank's shards of the parameters (DTensors under FSDP2) and their gradients, or the
  parameters themselves when nothing is sharded;
- ``optimizer state``: the optimizer's tensors (AdamW's moments);
- ``gathered weights``, ``gathered gradients``: what FSDP2 holds whole (``parallel.fsdp_state.whole_now``), gathers in
  flight included;
- ``captured state``: the engine states alive (every ``State`` made inside the block);
- everything else is the tracker's ``other``: graphs, a capture's working set, messages, reductions in flight.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn

from longstraw_agents.memory import Roles
from longstraw_agents.parallel.fsdp import is_sharded
from longstraw_agents.parallel.fsdp_state import param_groups, whole_now
from longstraw_agents.state import State, observe_states


@contextlib.contextmanager
def step_roles(
    model: nn.Module, optimizer: torch.optim.Optimizer, on_state: Callable[[], object] | None = None
) -> Iterator[Roles]:
    """The roles of a step on ``model`` (sharded or not) stepped by ``optimizer``; states are seen while open, and
    ``on_state`` is called after each is made (``MemoryTracker.snapshot``: the state's most is then seen even where
    it is not the peak's)."""
    states: weakref.WeakSet[State] = weakref.WeakSet()
    parameters = list(model.parameters())  # (FSDP2's sharded parameters: the same objects for the model's life)
    groups = param_groups(model) if is_sharded(model) else []

    roles: Roles = {
        "weights": lambda: parameters,
        "gradients": lambda: [p.grad for p in parameters if p.grad is not None],
        "optimizer state": lambda: [
            t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0
        ],
        "gathered weights": lambda: whole_now(groups)[0],
        "gathered gradients": lambda: whole_now(groups)[1],
        "captured state": lambda: [t for state in list(states) for t in state.tensors()],
    }

    def seen(state: State) -> None:
        states.add(state)
        if on_state is not None:
            on_state()

    with observe_states(seen):
        yield roles
