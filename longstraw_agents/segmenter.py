"""Segment trees: a group of token sequences → a prefix trie whose nodes are processed once each.

Members of an agent group share a long context (system prompt, documents, tool outputs, earlier turns) and diverge
at different depths. The trie over their token ids turns the group into nodes; each node is a run of positions
``[start, end)`` shared by a set of members and homogeneous in whether any of them puts loss there: *context*
nodes (prompt, tool output — evaluated without a graph) and *loss* nodes (assistant tokens — replayed under
autograd). Tokens of a shared loss node carry every member's loss term (member weights, advantages and behaviour
logprobs are kept per member), so the tree's loss equals the naive per-member loss exactly.

Positions here are *target* positions: token ``t`` is predicted from the tokens before it, so a node covering
targets ``[start, end)`` feeds the model the inputs ``ids[start-1 : end-1]`` (``Node.input_ids``); position 0 is
never a target.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from longstraw_agents.trajectory import Trajectory


@dataclass
class Member:
    """One sequence of the group: token ids, loss mask, behaviour logprobs (NaN/None where unknown)."""

    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.token_ids = np.asarray(self.token_ids, dtype=np.int64)
        self.loss_mask = np.asarray(self.loss_mask, dtype=bool)
        if self.token_ids.ndim != 1 or self.loss_mask.shape != self.token_ids.shape:
            raise ValueError("member token_ids must be 1-D and loss_mask of the same shape")
        if self.logprobs is not None:
            self.logprobs = np.asarray(self.logprobs, dtype=np.float64)
            if self.logprobs.shape != self.token_ids.shape:
                raise ValueError("member logprobs must have the shape of its token_ids")

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask[1:].sum())  # position 0 is never predicted

    @classmethod
    def from_trajectory(cls, trajectory: Trajectory) -> Member:
        rendered = trajectory.render()
        has_lp = any(span.has_logprobs for span in rendered.spans)
        return cls(rendered.token_ids, rendered.loss_mask, rendered.logprobs if has_lp else None)

    @classmethod
    def from_prompt_completion(
        cls, prompt: Sequence[int], completion: Sequence[int], logprobs: Sequence[float] | None = None
    ) -> Member:
        prompt, completion = np.asarray(prompt), np.asarray(completion)
        mask = np.concatenate([np.zeros(len(prompt), bool), np.ones(len(completion), bool)])
        lp = None
        if logprobs is not None:
            if len(logprobs) != len(completion):
                raise ValueError(f"{len(logprobs)} behaviour logprobs for a completion of {len(completion)} tokens")
            lp = np.concatenate([np.full(len(prompt), np.nan), np.asarray(logprobs, dtype=np.float64)])
        return cls(np.concatenate([prompt, completion]), mask, lp)


@dataclass(eq=False)
class Node:
    """Target positions ``[start, end)`` shared by ``members`` (indices into the group)."""

    start: int
    end: int
    token_ids: np.ndarray  # the tokens at [start, end)
    input_ids: np.ndarray  # the model's inputs for those targets: ids[max(start-1, 0) : end-1]
    members: list[int]
    masks: dict[int, np.ndarray]  # member -> loss mask over the node's targets
    logprobs: dict[int, np.ndarray | None]  # member -> behaviour logprobs over the node's targets
    children: list[Node] = field(default_factory=list)

    @property
    def has_loss(self) -> bool:
        return any(mask.any() for mask in self.masks.values())

    @property
    def targets(self) -> np.ndarray:
        """The predicted tokens (position 0 excluded): aligned with ``input_ids``."""
        return self.token_ids[1:] if self.start == 0 else self.token_ids

    @property
    def target_start(self) -> int:
        return max(self.start, 1)

    def walk(self) -> Iterator[Node]:
        yield self
        for child in self.children:
            yield from child.walk()


@dataclass
class SegmentTree:
    root: Node
    members: list[Member]

    def nodes(self) -> Iterator[Node]:
        return self.root.walk()

    @property
    def num_nodes(self) -> int:
        return sum(1 for _ in self.nodes())

    @property
    def num_unique_tokens(self) -> int:
        return sum(node.end - node.start for node in self.nodes())

    def max_path_tokens(self) -> int:
        return max(len(m) for m in self.members)


def _common_run(members: list[Member], indices: list[int], start: int) -> int:
    """End of the longest run from ``start`` on which all ``indices`` have the same tokens (and none has ended)."""
    end = min(len(members[i]) for i in indices)
    ref = members[indices[0]].token_ids
    for i in indices[1:]:
        diff = np.flatnonzero(members[i].token_ids[start:end] != ref[start:end])
        if diff.size:
            end = start + int(diff[0])
    return end


def _mask_breaks(members: list[Member], indices: list[int], start: int, end: int) -> list[int]:
    """Positions in (start, end) where any member's loss mask changes: nodes are split there."""
    breaks: set[int] = set()
    for i in indices:
        mask = members[i].loss_mask[start:end]
        breaks.update((np.flatnonzero(mask[1:] != mask[:-1]) + 1 + start).tolist())
    return sorted(breaks)


def _make_chain(members: list[Member], indices: list[int], start: int, end: int) -> tuple[Node, Node]:
    """Nodes for ``[start, end)`` split at mask changes, linked as a chain; returns (first, last)."""
    cuts = [start, *_mask_breaks(members, indices, start, end), end]
    first = last = None
    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
        ids = members[indices[0]].token_ids
        node = Node(
            start=lo,
            end=hi,
            token_ids=ids[lo:hi],
            input_ids=ids[max(lo - 1, 0) : hi - 1],
            members=list(indices),
            masks={i: _target_slice(members[i].loss_mask, lo, hi) for i in indices},
            logprobs={
                i: None if members[i].logprobs is None else _target_slice(members[i].logprobs, lo, hi) for i in indices
            },
        )
        if last is None:
            first = node
        else:
            last.children.append(node)
        last = node
    return first, last


def _target_slice(values: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return values[max(lo, 1) : hi]


def _build(members: list[Member], indices: list[int], start: int) -> Node:
    end = _common_run(members, indices, start)
    first, last = _make_chain(members, indices, start, end)
    groups: dict[int, list[int]] = {}
    for i in indices:
        if len(members[i]) > end:
            groups.setdefault(int(members[i].token_ids[end]), []).append(i)
    for sub in groups.values():
        last.children.append(_build(members, sub, end))
    return first


def build_tree(members: Sequence[Member]) -> SegmentTree:
    """The segment tree of a group (members may diverge at any depth, or be prefixes of one another)."""
    members = list(members)
    if not members:
        raise ValueError("a group needs at least one member")
    for k, m in enumerate(members):
        if len(m) < 2:
            raise ValueError(f"member {k} has {len(m)} tokens; a trainable sequence needs at least 2")
    first_tokens = {int(m.token_ids[0]) for m in members}
    if len(first_tokens) == 1:
        root = _build(members, list(range(len(members))), 0)
    else:  # no shared first token: a virtual empty root with one subtree per first token
        root = Node(0, 0, np.zeros(0, np.int64), np.zeros(0, np.int64), list(range(len(members))), {}, {})
        groups: dict[int, list[int]] = {}
        for k, m in enumerate(members):
            groups.setdefault(int(m.token_ids[0]), []).append(k)
        root.children = [_build(members, sub, 0) for sub in groups.values()]
    return SegmentTree(root=root, members=members)


def tree_from_trajectories(trajectories: Sequence[Trajectory]) -> SegmentTree:
    return build_tree([Member.from_trajectory(t) for t in trajectories])
