"""The ``calculator`` tool (tools/arithmetic.py): AST arithmetic with bounded results."""

from __future__ import annotations

import time

import pytest

from longstraw_agents.tools import CalculatorError, calculator, evaluate
from longstraw_agents.tools.arithmetic import MAX_EXPRESSION_CHARS, format_number


@pytest.mark.parametrize(
    ("expression", "shown"),
    [
        ("2+3", "5"),
        ("(12 + 30) * 3 / 7", "18"),
        ("7 // 2", "3"),
        ("-7 % 3", "2"),
        ("2 ** 10", "1024"),
        ("2 ** -1", "0.5"),
        ("-(3 - 5) * +2", "4"),
        ("0.1 + 0.2", "0.3"),
        ("1 / 3", "0.333333333333333"),
        ("sqrt(16) + abs(-2)", "6"),
        ("round(2.675, 2)", "2.67"),
        ("round(7.5)", "8"),
        ("min(4, 2, 8) + max(1, 9)", "11"),
        ("floor(2.7) + ceil(2.1)", "5"),
        ("log(e) + log10(1000) + log2(8) + log(8, 2)", "10"),
        ("factorial(20)", "2432902008176640000"),
        ("2 * pi", "6.28318530717959"),
        ("1e20 * 3", "3e+20"),
        ("  12_000 * 2  ", "24000"),
        ("2 ** 1000 // 2 ** 999", "2"),
    ],
)
def test_values(expression: str, shown: str) -> None:
    result = calculator.invoke({"expression": expression})
    assert result.ok, result.content
    assert result.content == shown


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("2 ^ 3", "write ** for powers"),
        ("1,000 + 1", "a comma outside a function call"),
        ("x + 1", "unknown name 'x'"),
        ("__import__('os')", "unknown function '__import__'"),
        ("__import__('os').system('true')", "unknown function \"__import__('os').system\""),
        ("(1).real", "attribute access"),
        ("[1, 2][0]", "unsupported syntax"),
        ("3 < 4", "comparisons are not arithmetic"),
        ("'a' * 3", "unsupported literal 'a'"),
        ("True + 1", "unsupported literal True"),
        ("1j * 2", "unsupported literal 1j"),
        ("sqrt(-1)", "math domain error"),
        ("(-8) ** (1 / 3)", "no real result"),
        ("max()", "max expected at least 1 argument"),
        ("round(1.5, ndigits=1)", "plain positional arguments"),
        ("2 +", "invalid syntax"),
        ("1if 2 else 3", "invalid decimal literal"),  # a SyntaxWarning in Python: refused, nothing printed
        ("", "expression is empty"),
        ("1 +\x00 2", "invalid"),
    ],
)
def test_errors(expression: str, message: str) -> None:
    result = calculator.invoke({"expression": expression})
    assert (result.ok, result.error) == (False, "exception")
    assert result.content.startswith("Error: ") and message in result.content


@pytest.mark.parametrize(
    "expression",
    [
        "9**9**9**9",
        "10 ** 10 ** 10",
        "(2 ** 1000) ** 2",
        "2 ** 1024",
        "factorial(10 ** 6)",
        "factorial(171)",
        "round(5, -10 ** 9)",
        "exp(10 ** 6)",
        "1e308 * 10",
        "2.0 ** 10 ** 9",
        "(10 ** 300) * (10 ** 300)",
        "-" * 500 + "1",
        "abs(" * 150 + "1" + ")" * 150,
        "(" * 300 + "1" + ")" * 300,
    ],
)
def test_explosive_expressions_fail_fast(expression: str) -> None:
    """Refused before computing: about a millisecond of CPU (this process's CPU time, which other work on the
    machine does not stretch; the bound is hundreds of times that)."""
    start = time.process_time()
    with pytest.raises(CalculatorError):
        evaluate(expression)
    assert time.process_time() - start < 0.5


def test_length_limit() -> None:
    with pytest.raises(CalculatorError, match="characters long"):
        evaluate("1+" * MAX_EXPRESSION_CHARS + "1")


def test_evaluate_keeps_exact_integers() -> None:
    assert evaluate("2 ** 100") == 2**100
    assert isinstance(evaluate("6 / 3"), float)


@pytest.mark.parametrize(
    ("value", "shown"),
    [(5, "5"), (5.0, "5"), (-0.5, "-0.5"), (1e16, "1e+16"), (2.5e-7, "2.5e-07"), (10**20, str(10**20))],
)
def test_format_number(value: float, shown: str) -> None:
    assert format_number(value) == shown


def test_never_uses_eval(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    def forbidden(*args: object) -> None:
        raise AssertionError("eval/exec must not be used")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    assert calculator.invoke({"expression": "3 * (4 + 5)"}).content == "27"
