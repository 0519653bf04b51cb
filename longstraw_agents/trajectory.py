"""Token-exact trajectories: an ordered list of segments, each a run of token ids with one role.

A trajectory is what an episode leaves behind and what the trainer consumes. Tokens are never re-derived from
text: the ids the policy produced (and the ids the environment appended) are the trajectory. Rendering the segments
into one sequence (``render``) and splitting it back (``Trajectory.from_rendered``) are exact inverses.

Most episodes only append, and then the segments in order are the one sequence the policy conditioned on. An agent
near its context budget may also *edit* its context: evict a tool output (a placeholder takes its place) or replace
a run of turns by a summary. The segments are then a log, in the order they were written, and ``edits`` records
each ``ContextEdit``; ``physical_sequences()`` replays the log into the token sequences the policy actually
conditioned on, each with positions from 0. Every assistant token carries loss in exactly one of them: the one that
was the context when it was generated (later sequences that keep it see it as context).

Arrays are numpy (int32 ids, bool masks, float32 logprobs) so that a million-token episode stays a few MB and the
agent side never needs torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[Role, ...] = ("system", "user", "assistant", "tool")

EditKind = Literal["evict", "summary"]
FinishReason = Literal["answered", "max_turns", "max_tokens", "context_limit", "error", "aborted", "running"]


def _as_ids(ids: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
        raise ValueError("token ids must be in [0, 2**31)")
    return arr.astype(np.int32, copy=False)


@dataclass(frozen=True, eq=False, init=False)
class Segment:
    """One run of tokens with one role.

    ``loss_mask`` says which tokens carry policy loss (by default: every token of an assistant segment, none of the
    others). ``logprobs`` are the behaviour policy's log-probabilities of the tokens when known (NaN where unknown).
    ``turn`` is the index of the agent turn the segment belongs to. ``text`` is the decoded text, for people;
    ``tool_calls`` records parsed calls (assistant) or results (tool), for people and for replay.
    ``policy_version`` is the version of the weights that sampled the segment (an assistant turn; None when unknown or
    not sampled): an episode that goes on across weight updates (asynchronous GRPO) holds turns of several versions.
    """

    role: Role
    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray | None = None
    turn: int = 0
    text: str = ""
    tool_calls: list[dict[str, Any]] | None = None
    policy_version: int | None = None

    # Written out (not generated with a __post_init__) so that the fields have their validated types: the arguments
    # may be lists or None, the fields are arrays (``loss_mask`` always).
    def __init__(
        self,
        role: Role,
        token_ids: Sequence[int] | np.ndarray,
        loss_mask: Sequence[bool] | np.ndarray | None = None,
        logprobs: Sequence[float] | np.ndarray | None = None,
        turn: int = 0,
        text: str = "",
        tool_calls: list[dict[str, Any]] | None = None,
        policy_version: int | None = None,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
        ids = _as_ids(token_ids)
        if loss_mask is None:
            mask = np.full(ids.shape, role == "assistant", dtype=bool)
        else:
            mask = np.asarray(loss_mask, dtype=bool)
            if mask.shape != ids.shape:
                raise ValueError(f"loss_mask has shape {mask.shape}, token_ids {ids.shape}")
        lp: np.ndarray | None = None
        if logprobs is not None:
            lp = np.asarray(logprobs, dtype=np.float32)
            if lp.shape != ids.shape:
                raise ValueError(f"logprobs has shape {lp.shape}, token_ids {ids.shape}")
        object.__setattr__(self, "role", role)
        object.__setattr__(self, "token_ids", ids)
        object.__setattr__(self, "loss_mask", mask)
        object.__setattr__(self, "logprobs", lp)
        object.__setattr__(self, "turn", turn)
        object.__setattr__(self, "text", text)
        object.__setattr__(self, "tool_calls", tool_calls)
        object.__setattr__(self, "policy_version", None if policy_version is None else int(policy_version))

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Segment):
            return NotImplemented
        return (
            self.role == other.role
            and self.turn == other.turn
            and self.text == other.text
            and self.tool_calls == other.tool_calls
            and self.policy_version == other.policy_version
            and np.array_equal(self.token_ids, other.token_ids)
            and np.array_equal(self.loss_mask, other.loss_mask)
            and _logprobs_equal(self.logprobs, other.logprobs)
        )

    __hash__ = None  # type: ignore[assignment]

    def logprobs_or_nan(self) -> np.ndarray:
        if self.logprobs is None:
            return np.full(len(self), np.nan, dtype=np.float32)
        return self.logprobs


def _logprobs_equal(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return np.array_equal(a, b, equal_nan=True)


@dataclass(frozen=True)
class SegmentSpan:
    """Where a segment sits in the rendered sequence, plus everything about it that is not per-token."""

    start: int
    end: int
    role: Role
    turn: int = 0
    text: str = ""
    tool_calls: list[dict[str, Any]] | None = None
    has_logprobs: bool = False
    policy_version: int | None = None


@dataclass(frozen=True)
class Rendered:
    """A trajectory as flat arrays: ids, loss mask and behaviour logprobs (NaN where unknown), plus spans."""

    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    spans: tuple[SegmentSpan, ...]


@dataclass(frozen=True)
class ContextEdit:
    """A change of the context that is not an append.

    When the log held ``before`` segments, the run ``removed`` (log indices, consecutive in the context) left the
    context and ``replacement`` (a log index, or None: nothing) took its place. The replacement is either the next
    segment logged (index ``before``: a placeholder or a summary the environment writes) or an earlier one no longer in
    the context (a summary the policy generated, reused verbatim). ``kind`` says why, for people.
    """

    before: int
    removed: tuple[int, ...]
    replacement: int | None
    kind: EditKind

    def __post_init__(self) -> None:
        object.__setattr__(self, "removed", tuple(int(k) for k in self.removed))  # lists compare unequal to tuples
        if not self.removed:
            raise ValueError("a context edit must remove at least one segment")
        if self.kind not in ("evict", "summary"):
            raise ValueError(f"unknown edit kind {self.kind!r}; expected 'evict' or 'summary'")

    def applied_to(self, context: list[int]) -> list[int]:
        """``context`` (log indices) after this edit; refuses an edit that does not fit it (with what is wrong)."""
        removed = list(self.removed)
        missing = [k for k in removed if k not in context]
        if missing:
            raise ValueError(f"context edit removes segments {missing}, which are not in the context {context}")
        first = context.index(removed[0])
        if context[first : first + len(removed)] != removed:
            raise ValueError(
                f"context edit must remove consecutive context segments in order; got {removed} in {context}"
            )
        rest = context[:first] + context[first + len(removed) :]
        if self.replacement is None:
            return rest
        if self.replacement > self.before or self.replacement < 0:
            raise ValueError(
                f"replacement {self.replacement} is neither logged yet nor the next segment ({self.before})"
            )
        if self.replacement in rest:
            raise ValueError(f"replacement {self.replacement} is already in the context")
        return rest[:first] + [self.replacement] + rest[first:]


@dataclass(frozen=True)
class PhysicalSequence:
    """A token sequence the policy conditioned on: the log segments ``segments`` in context order.

    It was the context while the log grew from ``opened`` to ``closed`` segments; the assistant segments logged then
    were generated under it, so it carries their loss and no other (kept older turns are context here)."""

    segments: tuple[int, ...]
    opened: int
    closed: int

    def generated(self, segment: int) -> bool:
        return self.opened <= segment < self.closed

    def own(self) -> list[int]:
        """The segments logged while this was the context, in context order."""
        return [k for k in self.segments if self.generated(k)]


@dataclass
class Trajectory:
    """An ordered list of segments plus the episode's metadata (``edits``: context edits, when the agent made any)."""

    segments: list[Segment] = field(default_factory=list)
    env_id: str = ""
    group_id: str = ""
    seed: int | None = None
    reward: float | None = None
    finish_reason: FinishReason = "running"
    policy_version: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    edits: list[ContextEdit] = field(default_factory=list)

    def __iter__(self) -> Iterator[Segment]:
        return iter(self.segments)

    def __len__(self) -> int:
        return len(self.segments)

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.segments)

    def append(self, segment: Segment) -> None:
        self.segments.append(segment)

    def extend(self, segments: Iterable[Segment]) -> None:
        self.segments.extend(segments)

    @property
    def is_edited(self) -> bool:
        return bool(self.edits)

    def num_tokens_of(self, segments: Iterable[int]) -> int:
        """Tokens of the log segments ``segments`` (a context, a physical sequence's ``segments``)."""
        return sum(len(self.segments[k]) for k in segments)

    # --- context edits ---------------------------------------------------------------------------------------------
    def evict(self, segments: Sequence[int], placeholder: Segment) -> ContextEdit:
        """Remove the consecutive context segments ``segments`` (log indices) and put ``placeholder`` (logged now,
        as context: the environment wrote it) in their place."""
        return self.edit(segments, placeholder, "evict")

    def summarize(self, segments: Sequence[int], summary: Segment | int) -> ContextEdit:
        """Replace the consecutive context segments ``segments`` by ``summary``: a new segment the environment
        writes (logged now, as context), or the log index of one already written (the policy's summary turn, reused
        verbatim; its loss stays in the sequence it was generated under)."""
        return self.edit(segments, summary, "summary")

    def edit(self, segments: Sequence[int], replacement: Segment | int | None, kind: EditKind) -> ContextEdit:
        """Replace the consecutive context segments ``segments`` by ``replacement``: a new segment (logged now, as
        context), the log index of one already written, or None (they leave the context, nothing takes their place).
        Refused with what is wrong, and nothing changed, when the edit does not fit the current context."""
        index = len(self.segments) if isinstance(replacement, Segment) else replacement
        edit = ContextEdit(before=len(self.segments), removed=tuple(segments), replacement=index, kind=kind)
        edit.applied_to(self.context())  # validates against the current context before anything changes
        self.edits.append(edit)
        if isinstance(replacement, Segment):
            self.segments.append(_as_context(replacement))
        return edit

    def context(self) -> list[int]:
        """The log indices of the current context, in order (every segment when there are no edits)."""
        return list(self.physical_sequences(keep_empty=True)[-1].segments) if self.segments else []

    def physical_sequences(self, keep_empty: bool = False) -> list[PhysicalSequence]:
        """The contexts the policy conditioned on, in time order: one per edit plus the last. A context an edit
        closed ends with the last segment generated under it (an assistant segment the policy wrote, or any with
        loss); one under which nothing was generated (two edits in a row, such as a summary the environment wrote in
        the assistant role followed at once by another edit, or an episode that ends on an edit) is left out (with
        nothing generated at all, the last context alone is). ``keep_empty``: every context whole, as it was before
        each edit and at the end."""
        edits = sorted(self.edits, key=lambda e: e.before)
        context: list[int] = []
        sequences: list[PhysicalSequence] = []
        opened = 0
        pending = iter(edits)
        edit = next(pending, None)
        placed: set[int] = set()  # the log segments already in some context (``in`` on a set, not the list)
        for index in range(len(self.segments) + 1):
            while edit is not None and edit.before == index:
                if edit.replacement is not None and edit.replacement >= len(self.segments):
                    raise ValueError(f"context edit {edit}: its replacement segment is not in the log")
                sequences.append(PhysicalSequence(tuple(context), opened, index))
                context, opened = edit.applied_to(context), index
                placed.update(context)
                edit = next(pending, None)
            if index < len(self.segments) and index not in placed:
                context.append(index)
                placed.add(index)
        if edit is not None:
            raise ValueError(f"context edit {edit} is after the end of the log ({len(self.segments)} segments)")
        sequences.append(PhysicalSequence(tuple(context), opened, len(self.segments)))
        if keep_empty:
            return sequences
        written = self._written_by_edits()
        generating = [self._conditioned(seq, written) for seq in sequences[:-1] if self._generated_under(seq, written)]
        last = sequences[-1]
        return [*generating, last] if self._generated_under(last, written) or not generating else generating

    def _written_by_edits(self) -> set[int]:
        """The log segments an edit wrote (placeholders, summaries the environment wrote): context, whatever role."""
        return {e.replacement for e in self.edits if e.replacement is not None and e.replacement == e.before}

    def _generates(self, segment: int, written: set[int]) -> bool:
        """Something the policy wrote: a segment that carries loss, or an assistant segment no edit wrote."""
        if self.segments[segment].loss_mask.any():
            return True
        return self.segments[segment].role == "assistant" and segment not in written

    def _generated_under(self, sequence: PhysicalSequence, written: set[int]) -> bool:
        return any(self._generates(k, written) for k in sequence.own())

    def _conditioned(self, sequence: PhysicalSequence, written: set[int]) -> PhysicalSequence:
        """A sequence an edit closed, up to its last generated segment: what was logged after it (the observation
        the edit answered) was never conditioned on there; it is read in the next sequence."""
        last = max(k for k in sequence.own() if self._generates(k, written))
        segments = sequence.segments[: sequence.segments.index(last) + 1]
        return PhysicalSequence(segments, sequence.opened, sequence.closed)

    def render_sequence(self, sequence: PhysicalSequence) -> Rendered:
        """One physical sequence as flat arrays (a span per segment, in context order): loss and behaviour log-probs
        only on the segments logged while it was the context."""
        parts = [
            self.segments[k] if sequence.generated(k) else _as_context(self.segments[k]) for k in sequence.segments
        ]
        return Trajectory(parts).render()

    # --- the log as one sequence -----------------------------------------------------------------------------------
    def token_ids(self) -> np.ndarray:
        """The log's tokens (the one sequence the policy saw when there are no edits)."""
        return self.render().token_ids

    def loss_mask(self) -> np.ndarray:
        return self.render().loss_mask

    def render(self) -> Rendered:
        """Concatenate the segments (the log) into one sequence; ``from_rendered`` inverts it exactly."""
        spans: list[SegmentSpan] = []
        pos = 0
        for seg in self.segments:
            spans.append(
                SegmentSpan(
                    start=pos,
                    end=pos + len(seg),
                    role=seg.role,
                    turn=seg.turn,
                    text=seg.text,
                    tool_calls=seg.tool_calls,
                    has_logprobs=seg.logprobs is not None,
                    policy_version=seg.policy_version,
                )
            )
            pos += len(seg)
        if not self.segments:
            empty = np.zeros(0, dtype=np.int32)
            return Rendered(empty, empty.astype(bool), empty.astype(np.float32), ())
        return Rendered(
            token_ids=np.concatenate([s.token_ids for s in self.segments]),
            loss_mask=np.concatenate([s.loss_mask for s in self.segments]),
            logprobs=np.concatenate([s.logprobs_or_nan() for s in self.segments]),
            spans=tuple(spans),
        )

    @classmethod
    def from_rendered(cls, rendered: Rendered, **metadata: Any) -> Trajectory:
        """Split a rendered sequence back into segments (exact inverse of ``render``)."""
        segments = []
        expected_start = 0
        for span in rendered.spans:
            if span.start != expected_start or span.end < span.start:
                raise ValueError(f"spans must tile the sequence; got {span.start}..{span.end} at {expected_start}")
            sl = slice(span.start, span.end)
            segments.append(
                Segment(
                    role=span.role,
                    token_ids=rendered.token_ids[sl].copy(),
                    loss_mask=rendered.loss_mask[sl].copy(),
                    logprobs=rendered.logprobs[sl].copy() if span.has_logprobs else None,
                    turn=span.turn,
                    text=span.text,
                    tool_calls=span.tool_calls,
                    policy_version=span.policy_version,
                )
            )
            expected_start = span.end
        if expected_start != len(rendered.token_ids):
            raise ValueError(f"spans cover {expected_start} tokens, sequence has {len(rendered.token_ids)}")
        return cls(segments=segments, **metadata)

    def completion_start(self) -> int:
        """Index of the first token that carries loss (len if none): the end of the shared-prompt part."""
        mask = self.loss_mask()
        hits = np.flatnonzero(mask)
        return int(hits[0]) if hits.size else int(mask.size)


def _as_context(segment: Segment) -> Segment:
    """``segment`` as context: no loss, no behaviour log-probs."""
    return Segment(
        segment.role,
        segment.token_ids,
        np.zeros(len(segment), bool),
        None,
        segment.turn,
        segment.text,
        segment.tool_calls,
        segment.policy_version,
    )
