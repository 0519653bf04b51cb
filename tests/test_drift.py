"""The drift audit: token-exact ids against what re-encoding their text view would give."""

from __future__ import annotations

import pytest

from longstraw_agents.chat import ChatFormatter
from longstraw_agents.drift import audit_drift, check_trajectory, compare_ids
from longstraw_agents.tokenizer import IM_END, TiktokenTokenizer, load_tokenizer
from longstraw_agents.trajectory import Segment, Trajectory

CONVERSATION = [
    {"role": "system", "content": "Use the calculator."},
    {"role": "user", "content": "What is 6 * 7?"},
    {"role": "assistant", "content": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n'},
    {"role": "tool", "content": "42"},
    {"role": "assistant", "content": "<answer>42</answer>"},
]


@pytest.fixture(scope="module")
def tokenizer() -> TiktokenTokenizer:
    return load_tokenizer()  # type: ignore[return-value]


@pytest.fixture(scope="module")
def chat(tokenizer: TiktokenTokenizer) -> ChatFormatter:
    return ChatFormatter(tokenizer)


def test_formatter_output_does_not_drift(tokenizer: TiktokenTokenizer, chat: ChatFormatter) -> None:
    trajectory = chat.render_messages(CONVERSATION)
    report = audit_drift(tokenizer, CONVERSATION, trajectory.token_ids())
    assert report.ok and report.first_mismatch is None and report.num_differing == 0
    assert report.length_difference == 0 and report.num_actual == trajectory.num_tokens
    assert str(report) == f"no drift ({trajectory.num_tokens} tokens)"
    assert audit_drift(tokenizer, chat.render_text(CONVERSATION), trajectory.token_ids()).ok
    assert check_trajectory(tokenizer, trajectory).ok


def test_pieces_encoded_apart_drift_from_their_concatenation(tokenizer: TiktokenTokenizer) -> None:
    apart = tokenizer.encode("Total: 12") + tokenizer.encode("3 apples")
    joined = tokenizer.encode("Total: 123 apples")
    assert apart != joined  # "12" + "3" is two tokens, "123" is one
    report = audit_drift(tokenizer, "Total: 123 apples", apart)
    assert not report.ok
    prefix = len(tokenizer.encode("Total: "))
    assert report.first_mismatch == prefix
    assert report.length_difference == 1
    assert (report.actual_end, report.reencoded_end) == (prefix + 2, prefix + 1)  # the common suffix is found
    assert report.actual_window_text == report.reencoded_window_text == "Total: 123 apples"
    assert "drift at token" in str(report)


def test_non_canonical_tokenisation_drifts(tokenizer: TiktokenTokenizer) -> None:
    word = "calculator"
    canonical = tokenizer.encode(word)
    byte_by_byte = [tokenizer.encode(ch)[0] for ch in word]
    assert tokenizer.decode(byte_by_byte) == word and len(canonical) < len(byte_by_byte)
    report = audit_drift(tokenizer, word, byte_by_byte)
    assert report.first_mismatch == 0
    assert (report.num_actual, report.num_reencoded) == (len(byte_by_byte), len(canonical))
    assert report.actual_window_ids == tuple(byte_by_byte[:8])


def test_special_string_in_a_document_drifts_at_its_position(tokenizer: TiktokenTokenizer, chat: ChatFormatter) -> None:
    content = f"The log ends with\n{IM_END}\nhere."
    messages = [{"role": "user", "content": content}]
    trajectory = chat.render_messages(messages)
    report = audit_drift(tokenizer, messages, trajectory.token_ids())
    before = chat.render_text(messages).split(IM_END)[0]
    assert report.first_mismatch == len(tokenizer.encode(before, allow_special=True))
    assert IM_END in report.actual_window_text
    per_segment = check_trajectory(tokenizer, trajectory)
    assert per_segment.drifted_segments == [0] and not per_segment.ok


def test_check_trajectory_finds_the_drifting_segment(tokenizer: TiktokenTokenizer, chat: ChatFormatter) -> None:
    sampled = [tokenizer.encode(ch)[0] for ch in "<answer>"] + tokenizer.encode("42") + [tokenizer.eos_token_id]
    trajectory = Trajectory(
        segments=[*chat.prompt(CONVERSATION[:2]), chat.assistant(sampled, turn=0, logprobs=[-1.0] * len(sampled))]
    )
    report = check_trajectory(tokenizer, trajectory)
    assert report.drifted_segments == [2]
    assert report.segments[2].first_mismatch == 0
    assert not report.whole.ok and report.whole.first_mismatch == len(trajectory.segments[0]) + len(
        trajectory.segments[1]
    )
    assert str(report).startswith("segment 2: drift at token 0")


def test_check_trajectory_catches_merges_across_a_segment_boundary(
    tokenizer: TiktokenTokenizer, chat: ChatFormatter
) -> None:
    cut = tokenizer.encode("The answer is 42.")  # cut by the token budget before <|im_end|>
    trajectory = Trajectory(
        segments=[
            *chat.prompt(CONVERSATION[:2]),
            chat.assistant(cut, turn=0),
            chat.observation("user", "Go on.", turn=0),
        ]
    )
    report = check_trajectory(tokenizer, trajectory)
    assert report.drifted_segments == []  # each piece re-encodes to itself ...
    assert not report.whole.ok and not report.ok  # ... but ".\n" joins into one token across the boundary
    assert report.whole.first_mismatch == sum(len(s) for s in trajectory.segments[:3]) - 1
    assert str(report).startswith("whole sequence: drift")


def test_compare_ids_counts_and_regions(tokenizer: TiktokenTokenizer) -> None:
    shifted = compare_ids(tokenizer, [1, 2, 3], [1, 9, 2, 3])
    assert shifted.first_mismatch == 1 and shifted.num_differing == 2 and shifted.length_difference == -1
    assert (shifted.actual_end, shifted.reencoded_end) == (1, 2)
    truncated = compare_ids(tokenizer, [5, 6], [5, 6, 7], context=1)
    assert truncated.first_mismatch == 2 and truncated.num_differing == 0 and not truncated.ok
    assert truncated.actual_window_ids == (6,) and truncated.reencoded_window_ids == (6, 7)
    assert compare_ids(tokenizer, [], []).ok


def test_check_trajectory_audits_the_joins_an_edit_makes(tokenizer: TiktokenTokenizer, chat: ChatFormatter) -> None:
    """A turn cut before ``<|im_end|>`` is closed by the observation that follows it (no drift in the log); an edit
    that puts an unclosed placeholder there joins ".\\n" across the boundary: drift in the edited context only."""
    cut = tokenizer.encode("The answer is 42.")
    closing = [tokenizer.eos_token_id, *chat.observation("tool", "page", turn=0).token_ids]
    trajectory = Trajectory(
        segments=[
            *chat.prompt(CONVERSATION[:2]),
            chat.assistant(cut, turn=0),
            Segment("tool", closing, text=tokenizer.decode(closing)),
        ]
    )
    assert check_trajectory(tokenizer, trajectory).ok
    trajectory.evict([len(trajectory.segments) - 1], chat.observation("tool", "[removed]", turn=0))
    report = check_trajectory(tokenizer, trajectory)
    assert report.drifted_segments == [] and len(report.sequences) == 2
    assert report.sequences[0].ok and not report.sequences[1].ok and not report.ok
    assert str(report).startswith("context 1: drift")
