"""GRPO groups: members built from a prompt and its completions or from whole trajectories, their prefix tree, and
each member's advantage and aggregation weight."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from longstraw_agents.segmenter import Member, PrefixTree, build_tree
from longstraw_agents.token_ids import TokenIds, as_token_ids
from longstraw_agents.trainer.loss import AGGREGATIONS, LossConfig, MemberTerms, group_advantages
from longstraw_agents.trajectory import Trajectory


@dataclass
class Group:
    """A GRPO group ready for the loss: its prefix tree and each member's advantage and weight."""

    tree: PrefixTree
    terms: list[MemberTerms]
    rewards: list[float]

    @property
    def members(self) -> list[Member]:
        return self.tree.members

    @property
    def num_loss_tokens(self) -> int:
        return sum(m.num_loss_tokens for m in self.members)


def make_group(members: Sequence[Member], rewards: Sequence[float], config: LossConfig) -> Group:
    members = list(members)
    if len(rewards) != len(members):
        raise ValueError(f"{len(rewards)} rewards for {len(members)} members")
    advantages = group_advantages(rewards, scale=config.scale_rewards).tolist()
    lengths = [m.num_loss_tokens for m in members]
    if sum(lengths) == 0:
        raise ValueError("no member has a loss token (check the loss masks / completions)")
    weights = AGGREGATIONS[config.aggregation].weights(lengths, config)
    terms = [MemberTerms(advantage=a, weight=w) for a, w in zip(advantages, weights, strict=True)]
    return Group(tree=build_tree(members), terms=terms, rewards=[float(r) for r in rewards])


def batch_weighted(
    groups: Sequence[Group], config: LossConfig, pool: Sequence[int] | None = None, offset: int = 0
) -> list[Group]:
    """The groups with member weights from the aggregation over all their members as one pool
    (``LossConfig.normalization="batch"``): summed, their losses are the batch's loss, e.g. Σ loss / Σ tokens of
    the whole batch for token-mean. ``pool``: the loss-token counts of every member of the batch when it spans more
    than ``groups`` (data parallel: all processes' members in rank order), these groups' members from ``offset``."""
    own = [m.num_loss_tokens for g in groups for m in g.members]
    lengths = own if pool is None else list(pool)
    if lengths[offset : offset + len(own)] != own:
        raise ValueError(f"pool[{offset}:{offset + len(own)}] must be the loss-token counts of these groups' members")
    weights = AGGREGATIONS[config.aggregation].weights(lengths, config)[offset : offset + len(own)]
    rows = iter(weights)
    return [
        dataclasses.replace(group, terms=[MemberTerms(t.advantage, next(rows)) for t in group.terms])
        for group in groups
    ]


def token_array(values: TokenIds, name: str) -> np.ndarray:
    """Non-empty 1-D int64 token ids (``longstraw_agents.token_ids``: floats and bools refused, never cast)."""
    return as_token_ids(values, name).cpu().numpy()


def completion_members(
    prompt: np.ndarray,
    completions: Sequence[TokenIds],
    old_logprobs: Sequence[Sequence[float] | Tensor | None] | None = None,
) -> list[Member]:
    """One member per completion of ``prompt`` (ids from ``token_array``); loss on the completion's tokens.

    completions: G 1-D token sequences (a 2-D tensor is refused: a padded batch would train on its padding);
    old_logprobs: per completion, its behaviour log-probs or None (on-policy)."""
    if isinstance(completions, Tensor):
        raise TypeError(
            f"completions must be a list of G 1-D token tensors (one per member), got a tensor of shape "
            f"{tuple(completions.shape)}; pass list(completions) if its rows are unpadded completions"
        )
    completions = list(completions)
    if not completions:
        raise ValueError("completions is empty")
    if old_logprobs is not None and len(old_logprobs) != len(completions):
        raise ValueError(
            f"old_logprobs has {len(old_logprobs)} entries for {len(completions)} completions "
            "(one per completion, None where unknown)"
        )
    members = []
    for k, completion in enumerate(completions):
        ids = token_array(completion, f"completion {k}")
        behaviour = None if old_logprobs is None else old_logprobs[k]
        logprobs = None if behaviour is None else _logprob_array(behaviour, f"old_logprobs[{k}]")
        members.append(Member.from_prompt_completion(prompt, ids, logprobs))
    return members


def trajectory_rewards(trajectories: Sequence[Trajectory], rewards: Sequence[float] | None) -> list[float]:
    """``rewards`` when given, else each trajectory's own (a missing reward is an error, never 0)."""
    if rewards is not None:
        return list(rewards)
    own = [t.reward for t in trajectories]
    missing = [k for k, reward in enumerate(own) if reward is None]
    if missing:
        raise ValueError(f"trajectories {missing} have no reward; set trajectory.reward or pass rewards=...")
    return [float(reward) for reward in own if reward is not None]


def trajectory_group(trajectories: Sequence[Trajectory], rewards: Sequence[float] | None, config: LossConfig) -> Group:
    """A group of whole trajectories: loss masks and behaviour log-probs come from their segments."""
    rewards = trajectory_rewards(trajectories, rewards)
    return make_group([Member.from_trajectory(t) for t in trajectories], rewards, config)


def _logprob_array(values: Tensor | Sequence[float], name: str) -> np.ndarray:
    """1-D float64 log-probs (ints are fine; bools and strings are not numbers here)."""
    numbers: np.ndarray | Sequence[float]
    if isinstance(values, Tensor):
        if values.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(values.shape)}")
        tensor = values.detach().cpu()
        numbers = (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()  # numpy has no bfloat16
    else:
        numbers = values
    try:
        array = np.asarray(numbers)
    except (TypeError, ValueError) as err:  # ragged nesting
        raise ValueError(f"{name}: expected a 1-D sequence of numbers: {err}") from None
    if array.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {array.shape}")
    if array.size and array.dtype.kind not in "iuf":
        raise TypeError(f"{name}: expected real numbers, got dtype {array.dtype}")
    return array.astype(np.float64)
