"""Context policies: what a `ToolEnv` does when an agent's context grows past its budget.

An episode may need many more tokens than the policy's context holds. A context policy keeps the context under its
``max_context_tokens`` by editing it (``Trajectory.edit``); each policy is one class:

- ``EvictToolOutputs`` (config ``Eviction``, kind ``evict``): once an observation takes the context past the budget,
  the oldest tool outputs leave it one by one (each replaced by a placeholder saying what was removed) until it fits
  again — tool-result clearing;
- ``SummarizeTurns`` (config ``SummaryTurn``, kind ``summary``): once an observation takes the context past
  ``threshold`` tokens, the policy is asked for a summary (a turn that carries loss like any other); the summary then
  replaces every turn so far and the episode goes on from the prompt and the summary. The threshold is fixed or drawn
  per task from the episode seed, so the members of a group share it (as verifiers' ``summarize_at_tokens``);
- ``Unbounded``: no budget, the context is the whole episode (what an env without ``context`` uses).

The interface, all a new policy implements (``ContextPolicy``): ``plan(episode, adding)`` is asked at every tool turn,
before the action and its observation (``adding``) are logged, and returns a ``ContextPlan``: messages to log after
them (``Append``) and edits (``Replace``), in order. A plan that ``asks`` (a request for a summary) hands the next
action to ``plan_reply(episode, reply)`` instead of the tools, whose plan applies the reply (the summary replaces the
turns) and resumes the episode. ``episode`` is a read-only ``ContextView``. The environment checks every plan on a draft
of the episode before it applies it: a plan that leaves the context over ``max_context_tokens`` ends the episode
(``"context_limit"``), one that logs past the episode's ``max_tokens`` ends it (``"max_tokens"``), and an edit that
does not fit the context is refused with the episode left as it was. Policies are pure functions of the episode so
far: the environment may plan a turn that then ends otherwise, and one policy object may serve many environments.

Why a strategy object the environment holds, not a Gymnasium wrapper: a wrapper sees ``reset``/``step`` from outside,
as token ids. A context policy works inside one step: it reads and edits the episode's log (``env.trajectory``, whose
physical sequences must be the contexts the policy conditioned on), its placeholders count in the episode's
``max_tokens``, the observation it follows must end without the generation prompt when it asks for something, and a
reply to its request must reach it before any tool runs, after the env's own rules (an answer, the turn budget). A
wrapper would have to reach into ``env.unwrapped`` for all of that and split one step's rules across two layers;
every caller (rollouts, replay, serving) would have to apply it, and ``gymnasium.make(id, context=...)`` could no
longer build it from the env's config. So `ToolEnv` holds one policy (``env.context_policy``) and calls it at those two
points; a new policy is a subclass passed as ``ToolEnv(context_policy=...)`` (or ``gymnasium.make(id,
context_policy=...)``), the YAML kinds build theirs from ``ContextConfig``.

Token in / token out holds across edits: the step that edits returns the whole new context, exactly the ids the
next turn conditions on, and its ``info["context_edit"]`` says what changed (``ContextChange``).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Literal, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from longstraw_agents.chat import ChatFormatter
from longstraw_agents.trajectory import ContextEdit, EditKind, Segment, Trajectory

PLACEHOLDER = "[tool output of turn {turn} removed from the context: {tokens} tokens]"
SUMMARY_REQUEST = (
    "Your context is nearly full. Summarise everything you have learned so far that you still need: the facts "
    "you found, where you found them and what is left to do. Your earlier turns will be replaced by this summary."
)
SUMMARY_RESUME = "Your earlier turns were replaced by your summary above. Go on with the task."


# ---------------------------------------------------------------------------------------------------------------------
# What a policy reads, and what it returns
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ContextView:
    """The episode as a context policy sees it, before the turn it plans is logged (read it, never write it)."""

    trajectory: Trajectory
    """The log so far: every segment, evicted ones included, and the edits."""
    context: tuple[int, ...]
    """Log indices of the current context, in order."""
    turn: int
    """The turn being taken (assistant turns so far)."""
    seed: int
    """The episode seed (a group's members share it)."""
    formatter: ChatFormatter
    """Writes the messages a policy adds (requests, placeholders) in the episode's chat format."""

    @property
    def tokens(self) -> int:
        """Tokens of the current context."""
        return self.trajectory.num_tokens_of(self.context)


class ContextLog(Protocol):
    """What a plan is applied to: the episode (or a draft of it, to check the plan first)."""

    def append(self, segment: Segment) -> None: ...

    def replace(self, removed: Sequence[int], replacement: Segment | int | None, kind: EditKind) -> None: ...


@dataclass(frozen=True)
class Append:
    """Log ``segment`` at the end of the context: a message of the policy's (a request, the message that resumes)."""

    segment: Segment

    def apply(self, log: ContextLog) -> None:
        log.append(self.segment)


@dataclass(frozen=True)
class Replace:
    """Replace the consecutive context segments ``removed`` (log indices) by ``replacement``: a new segment (a
    placeholder, logged as context), the log index of one already logged (a reply reused verbatim), or None."""

    removed: tuple[int, ...]
    replacement: Segment | int | None
    kind: EditKind

    def apply(self, log: ContextLog) -> None:
        log.replace(self.removed, self.replacement, self.kind)


@dataclass(frozen=True)
class ContextPlan:
    """What a turn does to the context after the turn's own segments are logged: ``steps``, in order. ``asks``: the
    plan's messages ask for something, and the next action is the reply (see ``ContextPolicy.plan_reply``)."""

    steps: tuple[Append | Replace, ...] = ()
    asks: bool = False

    @property
    def messages(self) -> tuple[Segment, ...]:
        """The messages it logs (the observation it follows then hands the generation prompt over to them)."""
        return tuple(step.segment for step in self.steps if isinstance(step, Append))

    @property
    def edits_context(self) -> bool:
        """Whether it changes the context other than by appending (the step then returns the whole new context)."""
        return any(isinstance(step, Replace) for step in self.steps)

    def apply(self, log: ContextLog) -> None:
        for step in self.steps:
            step.apply(log)


# ---------------------------------------------------------------------------------------------------------------------
# The policies
# ---------------------------------------------------------------------------------------------------------------------


class ContextPolicy(ABC):
    """How an episode's context is kept under ``max_context_tokens`` (None: no budget); see the module docstring."""

    def __init__(self, max_context_tokens: int | None) -> None:
        if max_context_tokens is not None and max_context_tokens < 1:
            raise ValueError(f"max_context_tokens must be >= 1, got {max_context_tokens}")
        self.max_context_tokens = max_context_tokens

    @abstractmethod
    def plan(self, episode: ContextView, adding: Sequence[Segment]) -> ContextPlan:
        """A tool turn: ``adding`` (the action, then the observation that answers it, ending with the generation
        prompt) is about to be logged. The plan's steps follow it; an empty plan leaves the context as it grows."""

    def plan_reply(self, episode: ContextView, reply: Segment) -> ContextPlan:
        """The turn after a plan that asked: ``reply`` (the action) is about to be logged and no tool runs; the plan
        says what the reply does (its index in the log will be ``len(episode.trajectory)``)."""
        raise NotImplementedError(f"{type(self).__name__} asked for a reply but does not define plan_reply")

    edits_keep_most_of_the_context: bool = False
    """Whether its edits leave most of the context as it was (eviction), so a sampler keeps a state at every turn to
    resume from; a policy that rewrites it (summaries) resumes from the prompt."""

    def with_budget(self, max_context_tokens: int) -> ContextPolicy:
        """This policy at another budget (the model's context caps it: ``rollout.make_env_factory``); a ValueError
        when it cannot work at that budget. A subclass whose settings depend on the budget checks them here."""
        policy = copy.copy(self)
        ContextPolicy.__init__(policy, max_context_tokens)
        return policy

    def over_budget(self, tokens: int) -> bool:
        """Whether a context of ``tokens`` tokens is more than the policy keeps."""
        return self.max_context_tokens is not None and tokens > self.max_context_tokens

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_context_tokens={self.max_context_tokens})"


class Unbounded(ContextPolicy):
    """No budget: the context is the whole episode, never edited."""

    def __init__(self) -> None:
        super().__init__(None)

    def plan(self, episode: ContextView, adding: Sequence[Segment]) -> ContextPlan:
        return ContextPlan()


class EvictToolOutputs(ContextPolicy):
    """Past the budget, evict the oldest tool outputs, each replaced by a placeholder (``settings.placeholder``,
    formatted with the turn and the token count of what it replaces), until the context fits. An output whose
    placeholder is not shorter stays; the newest output, which the next turn must read, never goes."""

    edits_keep_most_of_the_context = True

    def __init__(self, max_context_tokens: int, settings: Eviction | None = None) -> None:
        super().__init__(max_context_tokens)
        self.settings = settings if settings is not None else Eviction()

    def plan(self, episode: ContextView, adding: Sequence[Segment]) -> ContextPlan:
        assert self.max_context_tokens is not None
        over = episode.tokens + sum(len(segment) for segment in adding) - self.max_context_tokens
        steps = []
        for candidate in evictable(episode.trajectory, episode.context):
            if over <= 0:
                break
            evicted = episode.trajectory.segments[candidate]
            placeholder = self.placeholder(evicted, episode.formatter)
            saved = len(evicted) - len(placeholder)
            if saved > 0:
                steps.append(Replace((candidate,), placeholder, "evict"))
                over -= saved
        # when even that does not fit, the environment ends the episode (context_limit)
        return ContextPlan(tuple(steps))

    def placeholder(self, evicted: Segment, formatter: ChatFormatter) -> Segment:
        """A tool message in place of ``evicted``, formed like it (closing an unclosed turn where it did)."""
        text = self.settings.placeholder.format(turn=evicted.turn, tokens=len(evicted))
        segment = formatter.tool_observation([text], evicted.turn)
        closes = int(evicted.token_ids[0]) == formatter.tokenizer.eos_token_id
        return formatter.closing(segment) if closes else segment


class SummarizeTurns(ContextPolicy):
    """Past the episode's threshold (``settings``), ask for a summary (``settings.request``); the reply then replaces
    every turn so far, and ``settings.resume`` goes on with the task."""

    def __init__(self, max_context_tokens: int, settings: SummaryTurn | None = None) -> None:
        super().__init__(max_context_tokens)
        self.settings = settings if settings is not None else SummaryTurn()
        high = self.settings.highest_threshold()
        if high is not None and high >= max_context_tokens:
            raise ValueError(
                f"the summary threshold ({high}) must be below max_context_tokens ({max_context_tokens}): "
                "the request and the summary need room"
            )

    def with_budget(self, max_context_tokens: int) -> SummarizeTurns:
        return SummarizeTurns(max_context_tokens, self.settings)

    def plan(self, episode: ContextView, adding: Sequence[Segment]) -> ContextPlan:
        assert self.max_context_tokens is not None
        threshold = self.settings.draw_threshold(self.max_context_tokens, episode.seed)
        if episode.tokens + sum(len(segment) for segment in adding) <= threshold:
            return ContextPlan()
        request = episode.formatter.observation("user", self.settings.request, episode.turn)
        return ContextPlan((Append(request),), asks=True)

    def plan_reply(self, episode: ContextView, reply: Segment) -> ContextPlan:
        """The summary replaces every turn from the first on (the prompt stays), itself included, reused verbatim
        (its loss stays in the sequence it was generated under); then the episode resumes."""
        formatter = episode.formatter
        resume = formatter.observation("user", self.settings.resume, episode.turn)
        resume = resume if formatter.ends_turn(reply.token_ids) else formatter.closing(resume)
        summary = len(episode.trajectory)  # the reply's index once logged
        context = [*episode.context, summary]
        segments = episode.trajectory.segments
        first_turn = next(i for i, k in enumerate(context) if segments[k].role == "assistant")
        return ContextPlan((Replace(tuple(context[first_turn:]), summary, "summary"), Append(resume)))


# ---------------------------------------------------------------------------------------------------------------------
# Their configs (``ToolEnvConfig.context``, YAML's ``context: {max_context_tokens, strategy: {kind: ...}}``)
# ---------------------------------------------------------------------------------------------------------------------


class Eviction(BaseModel):
    """Past the budget, evict the oldest tool outputs, each replaced by ``placeholder`` (formatted with the turn
    and the token count of what it replaces), until the context fits (``EvictToolOutputs``)."""

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

    def build(self, max_context_tokens: int) -> EvictToolOutputs:
        return EvictToolOutputs(max_context_tokens, self)


class SummaryTurn(BaseModel):
    """Past ``threshold`` tokens, ask for a summary (``request``) that then replaces every turn so far
    (``SummarizeTurns``)."""

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

    def build(self, max_context_tokens: int) -> SummarizeTurns:
        return SummarizeTurns(max_context_tokens, self)


Strategy = Annotated[Eviction | SummaryTurn, Field(discriminator="kind")]


class ContextConfig(BaseModel):
    """The context budget of an episode and how it is kept (``strategy``); ``build()`` makes the policy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_context_tokens: int = Field(
        ..., ge=1, description="the most tokens the context may hold after an observation (leave room for a turn)"
    )
    strategy: Strategy = Field(default_factory=Eviction)

    @model_validator(mode="after")
    def _buildable(self) -> ContextConfig:
        self.build()  # the policy checks what it needs of the budget (a summary threshold below it)
        return self

    def build(self) -> ContextPolicy:
        return self.strategy.build(self.max_context_tokens)


# ---------------------------------------------------------------------------------------------------------------------
# Helpers of the environment and the policies
# ---------------------------------------------------------------------------------------------------------------------


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


def evictable(trajectory: Trajectory, context: Sequence[int]) -> list[int]:
    """Tool outputs of ``context`` that may leave it, oldest first: not a placeholder. (Called before the turn's
    observation is logged: the newest output, which the next turn must read, is never among them.)"""
    replacements = {edit.replacement for edit in trajectory.edits}
    return [k for k in context if trajectory.segments[k].role == "tool" and k not in replacements]
