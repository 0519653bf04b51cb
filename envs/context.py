"""Context policies: what a `ToolEnv` does when an agent's context grows past its budget.

An episode may need many more tokens than the policy's context holds. With ``ToolEnvConfig.context`` set, the
environment keeps the context under ``max_context_tokens`` by editing it (``Trajectory.evict`` /
``Trajectory.summarize``), one strategy per class:

- ``Eviction``: once an observation takes the context past the budget, the oldest tool outputs leave it one by one
  (each replaced by a placeholder saying what was removed) until it fits again — tool-result clearing;
- ``SummaryTurn``: once an observation takes the context past ``threshold`` tokens, the policy is asked for a
  summary (a turn that carries loss like any other); the summary then replaces every turn so far and the episode
  goes on from the prompt and the summary. The threshold is fixed or drawn per task from the episode seed, so the
  members of a group share it (as verifiers' ``summarize_at_tokens``).

Token in / token out holds across edits: the step that edits returns the whole new context, exactly the ids the
next turn conditions on, and its ``info["context_edit"]`` says what changed (``ContextChange``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from longstraw_agents.trajectory import ContextEdit, Trajectory

PLACEHOLDER = "[tool output of turn {turn} removed from the context: {tokens} tokens]"
SUMMARY_REQUEST = (
    "Your context is nearly full. Summarise everything you have learned so far that you still need: the facts "
    "you found, where you found them and what is left to do. Your earlier turns will be replaced by this summary."
)
SUMMARY_RESUME = "Your earlier turns were replaced by your summary above. Go on with the task."


class Eviction(BaseModel):
    """Past the budget, evict the oldest tool outputs, each replaced by ``placeholder`` (formatted with the turn
    and the token count of what it replaces), until the context fits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["evict"] = "evict"
    placeholder: str = Field(
        PLACEHOLDER, description="the text in place of an evicted tool output; may use {turn} and {tokens}"
    )

    @field_validator("placeholder")
    @classmethod
    def _formats(cls, text: str) -> str:
        try:
            text.format(turn=0, tokens=0)
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(f"placeholder may use {{turn}} and {{tokens}} only; {text!r} fails: {err!r}") from None
        return text


class SummaryTurn(BaseModel):
    """Past ``threshold`` tokens, ask for a summary (``request``) that then replaces every turn so far."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["summary"] = "summary"
    threshold: int | tuple[int, int] | None = Field(
        None,
        description="context tokens that trigger the request: a number, a [low, high] range drawn per task (a group "
        "shares it), or None for 3/4 of max_context_tokens",
    )
    request: str = Field(SUMMARY_REQUEST, description="the user message that asks for the summary")
    resume: str = Field(SUMMARY_RESUME, description="the user message after the summary")

    @model_validator(mode="after")
    def _ordered(self) -> SummaryTurn:
        if isinstance(self.threshold, tuple) and not 1 <= self.threshold[0] <= self.threshold[1]:
            raise ValueError(f"threshold range must be 1 <= low <= high, got {list(self.threshold)}")
        if isinstance(self.threshold, int) and self.threshold < 1:
            raise ValueError(f"threshold must be >= 1, got {self.threshold}")
        return self

    def highest_threshold(self) -> int | None:
        """The largest threshold it may draw (None: it follows max_context_tokens)."""
        return self.threshold[1] if isinstance(self.threshold, tuple) else self.threshold

    def draw_threshold(self, max_context_tokens: int, seed: int) -> int:
        """The episode's threshold; a range is drawn from the episode seed, so every member of a group gets one."""
        if self.threshold is None:
            return max_context_tokens * 3 // 4
        if isinstance(self.threshold, int):
            return self.threshold
        low, high = self.threshold
        return int(np.random.default_rng([seed, 0x5EED]).integers(low, high + 1))


Strategy = Annotated[Eviction | SummaryTurn, Field(discriminator="kind")]


class ContextConfig(BaseModel):
    """The context budget of an episode and how it is kept (``strategy``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_context_tokens: int = Field(
        ..., ge=1, description="the most tokens the context may hold after an observation (leave room for a turn)"
    )
    strategy: Strategy = Field(default_factory=Eviction)

    @model_validator(mode="after")
    def _threshold_fits(self) -> ContextConfig:
        strategy = self.strategy
        high = strategy.highest_threshold() if isinstance(strategy, SummaryTurn) else None
        if high is not None and high >= self.max_context_tokens:
            raise ValueError(
                f"the summary threshold ({high}) must be below max_context_tokens ({self.max_context_tokens}): "
                "the request and the summary need room"
            )
        return self


@dataclass(frozen=True)
class ContextChange:
    """What a step's edits did: the context's first ``kept_tokens`` tokens are unchanged, the rest is new (the
    step's observation is the whole new context, ``num_tokens`` long); ``edits`` as the trajectory records them."""

    kept_tokens: int
    num_tokens: int
    edits: tuple[ContextEdit, ...]

    def to_record(self) -> dict[str, object]:
        return {
            "kept_tokens": self.kept_tokens,
            "num_tokens": self.num_tokens,
            "edits": [
                {"kind": e.kind, "removed": list(e.removed), "replacement": e.replacement, "before": e.before}
                for e in self.edits
            ],
        }


def kept_tokens(trajectory: Trajectory, before: list[int], after: list[int]) -> int:
    """Tokens of the longest run of segments ``before`` and ``after`` start with."""
    kept = 0
    for old, new in zip(before, after, strict=False):
        if old != new:
            break
        kept += len(trajectory.segments[old])
    return kept


def evictable(trajectory: Trajectory, context: list[int]) -> list[int]:
    """Tool outputs of ``context`` that may leave it, oldest first: not a placeholder. (Called before the turn's
    observation is logged: the newest output, which the next turn must read, is never among them.)"""
    replacements = {edit.replacement for edit in trajectory.edits}
    return [k for k in context if trajectory.segments[k].role == "tool" and k not in replacements]
