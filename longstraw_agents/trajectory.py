"""Token-exact trajectories: an ordered list of segments, each a run of token ids with one role.

A trajectory is what an episode leaves behind and what the trainer consumes. Tokens are never re-derived from
text: the ids the policy produced (and the ids the environment appended) are the trajectory. Rendering the segments
into one sequence (``render``) and splitting it back (``Trajectory.from_rendered``) are exact inverses.

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
    """

    role: Role
    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray | None = None
    turn: int = 0
    text: str = ""
    tool_calls: list[dict[str, Any]] | None = None

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


@dataclass(frozen=True)
class Rendered:
    """A trajectory as flat arrays: ids, loss mask and behaviour logprobs (NaN where unknown), plus spans."""

    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    spans: tuple[SegmentSpan, ...]


@dataclass
class Trajectory:
    """An ordered list of segments plus the episode's metadata."""

    segments: list[Segment] = field(default_factory=list)
    env_id: str = ""
    group_id: str = ""
    seed: int | None = None
    reward: float | None = None
    finish_reason: FinishReason = "running"
    policy_version: int = 0
    info: dict[str, Any] = field(default_factory=dict)

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

    def token_ids(self) -> np.ndarray:
        return self.render().token_ids

    def loss_mask(self) -> np.ndarray:
        return self.render().loss_mask

    def render(self) -> Rendered:
        """Concatenate the segments into one sequence; ``from_rendered`` inverts it exactly."""
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
