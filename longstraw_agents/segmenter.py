"""Prefix trees: a group of token sequences → a prefix trie whose nodes are processed once each.

Members of an agent group share a long context (system prompt, documents, tool outputs, earlier turns) and diverge
at different depths. The trie over their token ids turns the group into nodes; each node is a run of positions
``[start, end)`` shared by a set of members and homogeneous in whether any of them puts loss there: *context*
nodes (prompt, tool output — evaluated without a graph) and *loss* nodes (assistant tokens — replayed under
autograd). Tokens of a shared loss node carry every member's loss term (member weights, advantages and behaviour
logprobs are kept per member), so the tree's loss equals the naive per-member loss exactly. ``fuse_chains`` turns
runs of single-child nodes (many short turns) into single mixed nodes, for walks where that changes nothing.

An episode that edited its context (``Trajectory.edits``) contributes one member per physical sequence
(``episode_members``): the trie then shares the system prompt, the kept turns and the history before each edit
between the sequences of one episode and across the group, while the tokens after an edit are at new positions.

Positions here are *target* positions: token ``t`` is predicted from the tokens before it, so a node covering
targets ``[start, end)`` feeds the model the inputs ``ids[start-1 : end-1]`` (``Node.input_ids``); position 0 is
never a target.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from longstraw_agents.trajectory import Rendered, Trajectory


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
        """The member of an episode that only appended (an edited one has several: ``episode_members``)."""
        if trajectory.is_edited:
            raise ValueError(
                f"this trajectory edited its context ({len(trajectory.edits)} edits): it is "
                f"{len(trajectory.physical_sequences())} physical sequences, one member each (episode_members)"
            )
        return cls.from_rendered(trajectory.render())

    @classmethod
    def from_rendered(cls, rendered: Rendered) -> Member:
        has_lp = any(span.has_logprobs for span in rendered.spans)
        return cls(rendered.token_ids, rendered.loss_mask, rendered.logprobs if has_lp else None)

    @classmethod
    def from_prompt_completion(
        cls,
        prompt: Sequence[int] | np.ndarray,
        completion: Sequence[int] | np.ndarray,
        logprobs: Sequence[float] | np.ndarray | None = None,
    ) -> Member:
        prompt_ids, completion_ids = np.asarray(prompt), np.asarray(completion)
        mask = np.concatenate([np.zeros(len(prompt_ids), bool), np.ones(len(completion_ids), bool)])
        lp = None
        if logprobs is not None:
            if len(logprobs) != len(completion_ids):
                raise ValueError(f"{len(logprobs)} behaviour logprobs for a completion of {len(completion_ids)} tokens")
            lp = np.concatenate([np.full(len(prompt_ids), np.nan), np.asarray(logprobs, dtype=np.float64)])
        return cls(np.concatenate([prompt_ids, completion_ids]), mask, lp)


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
        """Pre-order (node, then each child's subtree in order) with an explicit stack: depth is unbounded."""
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children))


@dataclass
class PrefixTree:
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
    first: Node | None = None
    last: Node | None = None
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
                i: None if (member_lp := members[i].logprobs) is None else _target_slice(member_lp, lo, hi)
                for i in indices
            },
        )
        if last is None:
            first = node
        else:
            last.children.append(node)
        last = node
    assert first is not None and last is not None  # cuts holds start and end: there is one node at least
    return first, last


def _target_slice(values: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return values[max(lo, 1) : hi]


def _build(members: list[Member], indices: list[int], start: int) -> Node:
    """The subtree of ``indices`` from ``start``; iterative (a group may diverge at arbitrarily many depths)."""
    root, last = _make_chain(members, indices, start, _common_run(members, indices, start))
    stack = [(last, indices)]  # the last node of a run, and the members that reach it
    while stack:
        last, group = stack.pop()
        for sub in _split_by_next_token(members, group, last.end):
            first, sub_last = _make_chain(members, sub, last.end, _common_run(members, sub, last.end))
            last.children.append(first)
            stack.append((sub_last, sub))
    return root


def _split_by_next_token(members: list[Member], indices: list[int], end: int) -> list[list[int]]:
    """The members that continue past ``end``, grouped by their token there (first-seen order)."""
    groups: dict[int, list[int]] = {}
    for i in indices:
        if len(members[i]) > end:
            groups.setdefault(int(members[i].token_ids[end]), []).append(i)
    return list(groups.values())


def build_tree(members: Sequence[Member]) -> PrefixTree:
    """The prefix tree of a group (members may diverge at any depth, or be prefixes of one another)."""
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
    return PrefixTree(root=root, members=members)


def fuse_chains(tree: PrefixTree, max_context: int) -> PrefixTree:
    """A copy of ``tree`` in which each run of single-child nodes with the same members is one node.

    For walks that treat context and loss nodes alike before a branch point (exact mode: every interior node is
    extended without a graph and recomputed chunk by chunk in reverse), a fused node gives the same loss and
    gradient with one forward per chunk instead of one per node; its per-member masks keep loss off the context
    tokens. Leaves (and nodes with no loss below them) are never fused into their parent: a walk replays a leaf as
    one graph, which must stay short. Context nodes longer than ``max_context`` tokens stay on their own (long
    tool outputs stay loss-free).
    """
    if max_context < 0:
        raise ValueError(f"max_context must be >= 0, got {max_context}")
    live = nodes_with_loss_below(tree.root)
    root, last = _fuse(tree.root, max_context, live)
    stack = [(last, root)]  # the last original node of a run, and the fused node that stands for the run
    while stack:
        last, fused = stack.pop()
        for child in last.children:
            fused_child, child_last = _fuse(child, max_context, live)
            fused.children.append(fused_child)
            stack.append((child_last, fused_child))
    return PrefixTree(root=root, members=tree.members)


def nodes_with_loss_below(root: Node) -> set[int]:
    """``id``s of the nodes whose subtree holds a loss token (walks skip the others: nothing to backpropagate)."""
    live: set[int] = set()
    for node in list(root.walk())[::-1]:  # reversed pre-order: every node after its descendants
        if node.has_loss or any(id(c) in live for c in node.children):
            live.add(id(node))
    return live


def _fusable(node: Node, max_context: int) -> bool:
    return node.end > node.start and (node.has_loss or node.end - node.start <= max_context)


def _run(node: Node, max_context: int, live: set[int]) -> list[Node]:
    """``node`` and the single-child descendants that fuse into it: same members, not long context, and not a
    leaf for a walk (a node with loss below it, so that the fused node is never replayed as one long graph)."""
    run = [node]
    while len(run[-1].children) == 1 and _fusable(run[-1], max_context):
        child = run[-1].children[0]
        interior = any(id(g) in live for g in child.children)
        if not (interior and child.members == node.members and _fusable(child, max_context)):
            break
        run.append(child)
    return run


def _fuse(node: Node, max_context: int, live: set[int]) -> tuple[Node, Node]:
    """A childless node covering ``_run(node)`` (tokens, inputs, masks and logprobs concatenated), and the run's
    last node (whose children follow the fused node)."""
    run = _run(node, max_context, live)
    last = run[-1]

    def cat(parts: list[np.ndarray | None]) -> np.ndarray | None:
        if parts[0] is None:
            return None
        arrays = [part for part in parts if part is not None]
        assert len(arrays) == len(parts)  # a member's logprobs are known at all its nodes or at none
        return np.concatenate(arrays)

    fused = Node(
        start=node.start,
        end=last.end,
        token_ids=np.concatenate([n.token_ids for n in run]),
        input_ids=np.concatenate([n.input_ids for n in run]),
        members=list(node.members),
        masks={i: np.concatenate([n.masks[i] for n in run]) for i in node.members if i in node.masks},
        logprobs={i: cat([n.logprobs[i] for n in run]) for i in node.members if i in node.logprobs},
    )
    return fused, last


def episode_members(trajectory: Trajectory) -> list[Member]:
    """One member per physical sequence of the episode that carries loss (one for an episode that only appended):
    the sequence's tokens, with loss on the assistant tokens generated under it. A sequence without a loss token
    (its turns' masks cleared) adds nothing to the loss and is left out of the forest; an episode with no loss token
    at all keeps its last sequence, so that it stays a sample of its group."""
    members = [Member.from_rendered(trajectory.render_sequence(seq)) for seq in trajectory.physical_sequences()]
    with_loss = [member for member in members if member.num_loss_tokens]
    return with_loss or members[-1:]


def tree_from_trajectories(trajectories: Sequence[Trajectory]) -> PrefixTree:
    """The prefix tree over every physical sequence of the episodes (``episode_members``, episode by episode)."""
    return build_tree([member for t in trajectories for member in episode_members(t)])
