"""What the store hands back: its records of runs and episodes, the groups and aggregates of a selection, and
``StoreError``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from longstraw_agents.trajectory import Trajectory

QueryParams = Sequence[Any] | dict[str, Any]
"""Values of a query's placeholders: a sequence for ``?``, a dict for ``:name`` (sqlite3 takes no other mapping)."""
TRAIN_VERSION = "train_version"
"""The ``info`` key of an episode a training run stored: the policy version that trained on it (a turn's staleness is
that minus the version that sampled the turn, ``Segment.policy_version``)."""


class StoreError(Exception):
    """The store cannot be opened, read or written as asked; the message says why and names the file."""


@dataclass(frozen=True)
class RunRecord:
    """One row of the ``runs`` table."""

    id: str
    created_at: str
    config: dict[str, Any]
    model: str
    tokenizer: str
    notes: str = ""


@dataclass(frozen=True)
class EpisodeRecord:
    """A stored trajectory with what the store adds to it: its id, run and creation time."""

    id: int
    run_id: str | None
    created_at: str
    trajectory: Trajectory


@dataclass(frozen=True)
class EpisodeGroup:
    """One GRPO group as stored: the episodes of one run that share a (non-empty) group id, by episode id."""

    run_id: str | None
    group_id: str
    records: tuple[EpisodeRecord, ...]

    @property
    def trajectories(self) -> list[Trajectory]:
        return [record.trajectory for record in self.records]


@dataclass(frozen=True)
class GroupSummary:
    """One group of a selection, summarised from its ``episodes`` rows (no segment is read).

    first_episode: the id of its first episode (it names the group within the store); rewarded: how many members
    have a reward (reward statistics are over those, None when none has); tokens: summed over members; max_tokens:
    the longest member's; finish_reasons: how many members ended for each reason, most frequent first.
    """

    run_id: str | None
    group_id: str
    first_episode: int
    members: int
    env_ids: tuple[str, ...]
    min_version: int
    max_version: int
    reward_mean: float | None
    reward_min: float | None
    reward_max: float | None
    rewarded: int
    tokens: int
    max_tokens: int
    finish_reasons: dict[str, int]


@dataclass(frozen=True)
class Totals:
    """What a selection of episodes amounts to (versions are None when it is empty)."""

    episodes: int
    groups: int
    tokens: int
    min_version: int | None
    max_version: int | None


@dataclass(frozen=True)
class EnvTotals:
    """One environment's share of a selection; reward statistics are None when no episode has a reward."""

    env_id: str
    episodes: int
    groups: int
    tokens: int
    reward_mean: float | None
    reward_min: float | None
    reward_max: float | None
