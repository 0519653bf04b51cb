"""Placement in one step: where a policy and its KL reference live, decided before a trainer sees either.

``parallelize(policy, reference, mesh=..., fsdp=..., compute_dtype=...)`` returns a ``Placement``:

- **FSDP2** (``fsdp`` with a mesh): each decoder layer ``fully_shard``ed, then the whole model (the root unit), over
  the mesh's ``shard_mesh`` (``parallel.fsdp.shard_model``); with ``compute_dtype`` FSDP2's mixed-precision policy
  (the shards stay the master weights, a gather casts them), with ``offload`` its CPU offload, with
  ``expert_parallel`` each MoE layer's experts as units of their own, never gathered (``parallel.experts``).
- **Not sharded**: the policy on ``device``; with ``compute_dtype``, a compute copy the engine computes with while
  AdamW steps the masters (``parallel.mixed_precision.ComputeCopy``).
- **The KL reference**: frozen (eval mode, no gradients) and placed as the policy: sharded the same way where the
  policy is (its parameters cast to the policy's compute dtype first: a frozen model needs no master weights, and a
  gather casts to the same values; offloaded and expert-parallel as the policy's), else on ``device``.
- **How a step reaches the weights** (``WeightSharding``, ``ParallelMesh.sharding``): a decoder layer at a time
  inside the engine's schedule when sharded; nothing to gather otherwise.

For one process without mixed precision this is the identity, up to the device and the reference's freezing: the
trainer places a plain model it is given through here itself, so a one-process user never calls it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from longstraw_agents.engine import Engine, StateShards
from longstraw_agents.parallel.experts import experts_sharded
from longstraw_agents.parallel.fsdp import WeightSharding, is_sharded, offloaded
from longstraw_agents.parallel.fsdp import compute_dtype as gathered_dtype
from longstraw_agents.parallel.mesh import ParallelMesh
from longstraw_agents.parallel.mixed_precision import ComputeCopy


@dataclass(frozen=True)
class Placement:
    """A policy and its KL reference as ``parallelize`` placed them.

    policy / reference: as given to ``parallelize`` — a module, or an ``Engine`` over one, whose settings (chunk
        size, context-parallel shards) the trainer's engine takes; the module itself placed in place.
    sharding / reference_sharding: how a step reaches each model's weights.
    compute_copy: mixed precision without FSDP2 (the engine computes with its copy; refresh it after every change
        to the masters).
    mesh: the mesh the placement is over (None: one process, or processes without a mesh)."""

    policy: nn.Module | Engine
    sharding: WeightSharding
    compute_copy: ComputeCopy | None = None
    reference: nn.Module | Engine | None = None
    reference_sharding: WeightSharding | None = None
    mesh: ParallelMesh | None = None

    @property
    def master(self) -> nn.Module:
        """The policy's own module: the weights AdamW steps (FSDP2's shards, or the whole model)."""
        return _module(self.policy)

    @property
    def computed(self) -> nn.Module:
        """The module the engine computes with: the compute copy, or the master itself (FSDP2 casts in its gathers)."""
        return self.compute_copy.compute if self.compute_copy is not None else self.master

    @property
    def shards(self) -> StateShards | None:
        """The policy's context-parallel state shards (an ``Engine``'s; None: one rank holds the whole state)."""
        return _shards(self.policy)

    def refresh_compute_copy(self) -> None:
        """The compute copy set to the masters again, after anything changed them (a step, a load, DDP's broadcast);
        nothing to do without one."""
        if self.compute_copy is not None:
            self.compute_copy.refresh()

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype the policy computes in when it differs from its masters' (None: no mixed precision)."""
        if is_sharded(self.master):
            return gathered_dtype(self.master)
        return self.compute_copy.dtype if self.compute_copy is not None else None


def parallelize(
    policy: nn.Module | Engine,
    reference: nn.Module | Engine | None = None,
    *,
    mesh: ParallelMesh | None = None,
    fsdp: bool = False,
    compute_dtype: torch.dtype | None = None,
    offload: bool = False,
    expert_parallel: bool = False,
    device: torch.device | str | None = None,
) -> Placement:
    """Place ``policy`` (a transformers CausalLM, or an ``Engine`` over one) and its frozen KL ``reference`` for
    training: FSDP2 over ``mesh`` with ``fsdp`` (with one process, no mesh, there is nothing to shard over and the
    model stays whole, as ``layout.layout_problem`` says), mixed precision in ``compute_dtype``, ``offload`` and
    ``expert_parallel`` as ``ParallelMesh.fully_shard`` takes them. ``device``: where an unsharded model goes
    (default: this process's accelerator, as accelerate picks it). Call before building the optimizer: FSDP2
    replaces the parameters by DTensor shards. The modules are placed in place."""
    master, frozen = _module(policy), None if reference is None else _module(reference)
    if frozen is not None and frozen is master:
        raise ValueError("the KL reference is the policy itself; pass a frozen copy (copy.deepcopy(model))")
    for module, role in ((master, "policy"), (frozen, "KL reference")):
        if module is not None and is_sharded(module):
            raise ValueError(
                f"the {role} is already sharded (FSDP2): pass it unsharded to parallelize(..., fsdp=True), which "
                "shards the policy and its reference together"
            )
    sharded = fsdp and mesh is not None
    if not sharded and (offload or expert_parallel):
        raise ValueError("offload and expert_parallel run through FSDP2: they need fsdp=True and a mesh")
    copy = None
    if sharded:
        assert mesh is not None
        mesh.fully_shard(master, compute_dtype, offload, expert_parallel=expert_parallel)
    else:  # (FSDP2 places a sharded model: on the mesh's device, its shards on the host where offloaded)
        device = _default_device() if device is None else device
        master.to(device)
        copy = _compute_copy(master, compute_dtype, context_parallel=_shards(policy) is not None)
    sharding = mesh.sharding(master) if mesh is not None else WeightSharding(master)
    reference_sharding = None
    if frozen is not None:
        reference_sharding = _place_reference(frozen, master, mesh if sharded else None, device)
    return Placement(policy, sharding, copy, reference, reference_sharding, mesh)


def _place_reference(
    reference: nn.Module, policy: nn.Module, shard_over: ParallelMesh | None, device: torch.device | str | None
) -> WeightSharding:
    """The KL reference frozen (eval mode, no gradients) and placed as the (already placed) ``policy``: on ``device``
    beside an unsharded policy; beside a sharded one (``shard_over`` its mesh) sharded the same way — its shards in
    the policy's compute dtype, offloaded where the policy's are, its experts held by the cp ranks where the
    policy's are — and reached as the policy's weights are. A frozen copy whole on every GPU beside a sharded policy
    would cost the whole model in the master dtype."""
    reference.eval().requires_grad_(False)
    if shard_over is None:
        reference.to(device)
        return WeightSharding(reference)
    dtype = gathered_dtype(policy)
    if dtype is not None:  # frozen: its shards need not be master weights (a gather casts to the same values)
        for param in reference.parameters():  # (not its buffers: RoPE's inv_freq stays fp32, as the policy's)
            param.data = param.data.to(dtype)
    shard_over.fully_shard(reference, None, offloaded(policy), expert_parallel=experts_sharded(policy))
    reference.requires_grad_(False)  # (FSDP2's DTensor shards are new parameters)
    return shard_over.sharding(reference, role="reference")


def _compute_copy(master: nn.Module, dtype: torch.dtype | None, context_parallel: bool) -> ComputeCopy | None:
    """Mixed precision for a model FSDP2 does not shard (a sharded one gets it from FSDP2's policy)."""
    if dtype is None:
        return None
    if context_parallel:
        raise ValueError(
            "mixed precision with context parallelism needs the model sharded (parallelize(..., fsdp=True); "
            "parallel.fsdp: true): the cp ranks sum the gradients of the weights they compute with, which a compute "
            "copy hands to its masters before the sum"
        )
    return ComputeCopy(master, dtype)


def _module(model: nn.Module | Engine) -> nn.Module:
    return model.model if isinstance(model, Engine) else model


def _shards(model: nn.Module | Engine) -> StateShards | None:
    return model.shards if isinstance(model, Engine) else None


def _default_device() -> torch.device:
    """This process's accelerator as accelerate places a model (``GRPOTrainer``'s ``Accelerator`` agrees)."""
    from accelerate import PartialState  # (imported here: the planner imports this package and needs no accelerate)

    return PartialState().device
