"""``longstraw inspect``'s text (report.py): the overview of a store's episodes and transcripts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from stored_episodes import edited_trajectory, make_trajectory

from longstraw_agents.report import summary_text
from longstraw_agents.store import Store, StoreError
from longstraw_agents.trajectory import ContextEdit, Segment, Trajectory


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store.open(tmp_path / "trajectories.db") as opened:
        yield opened


def test_summary_overview(store: Store) -> None:
    store.add_run("r1", config={}, model="tiny-dense", tokenizer="longstraw-bpe")
    originals = [make_trajectory(n) for n in range(8)]
    store.add_episodes(originals, run_id="r1")
    text = summary_text(store)
    tokens = sum(t.num_tokens for t in originals)
    assert f"episodes 8  groups 2  tokens {tokens:,}  policy versions 0..4" in text
    assert "runs 1" in text and "r1  model tiny-dense  tokenizer longstraw-bpe  episodes 8" in text
    env0 = [t.reward for t in originals if t.env_id == "LongStraw/Env0-v0" and t.reward is not None]
    env0_line = next(line for line in text.splitlines() if line.startswith("LongStraw/Env0-v0"))
    assert env0_line.split()[1:] == [
        "3",
        "2",
        f"{sum(t.num_tokens for t in originals if t.env_id == 'LongStraw/Env0-v0'):,}",
        f"{sum(env0) / len(env0):.3f}",
        f"{min(env0):.3f}",
        f"{max(env0):.3f}",
    ]
    assert "finish reasons  answered 2, error 2, max_tokens 2, max_turns 2" in text
    assert "episode 1  " not in text
    filtered = summary_text(store, where="policy_version = 0")
    assert "episodes 2  groups 2" in filtered and "(where policy_version = 0)" in filtered


def test_summary_of_an_empty_store(store: Store) -> None:
    assert summary_text(store).splitlines()[1:] == ["runs 0", "episodes 0  groups 0  tokens 0"]


def test_transcript_of_an_episode(store: Store) -> None:
    long_text = "A" * 500 + "middle" + "Z" * 500
    trajectory = Trajectory(
        [
            Segment("user", [1, 2, 3], text=long_text),
            Segment(
                "assistant",
                [4, 5],
                logprobs=[-0.5, -1.5],
                loss_mask=[True, False],
                text="call\n",
                tool_calls=[{"name": "calculator", "arguments": {"expression": "6*7"}}],
            ),
            Segment("tool", [], text="42"),
        ],
        env_id="LongStraw/Calculator-v0",
        group_id="g",
        seed=11,
        reward=1.0,
        finish_reason="answered",
        info={"answer": 42},
    )
    episode_id = store.add_episode(trajectory)
    text = summary_text(store, episode=episode_id, max_text=60)
    lines = text.splitlines()
    assert lines[0].startswith(f"episode {episode_id}  env LongStraw/Calculator-v0  group g  seed 11")
    assert "reward 1.000  answered  5 tokens in 3 segments" in lines[0]
    assert lines[1] == '  info {"answer": 42}'
    assert lines[2].split() == ["#", "role", "turn", "tokens", "loss", "logp", "text"]
    assert lines[3].split()[:6] == ["0", "user", "0", "3", "0%", "-"]
    assert '"AAAA' in lines[3] and 'ZZZZ"' in lines[3] and "middle" not in lines[3] and "(1,006 chars)" in lines[3]
    assert lines[4].split()[:7] == ["1", "assistant", "0", "2", "50%", "-1.000", '"call\\n"']
    assert lines[5].strip() == 'tool_calls [{"name": "calculator", "arguments": {"expression": "6*7"}}]'
    assert lines[6].split() == ["2", "tool", "0", "0", "-", "-", '"42"']
    assert "middle" in summary_text(store, episode=episode_id, max_text=0)


def test_the_transcript_shows_each_turns_version_and_staleness(store: Store) -> None:
    """An episode of asynchronous GRPO: its first turn sampled by version 3, its second by 4, trained on at 4."""
    trajectory = Trajectory(
        [
            Segment("user", [1, 2], text="q"),
            Segment("assistant", [3], logprobs=[-1.0], policy_version=3, text="a"),
            Segment("tool", [4], text="r"),
            Segment("assistant", [5], logprobs=[-2.0], policy_version=4, text="b"),
        ],
        group_id="g",
        policy_version=3,
        info={"train_version": 4},
    )
    lines = summary_text(store, episode=store.add_episode(trajectory)).splitlines()
    assert lines[2].split() == ["#", "role", "turn", "version", "stale", "tokens", "loss", "logp", "text"]
    assert [line.split()[3:5] for line in lines[3:]] == [["-", "-"], ["3", "1"], ["-", "-"], ["4", "0"]]


def test_the_transcript_of_an_edited_episode_lists_its_sequences_and_edits(store: Store) -> None:
    trajectory = edited_trajectory()
    lines = summary_text(store, episode=store.add_episode(trajectory)).splitlines()
    assert len(lines) == 2 + 1 + 13 + 4  # header, info, table header, one row per segment, then the edits
    sizes = [sum(len(trajectory.segments[k]) for k in seq.segments) for seq in trajectory.physical_sequences()]
    assert sizes == [334, 88, 44, 42]
    assert lines[-4:] == [
        "  3 context edits, 4 physical sequences: 334, 88, 44, 42 tokens (loss 13, 10, 8, 5)",
        "  edit 1 before segment 6 (turn 1): evict segments 3 (tool, 300 tokens) -> placeholder segment 6 (4 tokens)",
        "  edit 2 before segment 8 (turn 3): summarize segments 2, 6, 4..5, 7 (3 assistant + 2 tool, 67 tokens)"
        " -> summary segment 7 (reused, 10 tokens)",
        "  edit 3 before segment 11 (turn 3): summarize segments 8..10 (1 user + 1 assistant + 1 tool, 43 tokens)"
        " -> summary segment 11 (6 tokens)",
    ]
    plain = summary_text(store, episode=store.add_episode(make_trajectory(1)))
    assert "context edits" not in plain and "edit 1" not in plain


def test_an_edit_at_the_end_of_the_log_that_leaves_nothing(store: Store) -> None:
    trajectory = Trajectory([Segment("user", [1, 2]), Segment("assistant", [3], turn=0), Segment("tool", [4, 5, 6])])
    trajectory.edits.append(ContextEdit(before=3, removed=(2,), replacement=None, kind="evict"))
    lines = summary_text(store, episode=store.add_episode(trajectory)).splitlines()
    assert lines[-2:] == [
        "  1 context edit, 1 physical sequence: 3 tokens (loss 1)",
        "  edit 1 at the end of the log (after segment 2): evict segments 2 (tool, 3 tokens) -> nothing",
    ]


def test_transcripts_of_a_group_and_of_everything(store: Store) -> None:
    ids = store.add_episodes([make_trajectory(n) for n in range(6)])
    group = summary_text(store, group="group-1")
    assert group.splitlines()[0].startswith("group group-1: 2 episodes, reward mean")
    assert [line.split()[1] for line in group.splitlines() if line.startswith("episode ")] == ["5", "6"]
    everything = summary_text(store, transcript=True)
    assert [int(line.split()[1]) for line in everything.splitlines() if line.startswith("episode ")] == ids
    with pytest.raises(StoreError, match="no group 'missing'"):
        summary_text(store, group="missing")
    with pytest.raises(StoreError, match="not both"):
        summary_text(store, episode=1, group="group-1")


@pytest.mark.parametrize("max_text", [0, 4])
def test_a_lone_surrogate_is_shown_escaped(store: Store, max_text: int) -> None:
    """The store keeps lone surrogates exactly; no terminal encoding can print one, so the transcript escapes it."""
    lone = "\ud800"
    trajectory = Trajectory(
        [Segment("tool", [1, 2], text=f"a{lone}b", tool_calls=[{"x": lone}])], group_id="g", info={"k": lone}
    )
    text = summary_text(store, episode=store.add_episode(trajectory), max_text=max_text)
    text.encode("utf-8")  # printable
    assert '"a\\ud800b"' in text
    if not max_text:  # shown whole
        assert 'info {"k": "\\ud800"}' in text and 'tool_calls [{"x": "\\ud800"}]' in text
