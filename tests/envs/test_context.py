"""Context policies: an episode longer than its context budget, kept under it by eviction or by summary turns.

The bar is token in / token out: every action was generated from the context the observations built (the test
tracks it from what ``reset`` and ``step`` return, and checks each edit's ``kept_tokens``), and the trajectory's
physical sequences are exactly those contexts, each action carrying loss in the one it was generated under.
"""

from __future__ import annotations

from collections.abc import Sequence

import gymnasium
import pytest
from pydantic import ValidationError

import longstraw_agents.envs  # noqa: F401 - registers the LongStraw ids
from longstraw_agents.envs import (
    Append,
    ContextConfig,
    ContextPlan,
    ContextPolicy,
    ContextView,
    EvictToolOutputs,
    Replace,
    ScriptedPolicy,
    SummarizeTurns,
    SummaryTurn,
    Unbounded,
    unwrap_tool_env,
)
from longstraw_agents.trajectory import Segment, Trajectory

NEEDLE = "LongStraw/NeedleSearch-v0"
# a scripted episode of about 8K tokens (two documents of ~3.3K) under a 5K budget
EPISODE = {"target_tokens": 8192, "needles": 2, "max_tokens": 32_768, "max_turns": 12}
BUDGET = 5000


def play(env: gymnasium.Env, seed: int) -> tuple[Trajectory, list[tuple[list[int], list[int]]], list[dict]]:
    """The scripted episode, the (context, action) of every turn as the observations built it, and the edits'
    ``info["context_edit"]``."""
    tool_env = unwrap_tool_env(env)
    observation, _ = env.reset(seed=seed)
    context, turns, changes, policy = observation.tolist(), [], [], ScriptedPolicy(env)
    while True:
        action = policy.act().tolist()
        turns.append((list(context), action))
        observation, _, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            return tool_env.trajectory, turns, changes
        change = info.get("context_edit")
        if change is None:
            context += action + observation.tolist()
        else:
            kept = change["kept_tokens"]
            assert observation[:kept].tolist() == (context + action)[:kept]  # what the edit says it kept, it kept
            assert len(observation) == change["num_tokens"]
            context = observation.tolist()
            changes.append(change)


def generated_under(trajectory: Trajectory) -> list[tuple[list[int], list[int]]]:
    """(the tokens before it, its tokens) of each assistant segment, in the physical sequence it carries loss in."""
    out = []
    for sequence in trajectory.physical_sequences():
        rendered = trajectory.render_sequence(sequence)
        for span in rendered.spans:
            if rendered.loss_mask[span.start : span.end].any():
                out.append(
                    (rendered.token_ids[: span.start].tolist(), rendered.token_ids[span.start : span.end].tolist())
                )
    return out


def make(strategy: dict, **overrides) -> gymnasium.Env:
    context = {"max_context_tokens": BUDGET, "strategy": strategy}
    return gymnasium.make(NEEDLE, **{**EPISODE, **overrides}, context=context)


@pytest.mark.parametrize("strategy", [{"kind": "evict"}, {"kind": "summary", "threshold": 3500}])
def test_an_episode_longer_than_its_budget_is_played_to_the_end_token_in_token_out(strategy: dict) -> None:
    trajectory, turns, changes = play(make(strategy), seed=3)

    assert trajectory.finish_reason == "answered" and trajectory.reward == 1.0
    assert trajectory.num_tokens > 1.5 * BUDGET and trajectory.is_edited and changes
    assert generated_under(trajectory) == [(list(context), action) for context, action in turns]
    assert all(len(context) <= BUDGET for context, _ in turns)
    assert {e.kind for e in trajectory.edits} == {strategy["kind"]}


def test_eviction_replaces_the_oldest_tool_outputs_by_placeholders_that_say_what_went() -> None:
    trajectory, _, changes = play(make({"kind": "evict"}), seed=3)
    for edit in trajectory.edits:
        (evicted,) = edit.removed
        segment, placeholder = trajectory.segments[evicted], trajectory.segments[edit.replacement]
        assert segment.role == placeholder.role == "tool"
        assert f"turn {segment.turn} removed from the context: {len(segment)} tokens" in placeholder.text
    first = changes[0]["edits"][0]
    assert first["kind"] == "evict" and first["removed"] == [trajectory.edits[0].removed[0]]
    # the oldest output goes first: the search results of turn 0, before any document
    assert trajectory.segments[trajectory.edits[0].removed[0]].turn == 0


def test_a_summary_turn_replaces_every_turn_so_far_and_carries_loss() -> None:
    trajectory, turns, _ = play(make({"kind": "summary", "threshold": 3500}), seed=3)
    summaries = [e for e in trajectory.edits if e.kind == "summary"]
    assert summaries
    for edit in summaries:
        summary = trajectory.segments[edit.replacement]
        assert summary.role == "assistant" and summary.loss_mask.all() and summary.text.startswith("Facts found: ")
        asked = trajectory.segments[edit.replacement - 1]
        assert asked.role == "user" and "Summarise everything you have learned" in asked.text
        assert trajectory.segments[edit.removed[0]].role == "assistant"  # from the first turn on
    after = trajectory.physical_sequences()[1]
    assert [trajectory.segments[k].role for k in after.segments[:4]] == ["system", "user", "assistant", "user"]


def test_a_drawn_threshold_is_shared_by_a_group_and_varies_between_tasks() -> None:
    strategy = SummaryTurn(threshold=(1000, 4000))
    assert strategy.draw_threshold(BUDGET, 7) == strategy.draw_threshold(BUDGET, 7)
    assert len({strategy.draw_threshold(BUDGET, seed) for seed in range(20)}) > 10
    assert all(1000 <= strategy.draw_threshold(BUDGET, seed) <= 4000 for seed in range(20))
    assert SummaryTurn().draw_threshold(4096, 0) == 3072


def test_a_context_that_cannot_be_brought_under_budget_ends_the_episode() -> None:
    """A document longer than the budget, with nothing left to evict: the turn that opened it is the last (logged;
    the observation that cannot fit is not), reward 0, and every turn was still generated within the budget."""
    trajectory, turns, _ = play(make({"kind": "evict"}, target_tokens=16_384), seed=3)
    assert trajectory.finish_reason == "context_limit" and trajectory.reward == 0.0
    assert trajectory.segments[-1].role == "assistant"
    assert generated_under(trajectory) == [(list(context), action) for context, action in turns]
    assert all(len(context) <= BUDGET for context, _ in turns)


def test_the_episode_budget_counts_placeholders_and_an_output_longer_than_its_placeholder_is_evicted() -> None:
    """max_tokens binds every segment logged, placeholders included: an episode ends at it rather than pass it."""
    trajectory, _, changes = play(make({"kind": "evict"}, max_tokens=8142), seed=3)
    assert trajectory.num_tokens <= 8142 and trajectory.finish_reason == "max_tokens"
    for edit in trajectory.edits:
        assert len(trajectory.segments[edit.removed[0]]) > len(trajectory.segments[edit.replacement])


def test_without_a_context_policy_nothing_is_edited() -> None:
    trajectory, turns, changes = play(gymnasium.make(NEEDLE, **EPISODE), seed=3)
    assert not trajectory.is_edited and not changes and trajectory.reward == 1.0
    assert generated_under(trajectory) == [(list(context), action) for context, action in turns]


@pytest.mark.parametrize(
    ("context", "match"),
    [
        ({"max_context_tokens": 4096, "strategy": {"kind": "summary", "threshold": 4096}}, "must be below"),
        ({"max_context_tokens": 4096, "strategy": {"kind": "summary", "threshold": [3000, 2000]}}, "low <= high"),
        ({"max_context_tokens": 4096, "strategy": {"kind": "compact"}}, "does not match any of the expected tags"),
        ({"max_context_tokens": 0}, "greater than or equal to 1"),
        ({"max_context_tokens": 9, "strategy": {"kind": "evict", "placeholder": "[{what}]"}}, r"use \{turn\} and"),
    ],
)
def test_bad_context_settings_are_refused_naming_the_problem(context: dict, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        gymnasium.make(NEEDLE, context=context)


def test_a_prompt_over_the_context_budget_is_refused() -> None:
    env = gymnasium.make(NEEDLE, context={"max_context_tokens": 100})
    with pytest.raises(ValueError, match="more than context.max_context_tokens=100"):
        env.reset(seed=0)


def test_the_reference_summary_of_an_env_without_its_own_says_what_its_turns_did() -> None:
    prompt = len(gymnasium.make("LongStraw/Calculator-v0").reset(seed=2)[0])
    context = {"max_context_tokens": prompt + 400, "strategy": {"kind": "summary", "threshold": prompt + 10}}
    env = gymnasium.make("LongStraw/Calculator-v0", num_operations=2, max_turns=8, context=context)
    trajectory, turns, _ = play(env, seed=2)
    assert trajectory.reward == 1.0 and trajectory.is_edited
    summary = trajectory.segments[trajectory.edits[0].replacement]
    first_call = unwrap_tool_env(env).scripted_turns(unwrap_tool_env(env).task)[0]
    assert summary.text == f"So far I have done this:\n- {first_call}<|im_end|>"
    assert generated_under(trajectory) == [(list(context), action) for context, action in turns]


class DropOldestOutputs(ContextPolicy):
    """A policy of the test's own: past the budget, the oldest tool outputs leave the context with nothing in their
    place. Nothing in `ToolEnv` knows it."""

    def plan(self, episode: ContextView, adding: Sequence[Segment]) -> ContextPlan:
        assert self.max_context_tokens is not None
        over = episode.tokens + sum(len(segment) for segment in adding) - self.max_context_tokens
        outputs = [k for k in episode.context if episode.trajectory.segments[k].role == "tool"]
        dropped = []
        for k in outputs:
            if over <= 0:
                break
            dropped.append(Replace((k,), None, "evict"))
            over -= len(episode.trajectory.segments[k])
        return ContextPlan(tuple(dropped))


def test_a_policy_of_ones_own_runs_an_episode_token_in_token_out() -> None:
    env = gymnasium.make(NEEDLE, **EPISODE, context_policy=DropOldestOutputs(BUDGET))
    trajectory, turns, changes = play(env, seed=3)

    assert trajectory.finish_reason == "answered" and trajectory.reward == 1.0
    assert trajectory.num_tokens > 1.5 * BUDGET and changes
    assert generated_under(trajectory) == [(list(context), action) for context, action in turns]
    assert all(len(context) <= BUDGET for context, _ in turns)
    dropped = [k for edit in trajectory.edits for k in edit.removed]
    assert all(edit.replacement is None for edit in trajectory.edits)
    assert all(trajectory.segments[k].role == "tool" for k in dropped) and dropped == sorted(dropped)


class NoteOnce(ContextPolicy):
    """Another of the test's own, without a budget: once the context passes ``at`` tokens it asks for a note; the
    reply stays in the context (nothing is edited) and a message resumes the task."""

    def __init__(self, at: int) -> None:
        super().__init__(None)
        self.at = at

    def plan(self, episode: ContextView, adding: Sequence[Segment]) -> ContextPlan:
        asked = any("Write a note." in segment.text for segment in episode.trajectory.segments)
        if asked or episode.tokens + sum(len(segment) for segment in adding) <= self.at:
            return ContextPlan()
        return ContextPlan((Append(episode.formatter.observation("user", "Write a note.", episode.turn)),), asks=True)

    def plan_reply(self, episode: ContextView, reply: Segment) -> ContextPlan:
        return ContextPlan((Append(episode.formatter.observation("user", "Go on.", episode.turn)),))


def test_a_policy_of_ones_own_may_ask_for_a_turn_that_then_goes_to_it() -> None:
    env = gymnasium.make(NEEDLE, **EPISODE, context_policy=NoteOnce(at=BUDGET))
    trajectory, turns, changes = play(env, seed=3)

    assert trajectory.finish_reason == "answered" and trajectory.reward == 1.0
    assert unwrap_tool_env(env).context_replies == 1 and not trajectory.is_edited and not changes
    texts = [segment.text for segment in trajectory.segments]
    asked = next(k for k, text in enumerate(texts) if "Write a note." in text)
    assert texts[asked + 1].startswith("Facts found: ") and "Go on." in texts[asked + 2]  # NeedleSearch's summary
    assert generated_under(trajectory) == [(list(context), action) for context, action in turns]


class BrokenPolicy(ContextPolicy):
    """Plans an edit that does not fit the context (a segment that is not in it)."""

    def plan(self, episode: ContextView, adding: Sequence[Segment]) -> ContextPlan:
        return ContextPlan((Replace((len(episode.trajectory) + 5,), None, "evict"),))


def test_a_plan_that_does_not_fit_the_context_is_refused_and_the_episode_stays_as_it_was() -> None:
    env = gymnasium.make(NEEDLE, **EPISODE, context_policy=BrokenPolicy(BUDGET))
    env.reset(seed=3)
    tool_env = unwrap_tool_env(env)
    logged, tokens, turn = len(tool_env.trajectory), tool_env.num_tokens, tool_env.turn
    with pytest.raises(ValueError, match="not in the context"):
        env.step(ScriptedPolicy(env).act())
    assert (len(tool_env.trajectory), tool_env.num_tokens, tool_env.turn) == (logged, tokens, turn)
    assert not tool_env.trajectory.edits


def test_the_yaml_kinds_build_their_policy_objects_and_one_policy_comes_one_way() -> None:
    evict = ContextConfig.model_validate({"max_context_tokens": BUDGET, "strategy": {"kind": "evict"}}).build()
    summary = ContextConfig.model_validate({"max_context_tokens": BUDGET, "strategy": {"kind": "summary"}}).build()
    assert isinstance(evict, EvictToolOutputs) and evict.max_context_tokens == BUDGET
    assert isinstance(summary, SummarizeTurns) and summary.settings == SummaryTurn()
    assert isinstance(unwrap_tool_env(gymnasium.make(NEEDLE)).context_policy, Unbounded)
    with pytest.raises(ValueError, match="not both"):
        gymnasium.make(NEEDLE, context={"max_context_tokens": BUDGET}, context_policy=DropOldestOutputs(BUDGET))
