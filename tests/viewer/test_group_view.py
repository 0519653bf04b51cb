"""One group's page data: the trainer's advantages, the segmenter's tree joined into branches, pieces by segment, and
windows of token text within the page's limits."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from stored_episodes import edited_trajectory
from viewer_stores import CALL, RESULT, TOOL_OUTPUT, calculator_group

from longstraw_agents.segmenter import episode_members, tree_from_trajectories
from longstraw_agents.store import EpisodeRecord
from longstraw_agents.tokenizer import load_tokenizer
from longstraw_agents.trainer.loss import ADVANTAGE_EPS, group_advantages
from longstraw_agents.trajectory import Segment, Trajectory
from longstraw_agents.viewer import group_view
from longstraw_agents.viewer.group_view import LoadedGroup, ViewLimits, group_page, token_window
from longstraw_agents.viewer.tokens import token_text

TEXT = token_text("longstraw-bpe")


def loaded(trajectories: list[Trajectory], scale_rewards: bool = True) -> LoadedGroup:
    records = tuple(
        EpisodeRecord(id=10 + k, run_id="r", created_at="", trajectory=t) for k, t in enumerate(trajectories)
    )
    return LoadedGroup(records, scale_rewards)


@pytest.mark.parametrize(
    "rewards", [[1.0, 0.0, 0.0, 0.0], [0.3, 0.7, -1.25], [2.0, 2.0], [5.0], [1e-3, 2e-3, 0.0, 7.5]]
)
@pytest.mark.parametrize("scale", [True, False])
def test_advantages_are_the_trainers(rewards: list[float], scale: bool) -> None:
    assert group_view.ADVANTAGE_EPS == ADVANTAGE_EPS
    expected = group_advantages(torch.tensor(rewards, dtype=torch.float64), scale=scale).tolist()
    assert group_view.group_advantages(rewards, scale=scale).tolist() == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_a_groups_advantages_follow_its_runs_scale_rewards() -> None:
    group = calculator_group()
    scaled, note = loaded(group).advantages()
    assert scaled == pytest.approx(group_advantages([1.0, 0.0, 0.0, 0.0]).tolist()) and "std + 1e-4" in note
    centred, note = loaded(group, scale_rewards=False).advantages()
    assert centred == [0.75, -0.25, -0.25, -0.25] and "scale_rewards false" in note
    group[2].reward = None
    missing, note = loaded(group).advantages()
    assert missing == [None] * 4 and "members [2] have no reward" in note
    alone, note = loaded(calculator_group(group_id="")[:1]).advantages()
    assert alone == [None] and "played alone" in note


def test_branches_join_the_segmenters_nodes() -> None:
    """The shared prefix, a branch point at the first assistant token, a member that ends after the tool result,
    and a branch point inside the answer: every node of the trainer's tree is in exactly one branch, in order."""
    trajectories = calculator_group()
    page = group_page(loaded(trajectories), TEXT, ViewLimits())
    shape = [(b.parent, b.members, b.ends, b.children) for b in page.branches]
    assert shape == [
        (None, [0, 1, 2, 3], [], [1, 5]),
        (0, [0, 1, 3], [3], [2]),  # the tool call and its result; #3's episode ends there
        (1, [0, 1], [], [3, 4]),  # "<answer>", then 12 or 13
        (2, [0], [0], []),
        (2, [1], [1], []),
        (0, [2], [2], []),
    ]
    tree = tree_from_trajectories(trajectories)
    nodes = sorted((n.start, n.end, tuple(n.members), n.has_loss) for n in tree.nodes())
    joined = sorted((s, e, tuple(b.members), loss) for b in page.branches for s, e, loss in b.nodes)
    assert joined == nodes
    for b in page.branches:  # a branch is contiguous and starts where its parent ends
        assert [b.start, *[e for _, e, _ in b.nodes]] == [s for s, _, _ in b.nodes] + [b.end]
        assert b.parent is None or page.branches[b.parent].end == b.start
    assert page.branches[0].end == len(trajectories[0].segments[0]) + len(trajectories[0].segments[1])
    assert page.unique_tokens == tree.num_unique_tokens and page.total_tokens == sum(t.num_tokens for t in trajectories)


def test_each_members_path_carries_its_loss_tokens_and_advantage() -> None:
    trajectories = calculator_group()
    page = group_page(loaded(trajectories), TEXT, ViewLimits())
    for member in page.members:
        path = [b for b in page.branches if member.index in b.members]
        assert sum(b.loss_tokens for b in path) == member.loss_tokens
        assert path[-1].ends == [member.index] or member.index in path[-1].ends
        assert path[-1].end == trajectories[member.index].num_tokens
    advantages = [m.advantage for m in page.members]
    for b in page.branches:
        expected = sum(advantages[m] for m in b.members) if b.loss_tokens else None
        assert b.advantage_sum == (None if expected is None else pytest.approx(expected))
    rows = [(m.episode, m.reward, m.finish_reason, m.truncated_tool_outputs, m.has_logprobs) for m in page.members]
    assert rows == [(10, 1.0, "answered", 1, True), (11, 0.0, "answered", 1, True), (12, 0.0, "answered", 0, True),
                    (13, 0.0, "max_turns", 1, True)]  # fmt: skip


def test_pieces_follow_the_segments_and_show_tool_calls_where_a_segment_ends() -> None:
    page = group_page(loaded(calculator_group()), TEXT, ViewLimits())
    pieces = {b.id: [(p.role, p.segment, p.segment_start, p.segment_end) for p in b.pieces] for b in page.branches}
    assert pieces == {
        0: [("system", 0, True, True), ("user", 1, True, True)],
        1: [("assistant", 2, True, True), ("tool", 3, True, True)],
        2: [("assistant", 4, True, False)],  # the answer's first token, shared by #0 and #1 ...
        3: [("assistant", 4, False, True)],  # ... which each end on their own
        4: [("assistant", 4, False, True)],
        5: [("assistant", 2, True, True)],
    }
    call, result = page.branches[1].pieces
    assert call.tool_calls == [{"name": "calculator", "arguments": {"expression": "7 + 5"}}]
    assert result.tool_calls == [RESULT] and result.loss_tokens == 0 and call.loss_tokens == call.end - call.start
    assert all(p.tool_calls is None for b in page.branches for p in b.pieces if p.role in ("system", "user"))


def test_pieces_and_members_show_the_versions_that_sampled_their_turns_and_how_stale() -> None:
    """Asynchronous GRPO: a member whose first turn version 3 sampled and its second version 4, trained on at 4."""
    trajectories = calculator_group()
    for t in trajectories:
        turns = [k for k, s in enumerate(t.segments) if s.role == "assistant"]
        for k, version in zip(turns, (3, 4), strict=False):
            t.segments[k] = dataclasses.replace(t.segments[k], policy_version=version)
        t.info["train_version"] = 4
    page = group_page(loaded(trajectories), TEXT, ViewLimits())
    shown = {(p.role, p.segment, p.policy_version, p.staleness) for b in page.branches for p in b.pieces}
    assert ("assistant", 2, 3, 1) in shown and ("assistant", 4, 4, 0) in shown and ("tool", 3, None, None) in shown
    assert [(m.turn_versions, m.staleness) for m in page.members][:2] == [([3, 4], 1), ([3, 4], 1)]
    plain = group_page(loaded(calculator_group()), TEXT, ViewLimits())
    assert {(m.staleness, tuple(m.turn_versions)) for m in plain.members} == {(None, ())}


def test_windows_hold_the_members_text_loss_mask_and_logprobs() -> None:
    trajectories = calculator_group()
    page = group_page(loaded(trajectories), TEXT, ViewLimits())
    tokenizer = load_tokenizer()
    for b in page.branches:
        rendered = trajectories[b.members[0]].render()
        for p in b.pieces:
            [window] = p.windows
            assert window.start == p.start and len(window.text) == p.end - p.start
            assert "".join(window.text) == tokenizer.decode(rendered.token_ids[p.start : p.end])
            assert window.loss == "".join(str(int(m)) for m in rendered.loss_mask[p.start : p.end])
            expected = rendered.logprobs[p.start : p.end].tolist()
            assert window.logprobs == [None if math.isnan(v) else round(v, 4) for v in expected]
    tool_text = "".join(page.branches[1].pieces[1].windows[0].text)
    assert TOOL_OUTPUT in tool_text


def test_long_pieces_carry_their_ends_and_a_group_its_budget() -> None:
    """A piece longer than ``whole_piece_tokens`` carries ``edge_tokens`` at each end; a group at most
    ``group_tokens``, loss pieces first (the prompt's pieces then carry nothing and are fetched on demand)."""
    limits = ViewLimits(whole_piece_tokens=8, edge_tokens=3, group_tokens=10_000)
    page = group_page(loaded(calculator_group()), TEXT, limits)
    for p in (p for b in page.branches for p in b.pieces):
        spans = [(w.start, w.start + len(w.text)) for w in p.windows]
        if p.end - p.start <= 8:
            assert spans == [(p.start, p.end)]
        else:
            assert spans == [(p.start, p.start + 3), (p.end - 3, p.end)]
    carried = sum(len(w.text) for b in page.branches for p in b.pieces if p.loss_tokens for w in p.windows)
    assert page.embedded_tokens == sum(len(w.text) for b in page.branches for p in b.pieces for w in p.windows)
    tight = group_page(
        loaded(calculator_group()), TEXT, ViewLimits(whole_piece_tokens=8, edge_tokens=3, group_tokens=carried)
    )
    assert tight.embedded_tokens == carried
    for p in (p for b in tight.branches for p in b.pieces):
        assert bool(p.windows) == bool(p.loss_tokens)


def test_token_ranges_on_demand() -> None:
    group = loaded(calculator_group())
    window = token_window(group, 1, 30, 40, TEXT, limit=4)
    assert (window.start, len(window.text)) == (30, 4)  # clipped to the limit
    assert window.loss == "".join(str(int(m)) for m in group.members[1].loss_mask[30:34])
    with pytest.raises(ValueError, match="member 7 is not in the group"):
        token_window(group, 7, 0, 1, TEXT, limit=4)
    with pytest.raises(ValueError, match=r"tokens \[90, 94\) are not inside member 0's 93 tokens"):
        token_window(group, 0, 90, 94, TEXT, limit=4)
    with pytest.raises(ValueError, match="not inside"):
        token_window(group, 0, 5, 5, TEXT, limit=4)


def test_long_tool_values_are_cut_with_their_length() -> None:
    page = group_page(loaded(calculator_group()), TEXT, ViewLimits(tool_value_chars=5))
    call, result = page.branches[1].pieces
    assert call.tool_calls == [{"name": "calcu… (10 characters)", "arguments": {"expression": "7 + 5"}}]
    [shown] = result.tool_calls or []
    assert shown["content"] == f"{TOOL_OUTPUT[:5]}… ({len(TOOL_OUTPUT):,} characters)"
    assert shown["truncated"] is True and shown["original_length"] == 4096


def test_a_group_the_trainer_refuses_is_listed_with_the_reason() -> None:
    short = Trajectory([Segment("assistant", [7])], "LongStraw/Env-v0", "g", reward=1.0)
    page = group_page(loaded([calculator_group()[0], short]), TEXT, ViewLimits())
    assert page.branches == [] and "member 1 has 1 tokens" in (page.tree_error or "")
    assert [m.tokens for m in page.members] == [93, 1]


def test_a_group_with_an_edited_episode_is_listed_without_its_tree() -> None:
    edited = edited_trajectory()
    edited.group_id = "step2-g0"
    group = loaded([*calculator_group()[:2], edited])
    page = group_page(group, TEXT, ViewLimits())
    assert page.branches == [] and page.unique_tokens == 0
    assert page.tree_error is not None
    assert page.tree_error.startswith("the tree is not drawn: members 2 (4 physical sequences) edited their context")
    assert [m.tokens for m in page.members] == [93, 93, 442] and page.total_tokens == 93 + 93 + 442
    trained = sum(m.num_loss_tokens for m in episode_members(edited))  # every loss token in exactly one sequence
    assert page.members[2].loss_tokens == trained == 36 and page.members[2].has_logprobs
    assert page.members[0].advantage is not None and page.members[2].advantage is not None
    json.dumps(dataclasses.asdict(page), allow_nan=False)  # what the page receives
    window = token_window(group, 2, 300, 442, TEXT, limit=4096)  # the log, in writing order
    assert window.loss == "".join(str(int(m)) for m in edited.loss_mask()[300:])


def test_members_without_a_shared_first_token_hang_from_an_empty_root() -> None:
    a = Trajectory([Segment("user", [1, 2]), Segment("assistant", [3, 4])], "E", "g", reward=1.0)
    b = Trajectory([Segment("user", [9, 2]), Segment("assistant", [3, 5])], "E", "g", reward=0.0)
    page = group_page(loaded([a, b]), TEXT, ViewLimits())
    root = page.branches[0]
    assert (root.start, root.end, root.pieces, len(root.children)) == (0, 0, [], 2)
    assert [page.branches[c].members for c in root.children] == [[0], [1]]
    assert np.array_equal([page.branches[c].end for c in root.children], [4, 4])


def test_pieces_name_the_stored_segment_also_after_empty_ones() -> None:
    episode = Trajectory(
        [Segment("system", [1, 2]), Segment("user", []), Segment("assistant", [3, 4], tool_calls=[CALL])],
        "E",
        "",
        reward=1.0,
    )
    [root] = group_page(loaded([episode]), TEXT, ViewLimits()).branches
    assert [(p.role, p.segment) for p in root.pieces] == [("system", 0), ("assistant", 2)]
    assert root.pieces[1].tool_calls == [CALL]
