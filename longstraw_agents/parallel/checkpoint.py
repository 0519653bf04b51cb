"""Sharded checkpoints of an FSDP2 model and its optimizer with ``torch.distributed.checkpoint`` (DCP).

Every rank writes the shards it holds into one folder (no rank gathers the model: at 27B parameters it would not
fit), and DCP writes the metadata that maps each parameter's pieces; the cp ranks of a dp rank hold the same shards
and DCP's planner keeps one copy. Loading reads each rank's pieces back in place, on the same mesh (DCP can also
reshard to another mesh, untested here). ``load_full_model`` reads the model's pieces into a whole, unsharded model
in one process (no process group): the way to a Hugging Face directory (``app.export``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

SHARDED = "sharded"  # the DCP folder inside a checkpoint


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Write the model's and optimizer's shards under ``directory / SHARDED`` (a collective: every rank calls)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory / SHARDED)


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Read back what ``save_sharded`` wrote into the model's and optimizer's shards (a collective)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=directory / SHARDED)  # in place
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)


def load_full_model(model: nn.Module, directory: Path) -> None:
    """Fill a whole (unsharded) ``model`` with the weights ``save_sharded`` wrote, in this process alone.

    DCP assembles each parameter from the ranks' pieces; the model's parameter names are the sharded model's."""
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process": yes
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, checkpoint_id=directory / SHARDED, no_dist=True)  # in place
