"""Typed metric records, from one node's tokens up to one optimizer step.

- ``TokenMetrics``: what ``GRPOLoss`` reports per token besides the loss (the k3 KL).
- ``LossSums``: running sums over a group's loss tokens, kept as 0-d tensors on the device, so a walk adds to them
  node by node without a host sync; ``reduce`` turns them into Python numbers once per group.
- ``WalkMetrics``: what an execution mode returns for one group (the sums and host-side counts).
- ``BackwardResult``: one group's backward (``backward_group``, ``grpo_backward``), in Python numbers.
- ``IterationMetrics``: one optimizer step of a ``GRPOTrainer.train_step`` (μ = ``num_iterations`` per call).
- ``StepMetrics``: one ``GRPOTrainer.train_step`` (μ optimizer steps on one batch); ``to_dict`` gives its JSON form.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class TokenMetrics:
    """Per-token figures of ``GRPOLoss`` besides the loss, detached.

    kl: ``k3(l_ref - l)`` per token, the shape of the per-token loss; None without a KL term (beta = 0).
    """

    kl: Tensor | None = None


@dataclass(frozen=True)
class LossSums:
    """Sums over loss tokens, as 0-d tensors on the loss's device (adding two never syncs with the host).

    loss: ``Σ c_i · per_token_loss`` (float64, detached); kl_sum: ``Σ k3`` over loss tokens with a KL term
    (float64); kl_tokens: how many tokens those are (int64).
    """

    loss: Tensor
    kl_sum: Tensor
    kl_tokens: Tensor

    @classmethod
    def zeros(cls, device: torch.device | str) -> LossSums:
        zero = torch.zeros((), dtype=torch.float64, device=device)
        return cls(zero, zero, torch.zeros((), dtype=torch.int64, device=device))

    def __add__(self, other: LossSums) -> LossSums:
        return LossSums(self.loss + other.loss, self.kl_sum + other.kl_sum, self.kl_tokens + other.kl_tokens)

    def __sub__(self, other: LossSums) -> LossSums:
        return LossSums(self.loss - other.loss, self.kl_sum - other.kl_sum, self.kl_tokens - other.kl_tokens)

    def mapped(self, fn: Callable[[Tensor], Tensor]) -> LossSums:
        """The sums with ``fn`` applied to all three at once (one call: ``fn`` may be a collective), as float64."""
        loss, kl_sum, kl_tokens = fn(torch.stack([self.loss, self.kl_sum, self.kl_tokens.to(torch.float64)]))
        return LossSums(loss, kl_sum, kl_tokens.round().to(torch.int64))

    def reduce(self) -> tuple[float, float | None]:
        """``(loss, mean k3 KL per loss token or None)`` in one host transfer."""
        loss, kl_sum, kl_tokens = torch.stack([self.loss, self.kl_sum, self.kl_tokens.to(torch.float64)]).tolist()
        return loss, (kl_sum / kl_tokens if kl_tokens else None)


@dataclass(frozen=True)
class WalkMetrics:
    """One group's evaluation by an execution mode.

    nodes: loss evaluations (tree nodes visited, or members in naive mode); forward_tokens: tokens run through the
    policy, with or without a graph, recomputation included.
    """

    sums: LossSums
    nodes: int
    forward_tokens: int


@dataclass(frozen=True)
class BackwardResult:
    """One group's GRPO backward (the gradient itself went into ``param.grad``).

    loss: the group's loss value; mode: the execution mode; num_members: G (episodes); loss_tokens: loss tokens
    summed over members (a shared token counts once per member); unique_tokens: token positions of the prefix tree
    (each shared token once); forward_tokens / nodes: as ``WalkMetrics``; peak_bytes: peak live tensor bytes (None
    when not tracked); seconds: wall time; advantages / rewards: per episode; kl: mean k3 KL per loss token (None
    without a KL term); prompt_tokens: the shared prompt's length (``grpo_backward`` only); sequences /
    sequence_tokens: the physical sequences of the tree and their summed length (G and the members' lengths unless
    an episode edited its context), what training each sequence on its own would evaluate.
    """

    loss: float
    mode: str
    num_members: int
    loss_tokens: int
    unique_tokens: int
    forward_tokens: int
    nodes: int
    peak_bytes: int | None
    seconds: float
    advantages: tuple[float, ...]
    rewards: tuple[float, ...]
    kl: float | None = None
    prompt_tokens: int | None = None
    sequences: int = 0
    sequence_tokens: int = 0


@dataclass(frozen=True)
class IterationMetrics:
    """One optimizer step on a batch of groups (a ``train_step`` makes ``num_iterations`` of them).

    loss: the batch's loss (mean of the groups' losses; their sum with batch normalisation, where each group's loss
    is its share of the batch's); grad_norm: the global norm before clipping; lr: the learning rate it used; kl:
    mean of the groups' KL (None without a KL term); forward_tokens / seconds: summed over groups; peak_bytes: the
    largest group's peak (None when not tracked).
    """

    loss: float
    grad_norm: float
    lr: float
    kl: float | None
    forward_tokens: int
    seconds: float
    peak_bytes: int | None

    @classmethod
    def of_groups(
        cls, results: Sequence[BackwardResult], *, grad_norm: float, lr: float, summed: bool = False
    ) -> IterationMetrics:
        """``summed``: the groups' losses are shares of one batch loss (batch normalisation)."""
        losses = [res.loss for res in results]
        peaks = [res.peak_bytes for res in results if res.peak_bytes is not None]
        kls = [res.kl for res in results if res.kl is not None]
        return cls(
            loss=float(np.sum(losses) if summed else np.mean(losses)),
            grad_norm=grad_norm,
            lr=lr,
            kl=float(np.mean(kls)) if kls else None,
            forward_tokens=sum(res.forward_tokens for res in results),
            seconds=sum(res.seconds for res in results),
            peak_bytes=max(peaks) if peaks else None,
        )


@dataclass(frozen=True)
class StepMetrics:
    """One ``train_step`` over this process's groups: ``num_iterations`` optimizer steps on the same batch.

    step / policy_version: the counters after the step; loss / grad_norm / lr / kl: of the first optimizer step
    (on-policy, as with ``num_iterations=1``); reward_mean / reward_std: over all members (population std);
    loss_tokens / unique_tokens: summed over groups; sequence_tokens: the summed length of the groups' physical
    sequences (what training each as its own sample evaluates; the episodes' lengths unless one edited its
    context); forward_tokens / seconds: summed over groups and optimizer steps; peak_bytes: the largest group's
    peak (None when not tracked); iterations: each optimizer step's figures.
    """

    step: int
    policy_version: int
    mode: str
    loss: float
    reward_mean: float
    reward_std: float
    grad_norm: float
    lr: float
    loss_tokens: int
    unique_tokens: int
    sequence_tokens: int
    forward_tokens: int
    seconds: float
    peak_bytes: int | None
    kl: float | None
    iterations: tuple[IterationMetrics, ...] = ()

    @classmethod
    def of_iterations(
        cls,
        results: Sequence[BackwardResult],
        iterations: Sequence[IterationMetrics],
        *,
        step: int,
        policy_version: int,
        mode: str,
    ) -> StepMetrics:
        """``results``: the groups of the first optimizer step (rewards and token counts are the same in all)."""
        rewards = [r for res in results for r in res.rewards]
        first = iterations[0]
        peaks = [it.peak_bytes for it in iterations if it.peak_bytes is not None]
        return cls(
            step=step,
            policy_version=policy_version,
            mode=mode,
            loss=first.loss,
            reward_mean=float(np.mean(rewards)),
            reward_std=float(np.std(rewards)),
            grad_norm=first.grad_norm,
            lr=first.lr,
            loss_tokens=sum(res.loss_tokens for res in results),
            unique_tokens=sum(res.unique_tokens for res in results),
            sequence_tokens=sum(res.sequence_tokens for res in results),
            forward_tokens=sum(it.forward_tokens for it in iterations),
            seconds=sum(it.seconds for it in iterations),
            peak_bytes=max(peaks) if peaks else None,
            kl=first.kl,
            iterations=tuple(iterations),
        )

    def to_dict(self) -> dict[str, Any]:
        """A plain JSON-able dict with the same keys (``iterations``: a list of dicts)."""
        return {**dataclasses.asdict(self), "iterations": [dataclasses.asdict(it) for it in self.iterations]}
