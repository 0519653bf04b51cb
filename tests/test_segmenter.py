"""Prefix trees: trie structure on hand-built groups, invariants on random groups, validation errors."""

from __future__ import annotations

import numpy as np
import pytest
from recursion import shallow_stack

from longstraw_agents.segmenter import (
    Member,
    Node,
    PrefixTree,
    build_tree,
    fuse_chains,
    nodes_with_loss_below,
    tree_from_trajectories,
)
from longstraw_agents.trajectory import Segment, Trajectory

PROMPT = [1, 2, 3, 4]


def member(prompt: list[int], completion: list[int], logprobs: list[float] | None = None) -> Member:
    return Member.from_prompt_completion(prompt, completion, logprobs)


def spans(tree: PrefixTree) -> list[tuple[int, int, list[int]]]:
    """Pre-order (start, end, members) of every node: the tree's shape in one comparable value."""
    return [(node.start, node.end, node.members) for node in tree.nodes()]


def paths(tree: PrefixTree) -> dict[int, list[Node]]:
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


def assert_partitions(tree: PrefixTree, members: list[Member], homogeneous: bool = True) -> None:
    """Each member's root-to-leaf path covers its tokens, inputs, targets, masks and logprobs exactly once."""
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
            if homogeneous:
                assert len(set(node.masks[k].tolist())) <= 1, "a node is homogeneous in each member's loss mask"
            assert np.array_equal(node.token_ids, m.token_ids[node.start : node.end])


@pytest.mark.parametrize("seed", range(40))
def test_random_groups_partition_every_member_exactly(seed: int):
    rng = np.random.default_rng(seed)
    members = random_group(rng, size=int(rng.integers(1, 7)))
    tree = build_tree(members)
    assert_partitions(tree, members)
    # a trie holds each distinct prefix once: the unique-token count is the number of distinct non-empty prefixes
    prefixes = {tuple(m.token_ids[: n + 1].tolist()) for m in members for n in range(len(m))}
    assert tree.num_unique_tokens == len(prefixes)
    for node in tree.nodes():
        assert all(set(child.members) <= set(node.members) for child in node.children)
        # siblings start with different tokens (a trie branches only where members differ)
        firsts = [int(child.token_ids[0]) for child in node.children if child.start == node.end]
        assert len(firsts) == len(set(firsts))


# --- fused chains ------------------------------------------------------------------------------------------------
def test_fuse_chains_joins_short_turns_but_keeps_long_context_and_leaves_apart():
    prompt, tool_long = list(range(100, 106)), list(range(200, 205))
    ids = [*prompt, 10, 11, 12, 13, *tool_long, 14, 15]
    mask = [0] * 6 + [1, 1, 0, 1] + [0] * 5 + [1, 0]
    a = Member(np.array([*ids, 30, 31]), np.array([*mask, 1, 1], bool), np.arange(len(ids) + 2, dtype=float))
    b = Member(np.array([*ids, 40]), np.array([*mask, 1], bool), -np.arange(len(ids) + 1, dtype=float))
    tree = build_tree([a, b])
    assert spans(tree) == [
        (0, 6, [0, 1]),  # prompt: context, 6 tokens
        (6, 8, [0, 1]),  # answer
        (8, 9, [0, 1]),  # short tool output
        (9, 10, [0, 1]),  # answer
        (10, 15, [0, 1]),  # long tool output: 5 tokens
        (15, 16, [0, 1]),  # answer
        (16, 17, [0, 1]),  # short tool output, then the members diverge
        (17, 19, [0]),
        (17, 18, [1]),
    ]
    fused = fuse_chains(tree, max_context=4)
    assert spans(fused) == [
        (0, 6, [0, 1]),
        (6, 10, [0, 1]),
        (10, 15, [0, 1]),
        (15, 17, [0, 1]),
        (17, 19, [0]),
        (17, 18, [1]),
    ]
    turns = fused.root.children[0]
    assert turns.has_loss and turns.masks[0].tolist() == turns.masks[1].tolist() == [True, True, False, True]
    assert turns.input_ids.tolist() == [105, 10, 11, 12] and turns.token_ids.tolist() == [10, 11, 12, 13]
    assert turns.logprobs[0].tolist() == [6.0, 7.0, 8.0, 9.0] and turns.logprobs[1].tolist() == [-6.0, -7.0, -8.0, -9.0]
    assert fused.num_unique_tokens == tree.num_unique_tokens
    assert_partitions(fused, [a, b], homogeneous=False)
    # with every context short enough, the whole shared chain is one node; the leaves still stand alone
    assert spans(fuse_chains(tree, max_context=6)) == [(0, 17, [0, 1]), (17, 19, [0]), (17, 18, [1])]
    assert spans(tree)[1] == (6, 8, [0, 1]), "the original tree is left unchanged"


def test_fuse_chains_never_makes_a_long_leaf_for_a_walk():
    """A node whose children carry no loss is a leaf for a walk (replayed as one graph): it is not fused."""
    ids, mask = [1, 2, 3, 4, 5, 6], [0, 0, 1, 0, 1, 1]  # prompt, answer, tool, answer
    tree = build_tree([Member(np.array([*ids, t]), np.array([*mask, 0], bool)) for t in (7, 8)])  # loss-free ends
    assert spans(tree) == [(0, 2, [0, 1]), (2, 3, [0, 1]), (3, 4, [0, 1]), (4, 6, [0, 1]), (6, 7, [0]), (6, 7, [1])]
    assert spans(fuse_chains(tree, max_context=8)) == [(0, 4, [0, 1]), (4, 6, [0, 1]), (6, 7, [0]), (6, 7, [1])]
    assert nodes_with_loss_below(tree.root) == {id(n) for n in tree.nodes() if n.end <= 6}


def test_fuse_chains_stops_where_the_member_set_changes():
    tree = build_tree([member(PROMPT, [5, 6, 7, 8, 9]), member(PROMPT, [5, 6]), member(PROMPT, [10])])
    assert spans(tree) == [(0, 4, [0, 1, 2]), (4, 6, [0, 1]), (6, 9, [0]), (4, 5, [2])]
    assert spans(fuse_chains(tree, max_context=8)) == spans(tree)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("max_context", [0, 2, 100])
def test_fused_random_groups_partition_every_member_and_only_fuse_chains(seed: int, max_context: int):
    rng = np.random.default_rng(seed)
    members = random_group(rng, size=int(rng.integers(1, 7)))
    tree = build_tree(members)
    fused = fuse_chains(tree, max_context)
    assert_partitions(fused, members, homogeneous=False)
    assert fused.num_unique_tokens == tree.num_unique_tokens and fused.num_nodes <= tree.num_nodes
    original = {(n.start, n.end, tuple(n.members)): n for n in tree.nodes()}
    leaves = sorted(key for key, n in original.items() if not n.children)
    assert sorted((n.start, n.end, tuple(n.members)) for n in fused.nodes() if not n.children) == leaves
    for node in fused.nodes():
        if (node.start, node.end, tuple(node.members)) in original:
            continue
        parts = sorted(k for k in original if k[2] == tuple(node.members) and node.start <= k[0] < node.end)
        assert parts[0][0] == node.start and parts[-1][1] == node.end and len(parts) > 1
        live = nodes_with_loss_below(tree.root)
        for index, (start, end, _) in enumerate(parts):
            part = original[(start, end, tuple(node.members))]
            assert part.has_loss or end - start <= max_context  # long context is never fused
            if index:  # what fuses into a run is interior for a walk: it has loss below it
                assert any(id(child) in live for child in part.children)


# --- deep trees ----------------------------------------------------------------------------------------------------
def test_deep_trees_are_built_walked_and_fused_without_recursion():
    turns = 400  # a chain of 800 nodes: assistant and tool tokens alternate
    ids = np.concatenate([[1, 2, 3], np.tile([5, 7], turns)])
    mask = np.concatenate([[False] * 3, np.tile([True, False], turns)])
    chain = [Member(np.append(ids, last), np.append(mask, True)) for last in (8, 9)]
    # members leaving a shared run one by one: every divergence point nests inside the previous one
    stairs = [Member(np.array([0] * (k + 1) + [1, 1]), np.array([False] * (k + 1) + [True] * 2)) for k in range(150)]
    with shallow_stack(60):
        tree = build_tree(chain)
        assert tree.num_nodes == 2 * turns + 1 + 2 and tree.num_unique_tokens == len(ids) + 2
        assert [len(path) for path in paths(tree).values()] == [2 * turns + 2] * 2
        fused = fuse_chains(tree, max_context=4)
        assert spans(fused) == [(0, len(ids), [0, 1]), (len(ids), len(ids) + 1, [0]), (len(ids), len(ids) + 1, [1])]
        staircase = build_tree(stairs)
        assert staircase.num_nodes == 2 * 150 and staircase.num_unique_tokens == 150 + 2 * 150
        assert fuse_chains(staircase, max_context=4).num_nodes == staircase.num_nodes


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
