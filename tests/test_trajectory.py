"""Trajectories: validation, default loss masks, and the exact render / from_rendered round trip."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from edited_episodes import SCRIPTS, block_tokens, expected_sequences, play, script_log

from longstraw_agents.trajectory import ContextEdit, Rendered, Segment, SegmentSpan, Trajectory


def _trajectory() -> Trajectory:
    return Trajectory(
        segments=[
            Segment("system", [1, 2, 3], text="sys"),
            Segment("user", [4, 5], text="question"),
            Segment("assistant", [6, 7, 8], logprobs=[-0.1, -0.2, np.nan], text="call", tool_calls=[{"name": "calc"}]),
            Segment("tool", [9], turn=0, text="84", tool_calls=[{"result": "84"}]),
            Segment("assistant", [10, 11], loss_mask=[True, False], turn=1, text="answer"),
        ],
        env_id="LongStraw/Calculator-v0",
        group_id="g0",
        seed=7,
        reward=1.0,
        finish_reason="answered",
        policy_version=3,
    )


def test_default_loss_masks_cover_assistant_tokens_only() -> None:
    trajectory = _trajectory()
    assert trajectory.loss_mask().tolist() == [False] * 5 + [True] * 3 + [False] + [True, False]
    for role in ("system", "user", "tool"):
        assert not Segment(role, [1, 2]).loss_mask.any()
    assert Segment("assistant", [1, 2]).loss_mask.all()


def test_arrays_are_normalised() -> None:
    segment = Segment("assistant", [1, 2], logprobs=[-1, -2])
    assert segment.token_ids.dtype == np.int32 and segment.loss_mask.dtype == bool
    assert segment.logprobs.dtype == np.float32
    assert np.isnan(Segment("user", [1]).logprobs_or_nan()).all()
    assert len(Segment("user", [])) == 0


def test_render_concatenates_and_records_spans() -> None:
    trajectory = _trajectory()
    rendered = trajectory.render()
    assert rendered.token_ids.tolist() == list(range(1, 12))
    assert [(s.start, s.end, s.role) for s in rendered.spans] == [
        (0, 3, "system"),
        (3, 5, "user"),
        (5, 8, "assistant"),
        (8, 9, "tool"),
        (9, 11, "assistant"),
    ]
    assert [s.has_logprobs for s in rendered.spans] == [False, False, True, False, False]
    lp = rendered.logprobs
    assert np.isnan(lp[[0, 1, 2, 3, 4, 7, 8, 9, 10]]).all()
    assert lp[5:7].tolist() == pytest.approx([-0.1, -0.2])
    assert trajectory.num_tokens == 11 and len(trajectory) == 5
    assert trajectory.completion_start() == 5


def test_from_rendered_is_the_exact_inverse() -> None:
    trajectory = _trajectory()
    metadata = {"env_id": trajectory.env_id, "seed": trajectory.seed, "reward": trajectory.reward}
    back = Trajectory.from_rendered(trajectory.render(), **metadata)
    assert back.segments == trajectory.segments  # token ids, masks, logprobs (NaN included), text, tool calls
    assert back.segments[0].logprobs is None and back.segments[2].logprobs is not None
    assert (back.env_id, back.seed, back.reward) == ("LongStraw/Calculator-v0", 7, 1.0)
    rendered_again = back.render()
    assert np.array_equal(rendered_again.token_ids, trajectory.render().token_ids)


def test_empty_trajectory() -> None:
    rendered = Trajectory().render()
    assert rendered.token_ids.size == 0 and rendered.spans == ()
    assert rendered.token_ids.dtype == np.int32 and rendered.loss_mask.dtype == bool
    assert Trajectory.from_rendered(rendered).segments == []
    assert Trajectory().completion_start() == 0


def test_segment_equality() -> None:
    a = Segment("assistant", [1, 2], logprobs=[np.nan, -1.0], text="x")
    assert a == Segment("assistant", [1, 2], logprobs=[np.nan, -1.0], text="x")
    assert a != Segment("assistant", [1, 2], logprobs=None, text="x")
    assert a != Segment("assistant", [1, 3], logprobs=[np.nan, -1.0], text="x")
    assert a != Segment("assistant", [1, 2], logprobs=[np.nan, -1.0], text="y")
    assert a != Segment("assistant", [1, 2], loss_mask=[True, False], logprobs=[np.nan, -1.0], text="x")
    with pytest.raises(TypeError):
        hash(a)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"role": "robot", "token_ids": [1]}, ValueError, "unknown role"),
        ({"role": "user", "token_ids": [[1, 2]]}, ValueError, "1-D"),
        ({"role": "user", "token_ids": [1.5]}, TypeError, "integers"),
        ({"role": "user", "token_ids": [-1]}, ValueError, r"\[0, 2\*\*31\)"),
        ({"role": "user", "token_ids": [2**31]}, ValueError, r"\[0, 2\*\*31\)"),
        ({"role": "user", "token_ids": [1, 2], "loss_mask": [True]}, ValueError, "loss_mask has shape"),
        ({"role": "assistant", "token_ids": [1, 2], "logprobs": [0.0]}, ValueError, "logprobs has shape"),
    ],
)
def test_segment_validation(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        Segment(**kwargs)


def _rendered(spans: tuple[SegmentSpan, ...], n: int) -> Rendered:
    return Rendered(np.arange(n, dtype=np.int32), np.zeros(n, bool), np.full(n, np.nan, np.float32), spans)


def test_from_rendered_rejects_spans_that_do_not_tile() -> None:
    with pytest.raises(ValueError, match="tile"):
        Trajectory.from_rendered(_rendered((SegmentSpan(0, 2, "user"), SegmentSpan(3, 4, "user")), 4))
    with pytest.raises(ValueError, match="tile"):
        Trajectory.from_rendered(_rendered((SegmentSpan(0, 2, "user"), SegmentSpan(2, 1, "user")), 4))
    with pytest.raises(ValueError, match="cover 2 tokens, sequence has 4"):
        Trajectory.from_rendered(_rendered((SegmentSpan(0, 2, "user"),), 4))


# --- context edits ----------------------------------------------------------------------------------------------
def test_physical_sequences_replay_the_edits_as_written_by_hand() -> None:
    tokens = block_tokens()
    for script, expected in zip(SCRIPTS, expected_sequences(), strict=True):
        trajectory = play(script, tokens)
        log = script_log(script)
        sequences = trajectory.physical_sequences()
        assert [seq.segments for seq in sequences] == [e.segments for e in expected]
        for seq, want in zip(sequences, expected, strict=True):
            assert set(seq.own()) & {k for k in seq.segments if trajectory.segments[k].role == "assistant"} == set(
                want.generated
            )
            rendered = trajectory.render_sequence(seq)
            assert np.array_equal(rendered.token_ids, want.tokens(log, tokens))
            assert np.array_equal(rendered.loss_mask, want.loss_mask(log, tokens))
        assert trajectory.context() == list(expected[-1].segments)


def test_an_episode_that_only_appends_is_one_sequence_of_every_segment() -> None:
    trajectory = _trajectory()
    assert not trajectory.is_edited
    (only,) = trajectory.physical_sequences()
    assert only.segments == tuple(range(len(trajectory)))
    rendered = trajectory.render_sequence(only)
    assert np.array_equal(rendered.token_ids, trajectory.token_ids())
    assert np.array_equal(rendered.loss_mask, trajectory.loss_mask())
    assert np.array_equal(rendered.logprobs, trajectory.render().logprobs, equal_nan=True)


def test_loss_and_behaviour_logprobs_stay_with_the_sequence_that_generated_them() -> None:
    trajectory = Trajectory([Segment("user", [1, 2]), Segment("assistant", [3, 4], logprobs=[-0.5, -0.25])])
    trajectory.append(Segment("tool", [5, 6, 7]))
    trajectory.evict([2], Segment("tool", [8]))
    trajectory.append(Segment("assistant", [9], logprobs=[-1.0]))
    first, second = (trajectory.render_sequence(s) for s in trajectory.physical_sequences())
    assert first.token_ids.tolist() == [1, 2, 3, 4] and first.loss_mask.tolist() == [0, 0, 1, 1]
    assert np.allclose(first.logprobs[2:4], [-0.5, -0.25])
    assert second.token_ids.tolist() == [1, 2, 3, 4, 8, 9] and second.loss_mask.tolist() == [0, 0, 0, 0, 0, 1]
    assert np.isnan(second.logprobs[:5]).all() and second.logprobs[5] == -1.0
    assert [s.has_logprobs for s in second.spans] == [False, False, False, True]


def test_edits_in_a_row_leave_out_the_context_nothing_was_generated_under() -> None:
    trajectory = Trajectory(
        [Segment("user", [1]), Segment("assistant", [2]), Segment("tool", [3]), Segment("tool", [4])]
    )
    trajectory.evict([2], Segment("tool", [5]))
    trajectory.evict([3], Segment("tool", [6]))
    trajectory.append(Segment("assistant", [7]))
    assert [s.segments for s in trajectory.physical_sequences()] == [(0, 1), (0, 1, 4, 5, 6)]
    whole = trajectory.physical_sequences(keep_empty=True)
    assert [s.segments for s in whole] == [(0, 1, 2, 3), (0, 1, 4, 3), (0, 1, 4, 5, 6)]


@pytest.mark.parametrize(
    ("removed", "replacement", "match"),
    [
        ([], Segment("tool", [9]), "at least one segment"),
        ([7], Segment("tool", [9]), r"segments \[7\], which are not in the context"),
        ([1, 3], Segment("tool", [9]), "consecutive context segments"),
        ([3, 2], Segment("tool", [9]), "consecutive context segments"),
        ([2], 0, "already in the context"),
        ([2], 9, "neither logged yet nor the next segment"),
    ],
)
def test_an_edit_that_does_not_fit_the_context_is_refused_and_changes_nothing(removed, replacement, match) -> None:
    trajectory = _trajectory()
    before = copy.deepcopy(trajectory)
    with pytest.raises(ValueError, match=match):
        trajectory.summarize(removed, replacement)
    assert trajectory == before


def test_an_evicted_segment_cannot_be_evicted_again() -> None:
    trajectory = _trajectory()
    trajectory.evict([3], Segment("tool", [99]))
    with pytest.raises(ValueError, match=r"segments \[3\], which are not in the context"):
        trajectory.evict([3], Segment("tool", [98]))


def test_a_segment_the_environment_writes_into_an_edit_is_context() -> None:
    """A placeholder or summary given as a new segment is the environment's: no loss even with role assistant."""
    trajectory = Trajectory([Segment("user", [1, 2]), Segment("assistant", [3, 4]), Segment("tool", [5])])
    trajectory.summarize([1, 2], Segment("assistant", [7, 8, 9], logprobs=[-1.0, -1.0, -1.0]))
    written = trajectory.segments[3]
    assert not written.loss_mask.any() and written.logprobs is None
    trajectory.append(Segment("assistant", [10]))
    assert [s.segments for s in trajectory.physical_sequences()] == [(0, 1), (0, 3, 4)]


def test_a_summary_the_environment_writes_followed_at_once_by_another_edit_opens_no_sequence() -> None:
    """The summary is context (no loss, whatever its role); nothing was generated under the context it opened before
    the next edit closed it, so that context is no physical sequence: every sequence left carries loss."""
    trajectory = Trajectory(
        [Segment("user", [1, 2]), Segment("assistant", [3, 4]), Segment("tool", [5]), Segment("tool", [6])]
    )
    trajectory.summarize([1, 2], Segment("assistant", [7, 8]))  # logged as 4
    trajectory.evict([3], Segment("tool", [9]))  # logged as 5, at once
    trajectory.append(Segment("assistant", [10]))
    sequences = trajectory.physical_sequences()
    assert [s.segments for s in sequences] == [(0, 1), (0, 4, 5, 6)]
    assert all(trajectory.render_sequence(s).loss_mask.any() for s in sequences)
    assert len(trajectory.physical_sequences(keep_empty=True)) == 3  # the store still replays every context


def test_loss_on_a_segment_of_any_role_stays_in_the_sequence_it_was_written_under() -> None:
    trajectory = Trajectory([Segment("user", [1, 2]), Segment("assistant", [3, 4]), Segment("tool", [5, 6])])
    trajectory.evict([2], Segment("tool", [9]))
    trajectory.append(Segment("user", [7, 8], loss_mask=[True, True]))  # e.g. a user simulator trained as policy
    masks = [trajectory.render_sequence(s).loss_mask.sum() for s in trajectory.physical_sequences()]
    assert masks == [2, 2] and sum(masks) == trajectory.loss_mask().sum()


def test_an_edit_whose_replacement_was_never_logged_is_refused() -> None:
    trajectory = Trajectory([Segment("user", [1]), Segment("assistant", [2]), Segment("tool", [3])])
    trajectory.edits.append(ContextEdit(before=3, removed=[2], replacement=3, kind="evict"))  # as a damaged store
    with pytest.raises(ValueError, match="its replacement segment is not in the log"):
        trajectory.physical_sequences()
    assert ContextEdit(3, [2], None, "evict") == ContextEdit(3, (2,), None, "evict")  # removed is a tuple
