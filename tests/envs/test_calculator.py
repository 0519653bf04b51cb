"""``LongStraw/Calculator-v0`` (envs/calculator.py) and answer parsing (envs/answers.py)."""

from __future__ import annotations

from fractions import Fraction

import gymnasium
import numpy as np
import pytest
from pydantic import ValidationError

from longstraw_agents.envs import EASY_CALCULATOR_KWARGS, CalculatorEnv, ScriptedPolicy, run_episode
from longstraw_agents.envs.answers import find_answer, single_number
from longstraw_agents.envs.calculator import CalculatorConfig, make_problem
from longstraw_agents.tools import evaluate


@pytest.mark.parametrize(
    "kwargs",
    [EASY_CALCULATOR_KWARGS, {}, {"num_operations": 6, "min_operand": 1, "max_operand": 99}],
)
def test_problems_are_integral_and_their_expression_gives_the_answer(kwargs) -> None:
    config = CalculatorConfig(**kwargs)
    for seed in range(40):
        problem = make_problem(np.random.default_rng(seed), config)
        assert isinstance(problem.answer, int) and problem.answer >= 0
        assert evaluate(problem.expression) == problem.answer
        assert problem.expression.count(" ") == 2 * config.num_operations  # one operator per operation
        operands = [int(token.strip("()")) for token in problem.expression.split()[::2]]
        assert all(config.min_operand <= operand <= config.max_operand for operand in operands)


def test_the_easy_setting_is_short() -> None:
    env = gymnasium.make("LongStraw/Calculator-v0", **EASY_CALCULATOR_KWARGS)
    trajectory = run_episode(env, ScriptedPolicy(env), seed=3)
    question = env.unwrapped.task.question
    assert question.startswith("What is ") and len(question.split()) == 5  # "What is 7 + 5?"
    actions = [segment for segment in trajectory if segment.role == "assistant"]
    assert len(actions) == 2 and sum(len(a) for a in actions) <= 32
    assert "calculator" in actions[0].text and actions[1].text.startswith("<answer>")
    assert trajectory.num_tokens < 450 and trajectory.reward == 1.0


def test_word_problems_tell_the_chain_as_a_story() -> None:
    env = CalculatorEnv(num_operations=3)
    env.reset(seed=2)
    question = env.task.question
    assert question.endswith("have now?") and question.count("Then ") == 2
    assert all(str(n) in question for n in (int(t.strip("()")) for t in env.task.expression.split()[::2]))


@pytest.mark.parametrize(
    ("answer", "reward"),
    [("40", 1.0), ("40.0", 1.0), (" 40 marbles", 1.0), ("39", 0.0), ("40 or 41", 0.0), ("forty", 0.0), ("", 0.0)],
)
def test_score_needs_exactly_the_right_number(answer: str, reward: float) -> None:
    env = CalculatorEnv(**EASY_CALCULATOR_KWARGS)
    env.reset(seed=0)
    assert env.task.answer == 40  # seed 0: "What is 8 * 5?"
    assert env.score(env.task, answer) == reward


def test_single_number_and_find_answer() -> None:
    assert single_number("12,345 people") == 12345
    assert single_number("-3.5") == Fraction(-7, 2)
    assert single_number("1 and 2") is None and single_number("none") is None
    assert single_number("x2") is None  # part of a word, not a number
    assert find_answer("a <answer> 7 </answer> b <answer>8</answer>").answer == "7"
    parsed = find_answer("<answer>7")
    assert parsed.answer is None and parsed.unclosed


def test_operand_range_is_validated() -> None:
    with pytest.raises(ValidationError, match="min_operand"):
        CalculatorConfig(min_operand=10, max_operand=5)
    with pytest.raises(ValidationError, match="num_operations"):
        CalculatorConfig(num_operations=0)
