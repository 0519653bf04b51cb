"""The loss of one prefix-tree node: the GRPO objective at the node's targets, summed over the members that put loss
there with their advantages and weights. Every execution mode evaluates its loss through ``NodeLoss``; naive mode
treats a member's whole sequence as one node (``member_node``)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from longstraw_agents.segmenter import Member, Node
from longstraw_agents.trainer.group import Group
from longstraw_agents.trainer.head import Head
from longstraw_agents.trainer.loss import GRPOLoss
from longstraw_agents.trainer.metrics import LossSums


def member_node(member: Member, index: int) -> Node:
    """Member ``index``'s whole sequence as one node (targets 1..n-1, fed the inputs 0..n-2)."""
    return Node(
        start=0,
        end=len(member),
        token_ids=member.token_ids,
        input_ids=member.token_ids[:-1],
        members=[index],
        masks={index: member.loss_mask[1:]},
        logprobs={index: None if member.logprobs is None else member.logprobs[1:]},
    )


class NodeLoss:
    """The loss of one node's targets, vectorised over the M members with loss there.

    head: the policy's LM head (log-probs come from hidden states in tiles, never as [T, V] logits).
    ref_logp: the reference model's log-probs of the node's targets ``[T]`` (needed when beta > 0).
    """

    def __init__(
        self,
        group: Group,
        node: Node,
        objective: GRPOLoss,
        head: Head,
        device: torch.device,
        ref_logp: Tensor | None = None,
    ):
        self.objective = objective
        self.head = head
        self.temperature = objective.config.temperature
        self.targets = torch.as_tensor(node.targets, dtype=torch.long, device=device)  # [T]
        members = [i for i in node.members if node.masks[i].any()]
        self.mask = torch.as_tensor(np.stack([node.masks[i] for i in members]), device=device)  # [M, T] bool
        self.advantage = torch.tensor([group.terms[i].advantage for i in members], dtype=torch.float64, device=device)
        self.weight = torch.tensor([group.terms[i].weight for i in members], dtype=torch.float64, device=device)
        old = [node.logprobs[i] for i in members]
        self.old = None  # [M, T] behaviour log-probs, NaN where unknown
        if any(lp is not None for lp in old):
            rows = [lp if lp is not None else np.full(len(self.targets), np.nan) for lp in old]
            self.old = torch.as_tensor(np.stack(rows), dtype=torch.float64, device=device)
        self.ref = None if ref_logp is None else ref_logp.to(torch.float64)  # [T] reference log-probs of the targets
        self._zero = LossSums.zeros(device)

    def __call__(self, hidden: Tensor, lo: int, hi: int) -> tuple[Tensor, LossSums]:
        """Loss of rows ``[lo, hi)`` of the node given their final hidden states ``[hi - lo, H]``: a scalar in the
        model's dtype (to backpropagate) and its sums (detached, on the device)."""
        logp = self.head.logprobs(hidden, self.targets[lo:hi], self.temperature).to(torch.float64)
        mask = self.mask[:, lo:hi]
        old = None if self.old is None else self.old[:, lo:hi]
        ref = None if self.ref is None else self.ref[lo:hi]
        per_token, metrics = self.objective(logp.unsqueeze(0).expand_as(mask), self.advantage.unsqueeze(1), old, ref)
        loss = (per_token * mask * self.weight.unsqueeze(1)).sum()
        kl_sum, kl_tokens = self._zero.kl_sum, self._zero.kl_tokens
        if metrics.kl is not None:
            kl_sum, kl_tokens = torch.where(mask, metrics.kl, 0.0).sum(), mask.sum()
        return loss.to(hidden.dtype), LossSums(loss.detach(), kl_sum, kl_tokens)
