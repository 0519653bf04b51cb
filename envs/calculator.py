"""``LongStraw/Calculator-v0``: arithmetic word problems solved with the ``calculator`` tool.

A problem is a chain of ``num_operations`` operations (+, -, *, /) on operands drawn from
``[min_operand, max_operand]``; every intermediate value is a non-negative integer (subtraction never goes below
zero, division is exact). With ``word_problems`` the chain is told as a story ("Mara has 34 marbles. She finds 12
more. ..."), otherwise asked as an expression ("What is 7 + 5?"). The easiest setting, `EASY_CALCULATOR_KWARGS`
("What is 7 + 5?"), is the one the CPU demo trains a tiny model on; its scripted trace is two short turns: one
calculator call, then the answer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from longstraw_agents.tools import Tool, calculator, format_tool_call

from .answers import number_matches
from .base import ToolEnv, ToolEnvConfig

Operator = Literal["+", "-", "*", "/"]
OPERATORS: tuple[Operator, ...] = ("+", "-", "*", "/")
_PRECEDENCE: dict[str, int] = {"+": 1, "-": 1, "*": 2, "/": 2}

EASY_CALCULATOR_KWARGS: dict[str, Any] = {
    "num_operations": 1,
    "min_operand": 1,
    "max_operand": 9,
    "word_problems": False,
}
"""The easiest setting: one operation on single-digit operands, asked as an expression ("What is 7 + 5?")."""

# (name, subject pronoun, object pronoun)
_PEOPLE = (
    ("Mara", "She", "her"),
    ("Tobias", "He", "him"),
    ("Ines", "She", "her"),
    ("Kofi", "He", "him"),
    ("Lena", "She", "her"),
    ("Ravi", "He", "him"),
    ("Yuki", "She", "her"),
    ("Omar", "He", "him"),
)
_ITEMS = ("marbles", "apples", "stamps", "coins", "pencils", "shells", "cards", "beads", "books", "plums")
# One sentence per operation; {n} is the operand, {x} the item, {p} / {p_obj} the pronouns.
_STORY_STEPS: dict[Operator, tuple[str, ...]] = {
    "+": ("{p} finds {n} more.", "A friend gives {p_obj} {n} more {x}.", "{p} buys {n} more {x}."),
    "-": ("{p} gives {n} of them away.", "{p} loses {n} {x}.", "{p} sells {n} {x}."),
    "*": ("{p} multiplies the number of {x} by {n}.", "{p} trades them for {n} times as many {x}."),
    "/": ("{p} shares them equally among {n} bags and keeps one bag.", "{p} keeps only one in every {n} {x}."),
}


CALCULATOR = dataclasses.replace(
    calculator, description="Evaluate an arithmetic expression (+ - * / ** and parentheses)."
)
"""The calculator with a one-line description: the prompt of the easiest setting stays short for the CPU demo."""


class CalculatorConfig(ToolEnvConfig):
    num_operations: int = Field(default=2, ge=1, le=8, description="Operations per problem (1: 'What is 7 + 5?').")
    min_operand: int = Field(default=2, ge=1, description="Smallest operand.")
    max_operand: int = Field(default=50, ge=1, description="Largest operand.")
    word_problems: bool = Field(
        default=True, description="Tell the problem as a story instead of asking an expression."
    )
    max_turns: int = Field(default=4, ge=1, description="Assistant turns per episode.")
    max_tokens: int = Field(default=2048, ge=1, description="Token budget of the whole episode.")

    @model_validator(mode="after")
    def _operand_range(self) -> CalculatorConfig:
        if self.min_operand > self.max_operand:
            raise ValueError(f"min_operand ({self.min_operand}) must not exceed max_operand ({self.max_operand})")
        return self


@dataclass(frozen=True)
class ArithmeticProblem:
    question: str
    expression: str
    """The problem as a calculator expression, e.g. ``(34 + 12) * 3``."""
    answer: int


class CalculatorEnv(ToolEnv[ArithmeticProblem]):
    """Arithmetic (word) problems; reward 1 when the answer holds exactly the right number, else 0."""

    config_class = CalculatorConfig
    config: CalculatorConfig
    instructions: ClassVar[str] = "Solve the arithmetic problem. Use the calculator tool to compute."

    def make_task(self, rng: np.random.Generator) -> ArithmeticProblem:
        return make_problem(rng, self.config)

    def tools(self, task: ArithmeticProblem) -> list[Tool]:
        return [CALCULATOR]

    def user_prompt(self, task: ArithmeticProblem) -> str:
        return task.question

    def score(self, task: ArithmeticProblem, answer: str) -> float:
        return float(number_matches(answer, task.answer))

    def scripted_turns(self, task: ArithmeticProblem) -> list[str]:
        return [format_tool_call("calculator", {"expression": task.expression}), f"<answer>{task.answer}</answer>"]


def make_problem(rng: np.random.Generator, config: CalculatorConfig) -> ArithmeticProblem:
    """A random chain of operations; the expression is parenthesised to evaluate left to right."""
    start = value = _operand(rng, config)
    expression, last_operator = str(value), None
    steps: list[tuple[Operator, int]] = []
    for _ in range(config.num_operations):
        operator, operand = _next_operation(rng, config, value)
        steps.append((operator, operand))
        if last_operator is not None and _PRECEDENCE[last_operator] < _PRECEDENCE[operator]:
            expression = f"({expression})"
        expression = f"{expression} {operator} {operand}"
        value = _apply(value, operator, operand)
        last_operator = operator
    question = _story(rng, start, steps) if config.word_problems else f"What is {expression}?"
    return ArithmeticProblem(question=question, expression=expression, answer=value)


def _operand(rng: np.random.Generator, config: CalculatorConfig) -> int:
    return int(rng.integers(config.min_operand, config.max_operand + 1))


def _next_operation(rng: np.random.Generator, config: CalculatorConfig, value: int) -> tuple[Operator, int]:
    """An operator and operand that keep the running value a non-negative integer."""
    while True:
        operator = OPERATORS[int(rng.integers(len(OPERATORS)))]
        if operator == "/":
            divisors = [d for d in range(max(2, config.min_operand), config.max_operand + 1) if value % d == 0]
            if divisors:
                return operator, divisors[int(rng.integers(len(divisors)))]
            continue
        operand = _operand(rng, config)
        if operator == "-" and operand > value:
            continue
        return operator, operand


def _apply(value: int, operator: Operator, operand: int) -> int:
    if operator == "+":
        return value + operand
    if operator == "-":
        return value - operand
    if operator == "*":
        return value * operand
    return value // operand


def _story(rng: np.random.Generator, start: int, steps: list[tuple[Operator, int]]) -> str:
    name, pronoun, pronoun_obj = _PEOPLE[int(rng.integers(len(_PEOPLE)))]
    item = _ITEMS[int(rng.integers(len(_ITEMS)))]
    sentences = [f"{name} has {start} {item}."]
    for i, (operator, operand) in enumerate(steps):
        templates = _STORY_STEPS[operator]
        template = templates[int(rng.integers(len(templates)))]
        text = template.format(n=operand, x=item, p=pronoun, p_obj=pronoun_obj)
        sentences.append(text if i == 0 else f"Then {text[0].lower()}{text[1:]}")
    sentences.append(f"How many {item} does {name} have now?")
    return " ".join(sentences)
