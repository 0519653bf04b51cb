"""``LongStraw/NeedleSearch-v0`` (envs/needle_search.py) and its generated world (envs/needle_corpus.py)."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from pydantic import ValidationError

from longstraw_agents.envs import NeedleSearchConfig, NeedleSearchEnv, ScriptedPolicy, run_episode
from longstraw_agents.envs.needle_corpus import Person, Place

FACT_PATTERNS = {
    "founded": r"{name} was founded in (\d+)\.",
    "population": r"{name} had a population of (\d+)\.",
    "born": r"{name} was born in (\d+) in ",
}


def scripted(target_tokens: int, seed: int, **kwargs) -> tuple[NeedleSearchEnv, float]:
    """The env after its scripted episode, and the CPU seconds the episode took (this process's CPU time, which
    other work on the machine does not stretch)."""
    env = NeedleSearchEnv(target_tokens=target_tokens, **kwargs)
    start = time.process_time()
    trajectory = run_episode(env, ScriptedPolicy(env), seed=seed)
    assert trajectory.reward == 1.0 and trajectory.finish_reason == "answered"
    return env, time.process_time() - start


@pytest.mark.parametrize(("target", "tolerance"), [(4096, 0.2), (32_768, 0.05)])
def test_the_scripted_episode_grows_to_the_target_length(target: int, tolerance: float) -> None:
    for seed in range(3):
        env, _ = scripted(target, seed)
        assert abs(env.trajectory.num_tokens / target - 1) < tolerance


def test_a_million_token_episode_takes_seconds() -> None:
    env, elapsed = scripted(1 << 20, seed=0)
    trajectory = env.trajectory
    assert abs(trajectory.num_tokens / (1 << 20) - 1) < 0.02
    # ~1 s of CPU on a quiet machine; the bound is 10x that
    assert elapsed < 10, f"building and playing a 1M-token episode took {elapsed:.1f} s of CPU"
    opened = [s for s in trajectory if s.role == "tool" and len(s) > 100_000]
    assert len(opened) == 2  # the two needle documents, whole (not cut by the tool's output cap)
    assert all("[truncated" not in s.text for s in opened)


@pytest.mark.parametrize("seed", range(6))
def test_the_answer_needs_facts_stated_once_each_in_several_documents(seed: int) -> None:
    env = NeedleSearchEnv()
    env.reset(seed=seed)
    task = env.task
    assert len({needle.doc_id for needle in task.needles}) == 2
    for needle in task.needles:
        document = task.corpus[needle.doc_id]
        assert needle.entity.name in document.title
        found = re.findall(FACT_PATTERNS[needle.fact].format(name=re.escape(needle.entity.name)), document.text)
        assert found == [str(needle.value)]
        # The fact is past the first paragraph: the search snippet cannot give it away.
        hits = task.corpus.search(needle.entity.name, k=3)
        assert needle.doc_id in [hit.doc_id for hit in hits]
        assert str(needle.value) not in next(hit.snippet for hit in hits if hit.doc_id == needle.doc_id)
        # No other document states this entity's fact.
        others = [d.text for d in task.corpus if d.id != needle.doc_id]
        pattern = FACT_PATTERNS[needle.fact].format(name=re.escape(needle.entity.name))
        assert not any(re.search(pattern, text) for text in others)
    values = [needle.value for needle in task.needles]
    expected = {
        "founding_to_birth": values[1] - values[0],
        "total_population": sum(values),
        "founding_span": max(values) - min(values),
    }[task.kind]
    assert task.answer == expected and task.answer > 0


def test_every_search_lists_the_document_the_script_opens_next() -> None:
    env = NeedleSearchEnv(needles=3, target_tokens=6144)
    for seed in range(4):
        trajectory = run_episode(env, ScriptedPolicy(env), seed=seed)
        segments = trajectory.segments
        for needle in env.task.needles:
            opened = next(
                i for i, s in enumerate(segments) if s.role == "assistant" and f'"doc_id": "{needle.doc_id}"' in s.text
            )
            assert needle.doc_id in segments[opened - 1].text  # the search results just before
        assert len(env.task.needles) == 3 and env.task.kind in ("total_population", "founding_span")


def test_corpus_and_question_are_deterministic_by_seed() -> None:
    env = NeedleSearchEnv()
    first, _ = env.reset(seed=11)
    documents = [(d.id, d.title, d.text) for d in env.task.corpus]
    again, _ = env.reset(seed=11)
    np.testing.assert_array_equal(first, again)
    assert [(d.id, d.title, d.text) for d in env.task.corpus] == documents
    assert len(documents) == 24 and len({title for _, title, _ in documents}) == 24


def test_wrong_answers_score_zero() -> None:
    env = NeedleSearchEnv()
    env.reset(seed=0)
    assert env.score(env.task, str(env.task.answer + 1)) == 0.0
    assert env.score(env.task, str(env.task.answer)) == 1.0


def test_budgets_follow_the_target_unless_given() -> None:
    config = NeedleSearchConfig(target_tokens=32_768, needles=3)
    assert config.max_tokens == 2 * 32_768 + 4096 and config.max_turns == 10
    assert NeedleSearchConfig(target_tokens=32_768, max_tokens=40_000).max_tokens == 40_000
    with pytest.raises(ValidationError, match="too small for 6 needles"):
        NeedleSearchConfig(needles=6)
    with pytest.raises(ValidationError, match="num_documents"):
        NeedleSearchConfig(needles=4, num_documents=4, target_tokens=8192)


def test_every_question_kind_appears_with_places_and_people() -> None:
    env = NeedleSearchEnv()
    kinds, entity_types = set(), set()
    for seed in range(20):
        env.reset(seed=seed)
        kinds.add(env.task.kind)
        entity_types |= {type(needle.entity) for needle in env.task.needles}
    assert kinds == {"founding_to_birth", "total_population", "founding_span"}
    assert entity_types == {Place, Person}
