"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for a policy the engine drives.

Each decoder layer is one FSDP unit and the whole model is the root unit (embeddings, final norm, LM head), sharded
along dim 0 over every rank of the job (``ParallelMesh.shard_mesh``: dp x cp flattened, as torchtitan shards over
data and context ranks together): a rank stores 1/(dp·cp) of every parameter, and AdamW steps its shard.

FSDP2 all-gathers a unit's parameters in the unit's forward pre-hook and reduce-scatters its gradients in a
post-backward hook set up by that forward. The engine never calls a module's forward — it calls a layer's
projections, norms and MLP directly (capture, branch replay, the reverse chunk walk) — so none of those hooks fire.
``gathered`` does their work explicitly: it unshards every unit for a block (``FSDPModule.unshard``), and on leaving
it reshards them and reduce-scatters the gradients the block accumulated on the unsharded parameters into the
sharded ones (a ``Partial`` DTensor redistributed to the parameter's ``Shard(0)``: a sum over dp, each rank keeping
its shard). The cp ranks of one dp rank compute the same gradient (every one holds the group's whole gradient after
its backward), so a gradient is divided by its number of copies (``replicas``) before the sum. Only public APIs are
used (``unshard`` / ``reshard``, DTensor), so FSDP's internal hook state is never entered.

Schedule: one all-gather of the whole model per block (per optimizer step, or per rollout) and one reduce-scatter
per parameter. Peak memory therefore holds the whole unsharded model during the block; gathering layer by layer
across a capture's chunks (DESIGN.md, "Distributed") is not done here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Partial


def shard_model(model: nn.Module, mesh: DeviceMesh) -> None:
    """``fully_shard`` each decoder layer of a transformers CausalLM (``model.model.layers``), then the model.

    Call before building the optimizer: FSDP2 replaces the parameters by DTensor shards."""
    backbone: Any = model.model  # transformers' decoder (typed dynamically, as in the adapters)
    for layer in backbone.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gathered(model: nn.Module, replicas: int = 1) -> Iterator[None]:
    """Every FSDP unit of ``model`` unsharded for the block; on leaving, resharded, with the gradients the block
    accumulated summed over the shard mesh into each parameter's shard — divided by ``replicas``, the number of
    ranks of that mesh holding the same gradient (cp). A no-op for a model that is not sharded.

    Every dp rank must enter and leave together (the all-gathers and reduce-scatters are collectives), and must
    have a gradient for the same parameters (give zeros where a rank has none)."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
    full = dict(model.named_parameters())
    try:
        yield
    except BaseException:
        for param in full.values():  # the unsharded parameters persist: a failed step must not feed the next one
            param.grad = None
        raise
    finally:
        for unit in units:
            unit.reshard()
    for name, shard in model.named_parameters():
        grad = full[name].grad
        if grad is None or not isinstance(shard, DTensor):
            continue
        full[name].grad = None
        if replicas > 1:
            grad.div_(replicas)
        reduced = _reduce_scatter(grad, shard)
        shard.grad = reduced if shard.grad is None else shard.grad + reduced


def _reduce_scatter(grad: torch.Tensor, shard: DTensor) -> DTensor:
    """This rank's full-size gradient, summed over the shard's mesh and cut to the shard's placement."""
    partial = DTensor.from_local(grad, shard.device_mesh, [Partial("sum")] * shard.device_mesh.ndim)
    return partial.redistribute(shard.device_mesh, shard.placements)
