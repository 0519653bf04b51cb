"""Mixed precision for a model that is not sharded: the engine computes with a copy in the compute dtype, AdamW
steps the model's own (master) parameters. ``parallel.parallelize`` makes the copy; the trainer refreshes it.

What FSDP2's ``MixedPrecisionPolicy`` does for a sharded model (``parallel.fsdp``: the all-gather casts the master
shards to the compute dtype, gradients are reduce-scattered in the master dtype), done here for one process or a
replicated data-parallel model, as apex's O2 and DeepSpeed's bf16 optimizer do it: the copy's parameters hand each
gradient autograd accumulates (``register_post_accumulate_grad_hook``) to their master parameter, converted to the
master dtype and summed there, so that a step's many backward passes (one per branch replay, walk step or group)
add in the master dtype, not the compute dtype; after the optimizer step the copy is refreshed from the masters.
Updates smaller than the compute dtype's resolution accumulate in the masters instead of rounding away.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class ComputeCopy:
    """``model`` (the master weights, unchanged) and ``compute``: a copy in ``dtype`` whose gradients go to the
    masters' ``.grad`` (in the masters' dtype). Call ``refresh`` after every change to the masters (an optimizer
    step, a checkpoint load)."""

    def __init__(self, master: nn.Module, dtype: torch.dtype):
        if all(p.dtype == dtype for p in master.parameters()):
            raise ValueError(
                f"mixed precision computes in {dtype}, the dtype the model's weights already have: build the model "
                "in a wider dtype (the master weights: float32 for a bfloat16 run), or train without mixed_precision"
            )
        self.master, self.dtype = master, dtype
        self.compute = copy.deepcopy(master).to(dtype)
        self._pairs = list(zip(self.compute.parameters(), master.parameters(), strict=True))
        for low, high in self._pairs:
            low.requires_grad_(high.requires_grad)
            if high.requires_grad:
                low.register_post_accumulate_grad_hook(_hand_to(high))

    @torch.no_grad()
    def refresh(self) -> None:
        """The copy's weights set to the masters', rounded to the compute dtype."""
        for low, high in self._pairs:
            low.copy_(high)


def _hand_to(master: nn.Parameter):
    def hook(param: torch.Tensor) -> None:
        grad = param.grad
        assert grad is not None  # (the hook runs once autograd has accumulated one)
        param.grad = None
        addend = grad.to(master.dtype)
        if master.grad is None:
            master.grad = addend
        else:
            master.grad.add_(addend)

    return hook
