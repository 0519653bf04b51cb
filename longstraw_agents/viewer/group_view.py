"""One group's page data: its members with reward and advantage, the prefix tree the trainer trains on, and windows
of token text.

The tree is the segmenter's (``build_tree`` over ``Member.from_trajectory``, as the trainer builds it for episodes
that only append; a group with an edited episode is shown without its tree); the page
draws it with every run of single-child nodes that keep the same members joined into one *branch*: the shared prefix
is the root branch, a branch ends where the members diverge (a branch point) or where a member's episode ends, and
each member's path is the chain of branches that hold it. A branch is cut into *pieces* at its nodes' boundaries (loss
or context) and at the segment boundaries of its first member, whose loss mask and behaviour logprobs shade the
tokens. Advantages are the trainer's: ``(r - mean) / (std + 1e-4)`` over the group's rewards (unbiased std; without
the division when the run's ``trainer.loss.scale_rewards`` is false).

An episode that edited its context is several token sequences for the trainer (``segmenter.episode_members``), while
the page draws one path per member row; a group with such an episode is shown without its tree, with a note saying
so, and each member's tokens are its log (``Trajectory.render``: every segment in writing order).

A page stays small whatever the episodes' length: a piece carries its whole token text only when it is short,
otherwise a window at each end, and a group carries at most ``ViewLimits.group_tokens`` tokens of text (loss pieces
first). The rest is fetched in ranges on demand (``token_window``, served mode).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from longstraw_agents.segmenter import Member, Node, PrefixTree, build_tree
from longstraw_agents.store import TRAIN_VERSION, EpisodeRecord
from longstraw_agents.trajectory import SegmentSpan
from longstraw_agents.viewer.tokens import TokenText

ADVANTAGE_EPS = 1e-4
"""The trainer's epsilon in ``(r - mean) / (std + eps)`` (``trainer.loss.ADVANTAGE_EPS``; the viewer does not import
the trainer, which needs torch: tests check that the two advantages agree)."""


def group_advantages(rewards: Sequence[float], scale: bool = True) -> np.ndarray:
    """``(r - mean) / (std + 1e-4)`` with the unbiased std, as the trainer; a single-member group has zero
    advantage; ``scale=False`` keeps ``r - mean`` (Dr. GRPO)."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or r.size == 0:
        raise ValueError(f"rewards must be a non-empty 1-D sequence, got shape {r.shape}")
    centred = r - r.mean()
    if not scale:
        return centred
    std = r.std(ddof=1) if r.size > 1 else 0.0
    return centred / (std + ADVANTAGE_EPS)


@dataclass(frozen=True)
class ViewLimits:
    """How much token text a page carries; what it leaves out is fetched in ranges (served mode)."""

    whole_piece_tokens: int = 512
    """A piece up to this long carries all its tokens; a longer one a window at each end."""
    edge_tokens: int = 128
    """The length of each end window of a long piece."""
    group_tokens: int = 32_768
    """The most tokens of text one group carries (loss pieces first, then the others in order)."""
    range_tokens: int = 4096
    """The most tokens one range request returns."""
    tool_value_chars: int = 2000
    """A tool call's or result's strings are cut to this many characters (their length is shown)."""


# ---------------------------------------------------------------------------------------------------------------
# What the page receives (plain dataclasses; ``dataclasses.asdict`` gives their JSON).


@dataclass(frozen=True)
class Window:
    """Tokens ``[start, start + len(text))`` of one member: text, loss mask ("0"/"1" per token) and behaviour
    logprobs (None where unknown, "-inf" where the behaviour policy gave the token no probability)."""

    start: int
    text: list[str]
    loss: str
    logprobs: list[float | str | None] | None


@dataclass(frozen=True)
class Piece:
    """Positions ``[start, end)`` of one segment of the branch's first member (``segment``: its index)."""

    start: int
    end: int
    role: str
    segment: int
    turn: int
    loss_tokens: int
    segment_start: bool
    segment_end: bool
    tool_calls: list[Any] | None  # the segment's calls (assistant) or results (tool), on the piece that ends it
    windows: list[Window]
    policy_version: int | None = None  # the weights that sampled the segment (an assistant turn), when recorded
    staleness: int | None = None  # versions between those and the weights that trained on the episode


@dataclass(frozen=True)
class Branch:
    """Joined segmenter nodes ``[start, end)`` shared by ``members``; ``ends``: the members whose episode ends at
    ``end``; ``nodes``: the joined nodes as ``(start, end, has_loss)``."""

    id: int
    parent: int | None
    start: int
    end: int
    members: list[int]
    ends: list[int]
    children: list[int]
    nodes: list[tuple[int, int, bool]]
    loss_tokens: int
    advantage_sum: float | None  # Σ advantage of the members, on a branch with loss (what its loss tokens carry)
    pieces: list[Piece]


@dataclass(frozen=True)
class MemberRow:
    index: int
    episode: int
    reward: float | None
    advantage: float | None
    finish_reason: str
    policy_version: int
    turn_versions: list[int]  # the versions that sampled its turns (asynchronous GRPO: several), in order
    staleness: int | None  # versions between the oldest of them and the one that trained on it (None: unknown)
    seed: int | None
    tokens: int
    loss_tokens: int
    segments: int
    has_logprobs: bool
    truncated_tool_outputs: int


@dataclass(frozen=True)
class GroupPage:
    key: int
    run_id: str | None
    group_id: str
    env_ids: list[str]
    scale_rewards: bool
    advantage_note: str
    text_source: str
    members: list[MemberRow]
    branches: list[Branch]
    tree_error: str | None
    unique_tokens: int
    total_tokens: int
    embedded_tokens: int
    range_tokens: int


# ---------------------------------------------------------------------------------------------------------------
# Loading


@dataclass
class LoadedGroup:
    """A group read from the store, with its segmenter tree (None, and ``tree_error`` saying why, when the segmenter
    refuses the group or a member edited its context).

    ``key`` is the id of its first episode, which names the group in a store (an episode without a group id is a
    group of its own)."""

    records: tuple[EpisodeRecord, ...]
    scale_rewards: bool
    members: list[Member] = field(init=False)
    spans: list[list[tuple[int, SegmentSpan]]] = field(init=False)  # per member: (segment index, span), not empty
    tree: PrefixTree | None = field(init=False)
    tree_error: str | None = field(init=False)

    def __post_init__(self) -> None:
        trajectories = [record.trajectory for record in self.records]
        rendered = [t.render() for t in trajectories]
        self.members = [Member.from_rendered(r) for r in rendered]
        self.spans = [[(k, s) for k, s in enumerate(r.spans) if s.end > s.start] for r in rendered]
        self.tree, self.tree_error = None, self._edited_note()
        if self.tree_error is None:
            try:
                self.tree = build_tree(self.members)
            except ValueError as err:  # a member too short to train on
                self.tree_error = f"the trainer would refuse this group: {err}"

    def _edited_note(self) -> str | None:
        """Why the tree is not drawn when members edited their context (None when none did)."""
        edited = [k for k, record in enumerate(self.records) if record.trajectory.is_edited]
        if not edited:
            return None
        sequences = [len(self.records[k].trajectory.physical_sequences()) for k in edited]
        which = ", ".join(f"{k} ({n} physical sequences)" for k, n in zip(edited, sequences, strict=True))
        return (
            f"the tree is not drawn: members {which} edited their context, and the trainer trains each physical "
            "sequence as a member of its own (a member's tokens here are its log, every segment in writing order)"
        )

    @property
    def key(self) -> int:
        return self.records[0].id

    @property
    def group_id(self) -> str:
        return self.records[0].trajectory.group_id

    def advantages(self) -> tuple[list[float | None], str]:
        """Each member's advantage as the trainer computes it, or None, with a note saying why."""
        rewards = [record.trajectory.reward for record in self.records]
        if not self.group_id:
            return [None] * len(rewards), "played alone: in no GRPO group, so no advantage"
        missing = [k for k, reward in enumerate(rewards) if reward is None]
        if missing:
            return [None] * len(rewards), f"members {missing} have no reward: the trainer refuses this group"
        values = group_advantages([float(r) for r in rewards if r is not None], scale=self.scale_rewards)
        how = "(r - mean) / (std + 1e-4)" if self.scale_rewards else "r - mean (scale_rewards false)"
        return [float(a) for a in values], f"advantage = {how} over the group's {len(rewards)} rewards"


# ---------------------------------------------------------------------------------------------------------------
# Token windows


def _logprob(value: float) -> float | str | None:
    if math.isnan(value):
        return None
    if math.isinf(value):
        return "-inf" if value < 0 else "inf"
    return round(value, 4)


def member_window(member: Member, start: int, end: int, text: TokenText) -> Window:
    """Member tokens ``[start, end)`` as the page shows them."""
    ids = member.token_ids[start:end]
    logprobs = None if member.logprobs is None else [_logprob(v) for v in member.logprobs[start:end].tolist()]
    loss = "".join("1" if m else "0" for m in member.loss_mask[start:end].tolist())
    return Window(start=start, text=text.texts(ids), loss=loss, logprobs=logprobs)


def token_window(group: LoadedGroup, member: int, start: int, end: int, text: TokenText, limit: int) -> Window:
    """A range of one member's tokens (at most ``limit``); ``ValueError`` naming what is out of range."""
    if not 0 <= member < len(group.members):
        raise ValueError(f"member {member} is not in the group (it has {len(group.members)})")
    length = len(group.members[member])
    if not 0 <= start < end <= length:
        raise ValueError(f"tokens [{start}, {end}) are not inside member {member}'s {length} tokens")
    return member_window(group.members[member], start, min(end, start + limit), text)


def _wanted_windows(start: int, end: int, limits: ViewLimits) -> list[tuple[int, int]]:
    if end - start <= limits.whole_piece_tokens:
        return [(start, end)]
    return [(start, start + limits.edge_tokens), (end - limits.edge_tokens, end)]


# ---------------------------------------------------------------------------------------------------------------
# Branches and pieces


def _chain(node: Node) -> list[Node]:
    """``node`` and the single-child descendants that keep its members (a branch's nodes)."""
    chain = [node]
    while len(chain[-1].children) == 1 and chain[-1].children[0].members == node.members:
        chain.append(chain[-1].children[0])
    return chain


@dataclass
class _Cut:
    """A piece before its windows are chosen."""

    branch: int
    start: int
    end: int
    span: SegmentSpan
    segment: int
    loss_tokens: int


def _cuts(branch: int, chain: list[Node], member: Member, spans: list[tuple[int, SegmentSpan]]) -> list[_Cut]:
    """The branch cut at its nodes' boundaries and at those of ``member``'s (non-empty) segments ``spans``."""
    start, end = chain[0].start, chain[-1].end
    starts = [span.start for _, span in spans]
    bounds = {start, end, *(n.start for n in chain), *starts, *(span.end for _, span in spans)}
    points = sorted(p for p in bounds if start <= p <= end)
    cuts = []
    for lo, hi in zip(points[:-1], points[1:], strict=True):
        segment, span = spans[bisect.bisect_right(starts, lo) - 1]
        loss = int(member.loss_mask[max(lo, 1) : hi].sum())  # position 0 is never a target
        cuts.append(_Cut(branch, lo, hi, span, segment, loss))
    return cuts


def _trimmed(value: Any, limit: int) -> Any:
    """``value`` with every string longer than ``limit`` cut, its length said."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]}… ({len(value):,} characters)"
    if isinstance(value, list):
        return [_trimmed(v, limit) for v in value]
    if isinstance(value, dict):
        return {k: _trimmed(v, limit) for k, v in value.items()}
    return value


def _branch_nodes(tree: PrefixTree) -> list[tuple[int | None, list[Node]]]:
    """(parent branch, chain of nodes) for every branch, in pre-order (a parent before its children)."""
    out: list[tuple[int | None, list[Node]]] = []
    stack: list[tuple[int | None, Node]] = [(None, tree.root)]
    while stack:
        parent, node = stack.pop()
        chain = _chain(node)
        out.append((parent, chain))
        stack.extend((len(out) - 1, child) for child in reversed(chain[-1].children))
    return out


def _allot(cuts: list[_Cut], limits: ViewLimits) -> tuple[dict[int, list[tuple[int, int]]], int]:
    """The windows each cut carries (by index in ``cuts``) within the group's budget, loss pieces first."""
    order = sorted(range(len(cuts)), key=lambda k: (cuts[k].loss_tokens == 0, cuts[k].start))
    left = limits.group_tokens
    chosen: dict[int, list[tuple[int, int]]] = {}
    for k in order:
        wanted = _wanted_windows(cuts[k].start, cuts[k].end, limits)
        size = sum(hi - lo for lo, hi in wanted)
        if size <= left:
            chosen[k] = wanted
            left -= size
    return chosen, limits.group_tokens - left


def group_page(group: LoadedGroup, text: TokenText, limits: ViewLimits) -> GroupPage:
    """Everything the page draws of ``group``."""
    advantages, note = group.advantages()
    members = [_member_row(k, record, group, advantages[k]) for k, record in enumerate(group.records)]
    branches: list[Branch] = []
    embedded = 0
    if group.tree is not None:
        branches, embedded = _branches(group, text, limits, advantages)
    env_ids = sorted({record.trajectory.env_id for record in group.records})
    return GroupPage(
        key=group.key,
        run_id=group.records[0].run_id,
        group_id=group.group_id,
        env_ids=env_ids,
        scale_rewards=group.scale_rewards,
        advantage_note=note,
        text_source=text.describe(),
        members=members,
        branches=branches,
        tree_error=group.tree_error,
        unique_tokens=0 if group.tree is None else group.tree.num_unique_tokens,
        total_tokens=sum(len(m) for m in group.members),
        embedded_tokens=embedded,
        range_tokens=limits.range_tokens,
    )


def _branches(
    group: LoadedGroup, text: TokenText, limits: ViewLimits, advantages: list[float | None]
) -> tuple[list[Branch], int]:
    assert group.tree is not None
    chains = _branch_nodes(group.tree)
    shown_member = [chain[0].members[0] for _, chain in chains]  # whose masks and logprobs shade a branch
    cuts = [
        cut
        for b, (_, chain) in enumerate(chains)
        for cut in _cuts(b, chain, group.members[shown_member[b]], group.spans[shown_member[b]])
    ]
    windows, embedded = _allot(cuts, limits)
    pieces: list[list[Piece]] = [[] for _ in chains]
    for k, cut in enumerate(cuts):
        member = group.members[shown_member[cut.branch]]
        shown = [member_window(member, lo, hi, text) for lo, hi in windows.get(k, [])]
        trained_at = group.records[shown_member[cut.branch]].trajectory.info.get(TRAIN_VERSION)
        pieces[cut.branch].append(_piece(cut, shown, limits, trained_at))
    children: list[list[int]] = [[] for _ in chains]
    for b, (parent, _) in enumerate(chains):
        if parent is not None:
            children[parent].append(b)
    branches = []
    for b, (parent, chain) in enumerate(chains):
        last = chain[-1]
        continuing = {m for child in last.children for m in child.members}
        loss_tokens = sum(p.loss_tokens for p in pieces[b])
        branch_advantages = [advantages[m] for m in chain[0].members]
        summed = None
        if loss_tokens and all(a is not None for a in branch_advantages):
            summed = float(sum(a for a in branch_advantages if a is not None))
        branches.append(
            Branch(
                id=b,
                parent=parent,
                start=chain[0].start,
                end=last.end,
                members=list(chain[0].members),
                ends=[m for m in last.members if m not in continuing],
                children=children[b],
                nodes=[(n.start, n.end, n.has_loss) for n in chain],
                loss_tokens=loss_tokens,
                advantage_sum=summed,
                pieces=pieces[b],
            )
        )
    return branches, embedded


def _staleness(trained_at: Any, version: int | None) -> int | None:
    """Versions between the weights that sampled a turn and those that trained on it (None: either unknown)."""
    return trained_at - version if isinstance(trained_at, int) and version is not None else None


def _piece(cut: _Cut, windows: list[Window], limits: ViewLimits, trained_at: Any = None) -> Piece:
    span = cut.span
    segment_end = cut.end == span.end
    calls = span.tool_calls if segment_end and span.tool_calls else None
    return Piece(
        start=cut.start,
        end=cut.end,
        role=span.role,
        segment=cut.segment,
        turn=span.turn,
        loss_tokens=cut.loss_tokens,
        segment_start=cut.start == span.start,
        segment_end=segment_end,
        tool_calls=None if calls is None else _trimmed(calls, limits.tool_value_chars),
        windows=windows,
        policy_version=span.policy_version,
        staleness=_staleness(trained_at, span.policy_version),
    )


def _member_row(index: int, record: EpisodeRecord, group: LoadedGroup, advantage: float | None) -> MemberRow:
    trajectory = record.trajectory
    truncated = sum(
        1
        for segment in trajectory.segments
        if segment.role == "tool"
        for result in segment.tool_calls or []
        if isinstance(result, dict) and result.get("truncated")
    )
    versions = [s.policy_version for s in trajectory.segments if s.policy_version is not None]
    return MemberRow(
        index=index,
        episode=record.id,
        reward=trajectory.reward,
        advantage=advantage,
        finish_reason=trajectory.finish_reason,
        policy_version=trajectory.policy_version,
        turn_versions=versions,
        staleness=_staleness(trajectory.info.get(TRAIN_VERSION), min(versions, default=None)),
        seed=trajectory.seed,
        tokens=trajectory.num_tokens,
        loss_tokens=group.members[index].num_loss_tokens,
        segments=len(trajectory.segments),
        has_logprobs=group.members[index].logprobs is not None,
        truncated_tool_outputs=truncated,
    )
