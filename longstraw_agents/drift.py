"""Retokenisation drift: where re-encoding the text view of a trajectory would not give back its token ids.

A text-level pipeline (render a chat template to a string, tokenize the string) can produce ids that differ from
the ones the policy actually sampled and the environment actually appended: a policy may sample a non-canonical
tokenisation, two pieces encoded separately may merge differently when encoded together, and a special-token string
inside a document is text in the token view but a control token once the transcript is re-encoded. Training on the
re-encoded ids then scores tokens the policy never produced. ``audit_drift`` compares the two views and says where
they part; ``check_trajectory`` does it per segment and for each context the episode was rendered into.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from longstraw_agents.chat import ChatFormatter
from longstraw_agents.tokenizer import Tokenizer
from longstraw_agents.trajectory import Trajectory

DEFAULT_CONTEXT = 8  # tokens shown on each side of the first mismatch


@dataclass(frozen=True)
class DriftReport:
    """How the token-exact ids (``actual``) compare with the ids re-encoding the text gives (``reencoded``).

    ``first_mismatch`` is the first position where they differ (None when they are equal). ``num_differing`` counts
    positions of the common length that differ; ``length_difference`` is ``len(actual) - len(reencoded)``. The
    drift region is what lies between the common prefix and the common suffix: ``actual[first_mismatch:actual_end]``
    versus ``reencoded[first_mismatch:reencoded_end]``. The windows show ``context`` tokens either side of the first
    mismatch, as ids and decoded.
    """

    num_actual: int
    num_reencoded: int
    first_mismatch: int | None
    num_differing: int
    actual_end: int
    reencoded_end: int
    window_start: int
    actual_window_ids: tuple[int, ...]
    reencoded_window_ids: tuple[int, ...]
    actual_window_text: str
    reencoded_window_text: str

    @property
    def ok(self) -> bool:
        return self.first_mismatch is None

    @property
    def length_difference(self) -> int:
        return self.num_actual - self.num_reencoded

    def __str__(self) -> str:
        if self.ok:
            return f"no drift ({self.num_actual} tokens)"
        return (
            f"drift at token {self.first_mismatch}: actual[{self.first_mismatch}:{self.actual_end}] vs "
            f"re-encoded[{self.first_mismatch}:{self.reencoded_end}]; {self.num_differing} differing positions, "
            f"length {self.num_actual} vs {self.num_reencoded}\n"
            f"  actual     {list(self.actual_window_ids)} {self.actual_window_text!r}\n"
            f"  re-encoded {list(self.reencoded_window_ids)} {self.reencoded_window_text!r}"
        )


@dataclass(frozen=True)
class TrajectoryDriftReport:
    """Drift of each segment (its ``text`` against its ids) and of each context the episode was rendered into: the
    one whole sequence of an episode that only appended, every context (``physical_sequences(keep_empty=True)``) of
    one that edited its context, whose edits make joins the log does not have."""

    segments: tuple[DriftReport, ...]
    sequences: tuple[DriftReport, ...]

    @property
    def whole(self) -> DriftReport:
        """The first context's report: the whole sequence of an episode that only appended."""
        return self.sequences[0]

    @property
    def ok(self) -> bool:
        return all(report.ok for report in self.sequences) and all(report.ok for report in self.segments)

    @property
    def drifted_segments(self) -> list[int]:
        return [i for i, report in enumerate(self.segments) if not report.ok]

    def __str__(self) -> str:
        if self.ok:
            tokens = sum(report.num_actual for report in self.sequences)
            return f"no drift ({len(self.segments)} segments, {tokens} tokens)"
        lines = [f"segment {i}: {self.segments[i]}" for i in self.drifted_segments]
        for k, report in enumerate(self.sequences):
            if not report.ok:
                lines.append(f"{'whole sequence' if len(self.sequences) == 1 else f'context {k}'}: {report}")
        return "\n".join(lines)


def compare_ids(
    tokenizer: Tokenizer,
    actual: Sequence[int] | np.ndarray,
    reencoded: Sequence[int] | np.ndarray,
    *,
    context: int = DEFAULT_CONTEXT,
) -> DriftReport:
    """Compare two id sequences of (supposedly) the same text."""
    a = np.asarray(actual, dtype=np.int64).reshape(-1)
    r = np.asarray(reencoded, dtype=np.int64).reshape(-1)
    common = min(a.size, r.size)
    differs = a[:common] != r[:common]
    num_differing = int(differs.sum())
    if num_differing:
        first = int(np.argmax(differs))
    elif a.size != r.size:
        first = common
    else:
        return DriftReport(a.size, r.size, None, 0, a.size, r.size, a.size, (), (), "", "")
    suffix = _common_suffix_length(a[first:], r[first:])
    start = max(first - context, 0)
    a_window, r_window = a[start : first + context], r[start : first + context]
    return DriftReport(
        num_actual=int(a.size),
        num_reencoded=int(r.size),
        first_mismatch=first,
        num_differing=num_differing,
        actual_end=int(a.size - suffix),
        reencoded_end=int(r.size - suffix),
        window_start=start,
        actual_window_ids=tuple(a_window.tolist()),
        reencoded_window_ids=tuple(r_window.tolist()),
        actual_window_text=tokenizer.decode(a_window),
        reencoded_window_text=tokenizer.decode(r_window),
    )


def _common_suffix_length(a: np.ndarray, r: np.ndarray) -> int:
    n = min(a.size, r.size)
    if n == 0:
        return 0
    differs = a[a.size - n :][::-1] != r[r.size - n :][::-1]
    return int(np.argmax(differs)) if differs.any() else n


def audit_drift(
    tokenizer: Tokenizer,
    messages_or_text: str | Sequence[Mapping[str, Any]],
    token_ids: Sequence[int] | np.ndarray,
    *,
    add_generation_prompt: bool = True,
    context: int = DEFAULT_CONTEXT,
) -> DriftReport:
    """Would re-encoding the text view give ``token_ids``?

    ``messages_or_text`` is either the text itself or chat messages, which are rendered to text with
    ``ChatFormatter.render_text`` (same conventions as ``render_messages``). The text is encoded the way a
    text-level pipeline would, with special-token strings read as control tokens.
    """
    if isinstance(messages_or_text, str):
        text = messages_or_text
    else:
        text = ChatFormatter(tokenizer).render_text(messages_or_text, add_generation_prompt=add_generation_prompt)
    reencoded = tokenizer.encode(text, allow_special=True)
    return compare_ids(tokenizer, token_ids, reencoded, context=context)


def check_trajectory(
    tokenizer: Tokenizer, trajectory: Trajectory, *, context: int = DEFAULT_CONTEXT
) -> TrajectoryDriftReport:
    """Audit every segment's ``text`` against its ids, and each context's concatenated text against its ids (which
    also catches pieces that re-encode differently once joined across a segment boundary)."""
    segments = tuple(audit_drift(tokenizer, segment.text, segment.token_ids, context=context) for segment in trajectory)
    sequences = tuple(
        audit_drift(
            tokenizer,
            "".join(trajectory.segments[k].text for k in sequence.segments),
            trajectory.render_sequence(sequence).token_ids,
            context=context,
        )
        for sequence in (trajectory.physical_sequences(keep_empty=True) if trajectory.segments else [])
    ) or (audit_drift(tokenizer, "", trajectory.token_ids(), context=context),)
    return TrajectoryDriftReport(segments=segments, sequences=sequences)
