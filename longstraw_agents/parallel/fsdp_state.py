"""Every read of FSDP2's private state, in this one module.

FSDP2 (``torch.distributed.fsdp.fully_shard``) has public calls for what a schedule does to a unit (``unshard``,
``reshard``, ``set_custom_all_gather``) but none for what this package looks up: a unit's mixed-precision and
offload policies, the packed shard its all-gather sends (``parallel.lanes`` sends it to another lane's ranks) and
what it holds whole right now (memory attribution, ``parallel.roles``). The functions below read them from the
internals of **torch 2.13** (``torch.distributed.fsdp._fully_shard``: ``FSDPState._mp_policy`` and
``_fsdp_param_group``, ``FSDPParamGroup.offload_policy`` / ``fsdp_params`` / ``_all_gather_result``,
``FSDPParam._sharded_param_data`` / ``_unsharded_param`` / ``param_dtype``, ``FSDPState._lazy_init``, and the
``AllGather`` interface ``set_custom_all_gather`` takes). A torch release that renames them is repaired here alone:
tests/parallel/test_fsdp_state.py reads each on a sharded model and checks that no other module of the package
touches them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy

# the interface of a custom all-gather (``FSDPModule.set_custom_all_gather``), exported by no public module
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as AllGather


def _state(unit: nn.Module) -> Any:
    """The unit's ``FSDPState`` (``unit`` is an ``FSDPModule``: ``fully_shard`` changed its class)."""
    return unit._get_fsdp_state()  # type: ignore[operator]


def mixed_precision_policy(unit: nn.Module) -> MixedPrecisionPolicy:
    """The mixed-precision policy ``fully_shard`` gave ``unit``."""
    return _state(unit)._mp_policy


def offload_policy(unit: nn.Module) -> OffloadPolicy | None:
    """The offload policy of ``unit``'s own parameters (None: it has none of its own)."""
    group = _state(unit)._fsdp_param_group
    return None if group is None else group.offload_policy


def lazy_init(root: nn.Module) -> None:
    """What the root unit's first gather does (FSDP2 sets up its units then): for a rank that serves another's
    gathers of a unit before it gathers one itself."""
    _state(root)._lazy_init()


def unit_params(unit: nn.Module) -> list[Any]:
    """``unit``'s own parameters as FSDP2 holds them (its ``FSDPParam``s), in the order its all-gather packs them."""
    group = _state(unit)._fsdp_param_group
    return [] if group is None else list(group.fsdp_params)


def packed_shard(params: Sequence[Any]) -> Tensor:
    """This rank's input to a unit's all-gather as FSDP2 packs it (each parameter's padded shard in the compute
    dtype, flat and back to back; as bytes where the dtypes differ), from ``unit_params`` once the root is set up
    (``lazy_init``) — read from the shards whatever the unit's state here (FSDP2's own accessor asserts that the
    unit is sharded: this rank may be computing with it whole)."""
    parts = []
    for param in params:
        data = param._sharded_param_data
        parts.append(data.to(device=param.device, dtype=param.param_dtype or data.dtype).reshape(-1))
    if len({t.dtype for t in parts}) > 1:
        parts = [t.view(torch.uint8) for t in parts]
    return torch.cat(parts)


def param_groups(model: nn.Module) -> list[Any]:
    """FSDP2's per-unit state of a sharded ``model`` (each unit's parameter group), for ``whole_now``."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    groups = [_state(unit)._fsdp_param_group for unit in units]
    return [group for group in groups if group is not None]


def whole_now(groups: Sequence[Any]) -> tuple[list[Tensor], list[Tensor]]:
    """What a sharded model holds whole now, from its ``param_groups``: the gathered parameters (with their storage;
    FSDP2 keeps the same tensors from one gather to the next, their storage freed between) and the buffers of
    gathers started but not yet waited for; and those parameters' gradients."""
    weights: list[Tensor] = []
    gradients: list[Tensor] = []
    for group in groups:
        for fsdp_param in group.fsdp_params:
            whole = getattr(fsdp_param, "_unsharded_param", None)
            if whole is None:
                continue
            if whole.untyped_storage().nbytes():
                weights.append(whole)
            if whole.grad is not None:
                gradients.append(whole.grad)
        if group._all_gather_result is not None:
            weights.append(group._all_gather_result.all_gather_output)
    return weights, gradients
