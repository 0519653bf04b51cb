"""The programming problems of ``LongStraw/PythonTask-v0``: small functions with hidden tests, drawn from a seed.

Each family is a function of the random generator that fixes the problem's parameters (a multiplier, a base, a
shift, two divisors and their words…) and writes a reference solution for them. Test inputs come from the family's
edge cases and its random input generator; the expected outputs come from running the reference solution here,
in this process (it is this module's own code), so they cannot disagree with the solution the oracle submits.
Expected values are kept as canonical JSON (``json.dumps(value, sort_keys=True)``), which is also how the hidden
tests compare what a submitted function returns: ``True`` does not pass for ``1``, nor ``2.0`` for ``2``.
"""

from __future__ import annotations

import copy
import json
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

Args = list[Any]


@dataclass(frozen=True)
class _Family:
    function: str
    signature: str
    description: str
    reference: str
    random_args: Callable[[np.random.Generator], Args]
    edge_cases: tuple[Args, ...] = ()


@dataclass(frozen=True)
class PythonProblem:
    family: str
    function: str
    signature: str
    """The ``def`` line, e.g. ``def rotate_left(xs: list[int], k: int) -> list[int]:``."""
    description: str
    reference: str
    """A correct solution: the source of the whole function."""
    example_args: Args
    example_result: Any
    cases: tuple[Args, ...]
    """The hidden tests' arguments."""
    expected: tuple[str, ...]
    """The hidden tests' expected results, as canonical JSON."""


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _int_list(rng: np.random.Generator, low: int = -50, high: int = 50, max_len: int = 8) -> list[int]:
    return rng.integers(low, high + 1, size=int(rng.integers(0, max_len + 1))).tolist()


def _text(rng: np.random.Generator, alphabet: str, max_len: int = 16) -> str:
    return "".join(alphabet[i] for i in rng.integers(len(alphabet), size=int(rng.integers(0, max_len + 1))))


def _signed(value: int) -> str:
    return f"+ {value}" if value >= 0 else f"- {-value}"


def _affine_map(rng: np.random.Generator) -> _Family:
    a, b = int(rng.integers(2, 10)), int(rng.integers(-9, 10))
    return _Family(
        function="affine_map",
        signature="def affine_map(xs: list[int]) -> list[int]:",
        description=f"returns a new list in which every element x of xs is replaced by {a} * x {_signed(b)}",
        reference=f"def affine_map(xs: list[int]) -> list[int]:\n    return [{a} * x {_signed(b)} for x in xs]\n",
        random_args=lambda g: [_int_list(g)],
        edge_cases=([[]],),
    )


def _count_divisible(rng: np.random.Generator) -> _Family:
    k = int(rng.integers(2, 10))
    return _Family(
        function="count_divisible",
        signature="def count_divisible(xs: list[int]) -> int:",
        description=f"returns how many elements of xs are divisible by {k} (negative numbers and 0 included)",
        reference=(f"def count_divisible(xs: list[int]) -> int:\n    return sum(1 for x in xs if x % {k} == 0)\n"),
        random_args=lambda g: [_int_list(g)],
        edge_cases=([[]], [[0, -k, k + 1]]),
    )


def _caesar_shift(rng: np.random.Generator) -> _Family:
    k = int(rng.integers(1, 26))
    return _Family(
        function="caesar_shift",
        signature="def caesar_shift(text: str) -> str:",
        description=(
            f"returns text with every lowercase letter a-z moved {k} places forward in the alphabet, wrapping "
            "around from z to a; every other character stays as it is"
        ),
        reference=(
            "def caesar_shift(text: str) -> str:\n"
            f'    return "".join(chr((ord(c) - 97 + {k}) % 26 + 97) if "a" <= c <= "z" else c for c in text)\n'
        ),
        random_args=lambda g: [_text(g, string.ascii_lowercase + "XYZ .,!")],
        edge_cases=([""], ["xyz abc"]),
    )


def _rotate_left(rng: np.random.Generator) -> _Family:
    return _Family(
        function="rotate_left",
        signature="def rotate_left(xs: list[int], k: int) -> list[int]:",
        description=("returns xs rotated left by k positions (k >= 0 may exceed len(xs)); an empty list stays empty"),
        reference=(
            "def rotate_left(xs: list[int], k: int) -> list[int]:\n"
            "    if not xs:\n"
            "        return []\n"
            "    k %= len(xs)\n"
            "    return xs[k:] + xs[:k]\n"
        ),
        random_args=lambda g: [_int_list(g, 0, 9), int(g.integers(0, 13))],
        edge_cases=([[], 3], [[1, 2, 3], 7]),
    )


def _digit_sum(rng: np.random.Generator) -> _Family:
    base = int(rng.integers(2, 10))
    return _Family(
        function="digit_sum",
        signature="def digit_sum(n: int) -> int:",
        description=f"returns the sum of the digits of the non-negative integer n written in base {base}",
        reference=(
            "def digit_sum(n: int) -> int:\n"
            "    total = 0\n"
            "    while n:\n"
            f"        total += n % {base}\n"
            f"        n //= {base}\n"
            "    return total\n"
        ),
        random_args=lambda g: [int(g.integers(0, 1_000_000))],
        edge_cases=([0], [base**3]),
    )


_WORDS = ("Fizz", "Buzz", "Ping", "Pong", "Zap", "Bop", "Tick", "Tock")


def _label_number(rng: np.random.Generator) -> _Family:
    p, q = (int(v) for v in rng.choice(np.arange(2, 8), size=2, replace=False))
    first, second = (str(w) for w in rng.choice(_WORDS, size=2, replace=False))
    return _Family(
        function="label_number",
        signature="def label_number(n: int) -> str:",
        description=(
            f'returns "{first}" if n is divisible by {p}, "{second}" if it is divisible by {q}, '
            f'"{first}{second}" if it is divisible by both, and otherwise n as a decimal string'
        ),
        reference=(
            "def label_number(n: int) -> str:\n"
            '    word = ""\n'
            f"    if n % {p} == 0:\n"
            f'        word += "{first}"\n'
            f"    if n % {q} == 0:\n"
            f'        word += "{second}"\n'
            "    return word or str(n)\n"
        ),
        random_args=lambda g: [int(g.integers(1, 200))],
        edge_cases=([p * q], [1]),
    )


def _second_largest(rng: np.random.Generator) -> _Family:
    return _Family(
        function="second_largest",
        signature="def second_largest(xs: list[int]) -> int | None:",
        description="returns the second largest distinct value in xs, or None if xs has fewer than two distinct values",
        reference=(
            "def second_largest(xs: list[int]) -> int | None:\n"
            "    values = sorted(set(xs))\n"
            "    return values[-2] if len(values) >= 2 else None\n"
        ),
        random_args=lambda g: [_int_list(g, -9, 9)],
        edge_cases=([[]], [[4, 4, 4]], [[5, 5, 3]]),
    )


def _run_lengths(rng: np.random.Generator) -> _Family:
    return _Family(
        function="run_lengths",
        signature="def run_lengths(text: str) -> list[list]:",
        description=(
            "returns the runs of equal consecutive characters in text as a list of [character, count] pairs, "
            'in order (e.g. "aab" gives [["a", 2], ["b", 1]])'
        ),
        reference=(
            "def run_lengths(text: str) -> list[list]:\n"
            "    runs = []\n"
            "    for char in text:\n"
            "        if runs and runs[-1][0] == char:\n"
            "            runs[-1][1] += 1\n"
            "        else:\n"
            "            runs.append([char, 1])\n"
            "    return runs\n"
        ),
        random_args=lambda g: [_text(g, "aab c", max_len=12)],
        edge_cases=([""],),
    )


FAMILIES: dict[str, Callable[[np.random.Generator], _Family]] = {
    "affine_map": _affine_map,
    "count_divisible": _count_divisible,
    "caesar_shift": _caesar_shift,
    "rotate_left": _rotate_left,
    "digit_sum": _digit_sum,
    "label_number": _label_number,
    "second_largest": _second_largest,
    "run_lengths": _run_lengths,
}


def make_python_problem(rng: np.random.Generator, families: tuple[str, ...], num_tests: int) -> PythonProblem:
    """A problem from one of ``families`` with ``num_tests`` hidden tests (its edge cases first)."""
    name = families[int(rng.integers(len(families)))]
    family = FAMILIES[name](rng)
    cases = list(family.edge_cases[:num_tests])
    cases += [family.random_args(rng) for _ in range(num_tests - len(cases))]
    example = family.random_args(rng)
    solve = _compile(family)
    return PythonProblem(
        family=name,
        function=family.function,
        signature=family.signature,
        description=family.description,
        reference=family.reference,
        example_args=example,
        example_result=solve(*copy.deepcopy(example)),
        cases=tuple(cases),
        expected=tuple(canonical_json(solve(*copy.deepcopy(args))) for args in cases),
    )


def _compile(family: _Family) -> Callable[..., Any]:
    namespace: dict[str, Any] = {}
    exec(compile(family.reference, f"<reference {family.function}>", "exec"), namespace)  # our own source
    return namespace[family.function]
