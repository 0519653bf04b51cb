"""Checkpoints of a model and its optimizer, sharded (FSDP2) or not, with ``torch.distributed.checkpoint`` (DCP).

Every rank writes the shards it holds into one folder (no rank gathers the model: at 27B parameters it would not
fit), and DCP writes the metadata that maps each parameter's pieces; a model that is not sharded is written whole
(by one process, or once among ranks holding the same copy: DCP's planner deduplicates). Loading reads the pieces
each rank needs, whatever mesh wrote them: a checkpoint resumes on another dp x cp, with or without FSDP2.
``load_full_model`` reads the model's pieces into a whole, unsharded model in one process (no process group): the
way to a Hugging Face directory (``app.export``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

SHARDED = "sharded"  # the DCP folder inside a checkpoint


# what a checkpoint holds of the model: what trains (a LoRA policy's adapters; everything of a fully trained one) and
# the buffers; frozen weights come from where the model is built (its preset or directory), as they were
TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)
# loading it leaves the frozen weights out (load_state_dict's strictness would ask for them; a key the checkpoint
# lacks is DCP's error before this)
INTO_TRAINED = StateDictOptions(ignore_frozen_params=True, strict=False)


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Write the model's and optimizer's state under ``directory / SHARDED``: every rank its shards (a collective),
    or one process without a process group the whole. Frozen parameters are left out (``TRAINED_ONLY``)."""
    model_state, optim_state = get_state_dict(model, optimizer, options=TRAINED_ONLY)
    with _single_process_is_fine():
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory / SHARDED, no_dist=_alone())


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Read back what ``save_sharded`` wrote into the model's and optimizer's state, whatever mesh wrote it: DCP
    reads each parameter's pieces this rank needs (a collective), whole when the model is not sharded."""
    model_state, optim_state = get_state_dict(model, optimizer, options=TRAINED_ONLY)
    try:
        with _single_process_is_fine():
            dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=directory / SHARDED, no_dist=_alone())
    except CheckpointException as err:  # every rank's traceback in one message: say what went wrong
        raise ValueError(_last_line(err)) from None
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=INTO_TRAINED)


def load_full_model(model: nn.Module, directory: Path) -> None:
    """Fill a whole (unsharded) ``model`` with the weights ``save_sharded`` wrote, in this process alone: every
    tensor the checkpoint holds (what trained, and the buffers: a LoRA policy's frozen weights stay as the model was
    built). A parameter of the model that trains but is not in the checkpoint is an error naming it.

    DCP assembles each parameter from the ranks' pieces; the model's parameter names are the sharded model's."""
    saved = {
        key.removeprefix("model.")
        for key in dcp.FileSystemReader(str(directory / SHARDED)).read_metadata().state_dict_metadata
    }
    missing = [name for name, p in model.named_parameters() if p.requires_grad and name not in saved]
    if missing:
        raise ValueError(f"the checkpoint in {directory} holds no {missing[0]} ({len(missing)} parameters missing)")
    state = {"model": {name: t for name, t in model.state_dict().items() if name in saved}}
    with _single_process_is_fine():
        dcp.load(state, checkpoint_id=directory / SHARDED, no_dist=True)  # in place


def _last_line(err: BaseException) -> str:
    """The cause DCP's exception ends with (e.g. "Size mismatch between saved ... and current ... for ...")."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


def _alone() -> bool:
    """No process group: DCP reads and writes everything in this process."""
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _single_process_is_fine() -> Iterator[None]:
    """Silence DCP's "torch.distributed is ... uninitialized, assuming ... a single process": that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield
