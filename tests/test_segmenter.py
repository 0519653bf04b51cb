"""Segment trees: trie structure on hand-built groups, invariants on random groups, validation errors."""

from __future__ import annotations

import numpy as np
import pytest

from longstraw_agents.segmenter import Member, Node, SegmentTree, build_tree, tree_from_trajectories
from longstraw_agents.trajectory import Segment, Trajectory

PROMPT = [1, 2, 3, 4]


def member(prompt: list[int], completion: list[int], logprobs: list[float] | None = None) -> Member:
    return Member.from_prompt_completion(prompt, completion, logprobs)


def spans(tree: SegmentTree) -> list[tuple[int, int, list[int]]]:
    """Pre-order (start, end, members) of every node: the tree's shape in one comparable value."""
    return [(node.start, node.end, node.members) for node in tree.nodes()]


def paths(tree: SegmentTree) -> dict[int, list[Node]]:
    """Per member, the nodes on its root-to-leaf path, in position order (the virtual root excluded)."""
    out: dict[int, list[Node]] = {k: [] for k in range(len(tree.members))}
    for node in tree.nodes():
        if node.end > node.start:
            for k in node.members:
                out[k].append(node)
    return out


# --- hand-built structure ----------------------------------------------------------------------------------------
def test_prompt_completion_group_is_a_context_node_with_one_loss_leaf_per_member():
    tree = build_tree([member(PROMPT, [5, 6]), member(PROMPT, [7])])
    assert spans(tree) == [(0, 4, [0, 1]), (4, 6, [0]), (4, 5, [1])]
    root, (first, second) = tree.root, tree.root.children
    assert not root.has_loss and first.has_loss and second.has_loss
    # target convention: targets [start, end) are fed ids[start-1 : end-1]; position 0 is never a target
    assert root.token_ids.tolist() == [1, 2, 3, 4] and root.targets.tolist() == [2, 3, 4]
    assert root.input_ids.tolist() == [1, 2, 3] and root.target_start == 1
    assert first.token_ids.tolist() == [5, 6] and first.input_ids.tolist() == [4, 5]
    assert first.targets.tolist() == [5, 6] and first.target_start == 4
    assert second.input_ids.tolist() == [4] and second.targets.tolist() == [7]
    assert tree.num_nodes == 3 and tree.num_unique_tokens == 7 and tree.max_path_tokens() == 6


def test_members_diverging_inside_the_completion_share_a_loss_node():
    tree = build_tree([member(PROMPT, [5, 6, 7]), member(PROMPT, [5, 6, 8, 9]), member(PROMPT, [10])])
    assert spans(tree) == [(0, 4, [0, 1, 2]), (4, 6, [0, 1]), (6, 7, [0]), (6, 8, [1]), (4, 5, [2])]
    shared = tree.root.children[0]
    assert shared.has_loss and shared.token_ids.tolist() == [5, 6] and shared.input_ids.tolist() == [4, 5]
    assert set(shared.masks) == {0, 1} and all(m.all() for m in shared.masks.values())


def test_divergence_at_different_depths_of_a_multi_turn_group():
    turn1, tool_a, tool_b = [20, 21, 22], [30, 31], [40, 41, 42]

    def traj(*parts: tuple[str, list[int]]) -> Trajectory:
        return Trajectory([Segment("user", PROMPT), *(Segment(role, ids) for role, ids in parts)])

    group = [
        traj(("assistant", turn1), ("tool", tool_a), ("assistant", [50, 51])),
        traj(("assistant", turn1), ("tool", tool_a), ("assistant", [52])),
        traj(("assistant", turn1), ("tool", tool_b), ("assistant", [53, 54])),
        traj(("assistant", [60, 61])),
    ]
    tree = tree_from_trajectories(group)
    assert spans(tree) == [
        (0, 4, [0, 1, 2, 3]),  # user prompt: context
        (4, 7, [0, 1, 2]),  # shared first answer: loss
        (7, 9, [0, 1]),  # shared tool output: context
        (9, 11, [0]),
        (9, 10, [1]),
        (7, 10, [2]),  # the other tool output: context, then its answer
        (10, 12, [2]),
        (4, 6, [3]),
    ]
    has_loss = [node.has_loss for node in tree.nodes()]
    assert has_loss == [False, True, False, True, True, False, True, True]


def test_a_member_that_is_a_prefix_of_another_ends_at_a_node_boundary():
    tree = build_tree([member(PROMPT, [5, 6, 7]), member(PROMPT, [5])])
    assert spans(tree) == [(0, 4, [0, 1]), (4, 5, [0, 1]), (5, 7, [0])]
    assert paths(tree)[1][-1].end == 5

    identical = build_tree([member(PROMPT, [5, 6]), member(PROMPT, [5, 6])])
    assert spans(identical) == [(0, 4, [0, 1]), (4, 6, [0, 1])]


def test_mask_boundaries_split_nodes_so_each_node_is_homogeneous():
    # same tokens, but member 1 puts loss on the last prompt token too and member 0 masks its final token
    a = Member(np.array([1, 2, 3, 4, 5, 6]), np.array([0, 0, 0, 0, 1, 0], bool))
    b = Member(np.array([1, 2, 3, 4, 5, 6]), np.array([0, 0, 0, 1, 1, 1], bool))
    tree = build_tree([a, b])
    assert spans(tree) == [(0, 3, [0, 1]), (3, 4, [0, 1]), (4, 5, [0, 1]), (5, 6, [0, 1])]
    masks = [(node.masks[0].tolist(), node.masks[1].tolist()) for node in tree.nodes()]
    assert masks == [([False, False], [False, False]), ([False], [True]), ([True], [True]), ([False], [True])]


def test_different_first_tokens_get_a_virtual_empty_root():
    tree = build_tree([member([1, 2], [3]), member([9, 2], [3]), member([1, 2], [4])])
    root = tree.root
    assert (root.start, root.end, root.members) == (0, 0, [0, 1, 2])
    assert root.token_ids.size == 0 and root.input_ids.size == 0 and not root.has_loss
    assert spans(tree)[1:] == [(0, 2, [0, 2]), (2, 3, [0]), (2, 3, [2]), (0, 2, [1]), (2, 3, [1])]
    assert tree.num_unique_tokens == 7


def test_behaviour_logprobs_are_kept_per_member_on_shared_nodes():
    tree = build_tree([member(PROMPT, [5, 6], [-1.0, -2.0]), member(PROMPT, [5, 7], [-1.5, -3.0]), member(PROMPT, [8])])
    root, shared = tree.root, tree.root.children[0]
    assert np.isnan(root.logprobs[0]).all() and root.logprobs[2] is None
    assert shared.token_ids.tolist() == [5]
    assert shared.logprobs[0].tolist() == [-1.0] and shared.logprobs[1].tolist() == [-1.5]
    assert [node.logprobs for node in shared.children] == [
        {0: pytest.approx(np.array([-2.0]))},
        {1: pytest.approx(np.array([-3.0]))},
    ]


def test_members_from_trajectories_carry_masks_and_logprobs():
    traj = Trajectory(
        [Segment("system", [1, 2]), Segment("assistant", [3, 4], logprobs=[-0.5, -0.25]), Segment("tool", [5])]
    )
    m = Member.from_trajectory(traj)
    assert m.token_ids.tolist() == [1, 2, 3, 4, 5] and m.loss_mask.tolist() == [False, False, True, True, False]
    assert np.isnan(m.logprobs[[0, 1, 4]]).all() and m.logprobs[2:4].tolist() == [-0.5, -0.25]
    assert m.num_loss_tokens == 2
    assert Member.from_trajectory(Trajectory([Segment("assistant", [1, 2])])).logprobs is None
    # position 0 is never predicted, so it never counts as a loss token
    assert Member(np.array([1, 2, 3]), np.array([1, 1, 0], bool)).num_loss_tokens == 1


# --- invariants on random groups ---------------------------------------------------------------------------------
def random_group(rng: np.random.Generator, size: int) -> list[Member]:
    """Members grown from each other by random truncate-and-extend steps (so they share prefixes of any length)
    with random loss masks and behaviour logprobs; a tiny vocabulary makes accidental sharing common too."""
    members: list[Member] = []
    for _ in range(size):
        if members and rng.random() < 0.8:
            base = members[rng.integers(len(members))]
            keep = int(rng.integers(1, len(base) + 1))
            ids = np.concatenate([base.token_ids[:keep], rng.integers(0, 3, rng.integers(0, 6))])
        else:
            ids = rng.integers(0, 3, rng.integers(2, 10))
        if len(ids) < 2:
            ids = np.concatenate([ids, [0]])
        members.append(Member(ids, rng.random(len(ids)) < 0.5, rng.normal(size=len(ids))))
    return members


@pytest.mark.parametrize("seed", range(40))
def test_random_groups_partition_every_member_exactly(seed: int):
    rng = np.random.default_rng(seed)
    members = random_group(rng, size=int(rng.integers(1, 7)))
    tree = build_tree(members)
    for k, nodes in paths(tree).items():
        m = members[k]
        starts, ends = [n.start for n in nodes], [n.end for n in nodes]
        assert starts[0] == 0 and ends[-1] == len(m) and starts[1:] == ends[:-1]  # contiguous, no overlap
        assert np.array_equal(np.concatenate([n.token_ids for n in nodes]), m.token_ids)
        assert np.array_equal(np.concatenate([n.input_ids for n in nodes]), m.token_ids[:-1])
        assert np.array_equal(np.concatenate([n.targets for n in nodes]), m.token_ids[1:])
        assert np.array_equal(np.concatenate([n.masks[k] for n in nodes]), m.loss_mask[1:])
        assert np.array_equal(np.concatenate([n.logprobs[k] for n in nodes]), m.logprobs[1:])
        for node in nodes:
            assert len(node.input_ids) == len(node.targets) == len(node.masks[k])
            assert len(set(node.masks[k].tolist())) <= 1, "a node is homogeneous in each member's loss mask"
            assert np.array_equal(node.token_ids, m.token_ids[node.start : node.end])
    # a trie holds each distinct prefix once: the unique-token count is the number of distinct non-empty prefixes
    prefixes = {tuple(m.token_ids[: n + 1].tolist()) for m in members for n in range(len(m))}
    assert tree.num_unique_tokens == len(prefixes)
    for node in tree.nodes():
        assert all(set(child.members) <= set(node.members) for child in node.children)
        # siblings start with different tokens (a trie branches only where members differ)
        firsts = [int(child.token_ids[0]) for child in node.children if child.start == node.end]
        assert len(firsts) == len(set(firsts))


# --- validation ----------------------------------------------------------------------------------------------------
def test_an_empty_group_is_rejected():
    with pytest.raises(ValueError, match="at least one member"):
        build_tree([])


def test_a_one_token_member_is_rejected():
    with pytest.raises(ValueError, match="member 1 has 1 tokens"):
        build_tree([member(PROMPT, [5]), Member(np.array([7]), np.array([True]))])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"token_ids": np.array([1, 2, 3]), "loss_mask": np.array([True, False])}, "same shape"),
        ({"token_ids": np.array([[1, 2]]), "loss_mask": np.array([[True, False]])}, "1-D"),
        ({"token_ids": np.array([1, 2]), "loss_mask": np.array([True, False]), "logprobs": [0.0]}, "shape"),
    ],
)
def test_malformed_members_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Member(**kwargs)


def test_prompt_completion_logprobs_must_match_the_completion():
    with pytest.raises(ValueError, match="1 behaviour logprobs for a completion of 2 tokens"):
        Member.from_prompt_completion(PROMPT, [5, 6], [-1.0])
