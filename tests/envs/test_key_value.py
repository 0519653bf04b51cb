"""``LongStraw/KeyValueRecall-v0`` (envs/key_value.py): the prompt holds the facts, the answer repeats one value.

The Gymnasium contract (check_env, determinism by seed, the scripted oracle) is checked for every registered env
in tests/envs/test_base.py; these tests cover what is particular to this one."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest
from pydantic import ValidationError

from longstraw_agents.envs import (
    FormatOnlyPolicy,
    KeyValueRecallConfig,
    KeyValueRecallEnv,
    ScriptedPolicy,
    run_episode,
)
from longstraw_agents.envs.key_value import word_pools

ENV_ID = "LongStraw/KeyValueRecall-v0"
SETTINGS = [
    {"num_facts": 1},
    {"num_facts": 4, "value_tokens": 3},
    {"num_facts": 16, "prompt_tokens": 1024},
]


def contains(haystack: np.ndarray, needle: np.ndarray) -> int:
    """How many times ``needle`` occurs in ``haystack`` as a contiguous run."""
    n = len(needle)
    return sum(np.array_equal(haystack[i : i + n], needle) for i in range(len(haystack) - n + 1))


@pytest.mark.parametrize("kwargs", SETTINGS)
def test_the_oracle_repeats_the_value_tokens_of_the_prompt_and_scores_one(kwargs) -> None:
    env = gymnasium.make(ENV_ID, **kwargs)
    tokenizer = env.unwrapped.tokenizer
    for seed in range(4):
        trajectory = run_episode(env, ScriptedPolicy(env), seed=seed)
        task = env.unwrapped.task
        assert trajectory.reward == 1.0 and trajectory.finish_reason == "answered"
        prompt = np.concatenate([s.token_ids for s in trajectory if s.role != "assistant"])
        value = np.array(tokenizer.encode(task.facts[task.asked][1]))
        assert len(value) == env.unwrapped.config.value_tokens  # one token per word
        answer = trajectory.segments[-1].token_ids
        assert contains(answer, value) == 1 and contains(prompt, value) >= 1
        key_line = np.array(tokenizer.encode(f"{task.key} ={task.facts[task.asked][1]}"))
        assert contains(prompt, key_line) == 1  # the asked fact, stated once, tokenized as on its own


def test_the_format_only_policy_answers_alike_with_a_value_the_prompt_does_not_hold() -> None:
    env = gymnasium.make(ENV_ID, num_facts=8, value_tokens=2)
    for seed in range(6):
        oracle = run_episode(env, ScriptedPolicy(env), seed=seed)
        decoy = run_episode(env, FormatOnlyPolicy(env), seed=seed)
        task = env.unwrapped.task
        assert decoy.reward == 0.0 and decoy.finish_reason == "answered"
        assert task.decoy not in {value.strip() for _, value in task.facts}
        assert f" {task.decoy}" not in decoy.segments[1].text  # the user message
        assert len(decoy.segments[-1]) == len(oracle.segments[-1])  # the same format, token for token
    with pytest.raises(TypeError, match="KeyValueRecallEnv"):
        FormatOnlyPolicy(gymnasium.make("LongStraw/Calculator-v0"))


@pytest.mark.parametrize(
    ("answer", "reward"),
    [("{value}", 1.0), ("  {value} ", 1.0), ("{other}", 0.0), ("{value} {value}", 0.0), ("", 0.0)],
)
def test_only_exactly_the_asked_value_scores(answer: str, reward: float) -> None:
    env = KeyValueRecallEnv(num_facts=4, value_tokens=2)
    env.reset(seed=3)
    task = env.task
    other = next(value.strip() for _, value in task.facts if value.strip() != task.answer)
    assert env.score(task, answer.format(value=task.answer, other=other)) == reward


def test_prompt_tokens_pads_the_user_message_with_filler() -> None:
    pools = word_pools(KeyValueRecallEnv().tokenizer)
    assert not set(pools.keys) & set(pools.values) and not set(pools.values) & set(pools.filler)
    for target in (0, 256, 2048):
        env = KeyValueRecallEnv(num_facts=6, prompt_tokens=target)
        _, info = env.reset(seed=target)
        user = next(s for s in env.trajectory if s.role == "user")
        facts_only = len(env.tokenizer.encode(env.user_prompt(type(env.task)(env.task.facts, 0, (), ""))))
        assert max(target, facts_only) <= len(user) <= max(target, facts_only) + 32  # within one filler line
        assert all(f"{key} =" in info["text"] for key, _ in env.task.facts)
        assert len({key for key, _ in env.task.facts}) == 6


def test_the_task_is_deterministic_by_seed_and_the_asked_fact_varies() -> None:
    env = KeyValueRecallEnv(num_facts=8, prompt_tokens=200)
    first, _ = env.reset(seed=5)
    task = env.task
    again, _ = env.reset(seed=5)
    np.testing.assert_array_equal(first, again)
    assert env.task == task
    asked = {env.reset(seed=seed) and env.task.asked for seed in range(20)}
    assert len(asked) > 3


def test_the_config_is_validated() -> None:
    with pytest.raises(ValidationError, match="num_facts"):
        KeyValueRecallConfig(num_facts=0)
    with pytest.raises(ValidationError, match="value_tokens"):
        KeyValueRecallConfig(value_tokens=0)
    with pytest.raises(ValidationError, match="prompt_tokens"):
        KeyValueRecallConfig(prompt_tokens=-1)
    assert KeyValueRecallConfig(prompt_tokens=8192).max_tokens == 8192 + 1024
    assert KeyValueRecallConfig(prompt_tokens=8192, max_tokens=9000).max_tokens == 9000
    env = KeyValueRecallEnv(num_facts=1000)
    with pytest.raises(ValueError, match="num_facts=1000 exceeds"):
        env.reset(seed=0)
