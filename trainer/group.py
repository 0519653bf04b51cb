"""GRPO groups: members built from a prompt and its completions or from whole trajectories, their prefix tree, and
each member's advantage and aggregation weight."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from longstraw_agents.segmenter import Member, PrefixTree, build_tree, episode_members
from longstraw_agents.token_ids import TokenIds, as_token_ids
from longstraw_agents.trainer.loss import AGGREGATIONS, LossConfig, MemberTerms, group_advantages
from longstraw_agents.trajectory import Trajectory


@dataclass
class Group:
    """A GRPO group ready for the loss: its prefix tree and each member's advantage and weight.

    A member is a token sequence of the tree; ``episodes[i]`` is the GRPO sample (index into ``rewards``) member i
    belongs to. An episode that edited its context is several members (its physical sequences) sharing its one
    reward, advantage and aggregation weight; otherwise member i is episode i."""

    tree: PrefixTree
    terms: list[MemberTerms]
    rewards: list[float]
    episodes: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.episodes:
            self.episodes = list(range(len(self.tree.members)))

    @property
    def members(self) -> list[Member]:
        return self.tree.members

    @property
    def num_loss_tokens(self) -> int:
        return sum(m.num_loss_tokens for m in self.members)

    def advantages(self) -> list[float]:
        """Each episode's advantage."""
        by_episode = dict(zip(self.episodes, (t.advantage for t in self.terms), strict=True))
        return [by_episode[e] for e in range(len(self.rewards))]

    def episode_loss_tokens(self) -> list[int]:
        """Each episode's loss tokens, over all its physical sequences (what the aggregation normalises by)."""
        return _episode_sums([m.num_loss_tokens for m in self.members], self.episodes, len(self.rewards))


def _episode_sums(lengths: Sequence[int], episodes: Sequence[int], count: int) -> list[int]:
    sums = [0] * count
    for length, episode in zip(lengths, episodes, strict=True):
        sums[episode] += length
    return sums


def make_group(
    members: Sequence[Member], rewards: Sequence[float], config: LossConfig, episodes: Sequence[int] | None = None
) -> Group:
    """The group of ``members`` with one reward per episode; ``episodes``: the episode of each member when an episode
    is several physical sequences (default: one member per episode)."""
    members = list(members)
    if episodes is None and len(rewards) != len(members):
        raise ValueError(f"{len(rewards)} rewards for {len(members)} members")
    owners = list(range(len(members))) if episodes is None else [int(e) for e in episodes]
    if len(owners) != len(members):
        raise ValueError(f"{len(owners)} episode indices for {len(members)} members")
    if sorted(set(owners)) != list(range(len(rewards))):
        raise ValueError(f"{len(rewards)} rewards for the episodes {sorted(set(owners))} of {len(members)} members")
    advantages = group_advantages(rewards, scale=config.scale_rewards).tolist()
    lengths = _episode_sums([m.num_loss_tokens for m in members], owners, len(rewards))
    if sum(lengths) == 0:
        raise ValueError("no member has a loss token (check the loss masks / completions)")
    weights = AGGREGATIONS[config.aggregation].weights(lengths, config)
    terms = [MemberTerms(advantage=advantages[e], weight=weights[e]) for e in owners]
    return Group(tree=build_tree(members), terms=terms, rewards=[float(r) for r in rewards], episodes=owners)


def batch_weighted(
    groups: Sequence[Group], config: LossConfig, pool: Sequence[int] | None = None, offset: int = 0
) -> list[Group]:
    """The groups with member weights from the aggregation over all their episodes as one pool
    (``LossConfig.normalization="batch"``): summed, their losses are the batch's loss, e.g. Σ loss / Σ tokens of
    the whole batch for token-mean. ``pool``: the loss-token counts of every episode of the batch when it spans more
    than ``groups`` (data parallel: all processes' episodes in rank order), these groups' episodes from ``offset``."""
    own = [n for g in groups for n in g.episode_loss_tokens()]
    lengths = own if pool is None else list(pool)
    if lengths[offset : offset + len(own)] != own:
        raise ValueError(f"pool[{offset}:{offset + len(own)}] must be the loss-token counts of these groups' episodes")
    weights = iter(AGGREGATIONS[config.aggregation].weights(lengths, config)[offset : offset + len(own)])
    reweighted = []
    for group in groups:
        episode_weights = [next(weights) for _ in group.rewards]
        terms = [MemberTerms(t.advantage, episode_weights[e]) for t, e in zip(group.terms, group.episodes, strict=True)]
        reweighted.append(dataclasses.replace(group, terms=terms))
    return reweighted


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
    """A group of whole trajectories: loss masks and behaviour log-probs come from their segments; an episode that
    edited its context is one member per physical sequence (``episode_members``), still one GRPO sample."""
    rewards = trajectory_rewards(trajectories, rewards)
    if len(rewards) != len(trajectories):
        raise ValueError(f"{len(rewards)} rewards for {len(trajectories)} trajectories")
    per_episode = [episode_members(t) for t in trajectories]
    members = [member for sequences in per_episode for member in sequences]
    episodes = [k for k, sequences in enumerate(per_episode) for _ in sequences]
    return make_group(members, rewards, config, episodes)


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
