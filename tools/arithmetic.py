"""The ``calculator`` tool: arithmetic evaluated over Python's AST, never with ``eval``.

Accepted: int and float literals, ``+ - * / // % **``, unary ``+``/``-``, parentheses, the constants ``pi`` and
``e`` and the functions in `FUNCTIONS`. Everything else (names, attributes, comparisons, strings, ``^``…) is an
error that names the construct. Every intermediate result is bounded (`MAX_RESULT_BITS` for integers, finite for
floats) and powers are checked *before* they are computed, so ``9**9**9**9`` or ``factorial(10**6)`` fail at once
instead of hanging the environment.
"""

from __future__ import annotations

import ast
import math
import operator
import warnings
from collections.abc import Callable
from typing import Any

from .function import tool
from .result import ToolFailure

MAX_EXPRESSION_CHARS = 1_000
MAX_NESTING = 100
"""Deepest AST a calculator expression may have; real ones are a few levels deep."""
MAX_RESULT_BITS = 1_024
"""Integers stay below 2**1024 (about 1.8e308, the float range): enough for any word problem, cheap to compute."""
MAX_FACTORIAL = 170
"""170! is the largest factorial below 2**1024."""
MAX_ROUND_DIGITS = 100

Number = int | float


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message says why."""


def _factorial(n: Number) -> int:
    if isinstance(n, float):
        if not n.is_integer():
            raise CalculatorError(f"factorial needs a whole number, got {n}")
        n = int(n)
    if not 0 <= n <= MAX_FACTORIAL:
        raise CalculatorError(f"factorial is defined here for 0 <= n <= {MAX_FACTORIAL}, got {n}")
    return math.factorial(n)


def _round(x: Number, ndigits: Number | None = None) -> Number:
    if ndigits is None:
        return round(x)
    if not isinstance(ndigits, int) or abs(ndigits) > MAX_ROUND_DIGITS:
        raise CalculatorError(f"round's digits must be a whole number in [-{MAX_ROUND_DIGITS}, {MAX_ROUND_DIGITS}]")
    return round(x, ndigits)


def _log(x: Number, base: Number | None = None) -> float:
    return math.log(x) if base is None else math.log(x, base)


FUNCTIONS: dict[str, Callable[..., Number]] = {
    "abs": abs,
    "round": _round,
    "min": min,
    "max": max,
    "sqrt": math.sqrt,
    "floor": math.floor,
    "ceil": math.ceil,
    "exp": math.exp,
    "log": _log,
    "log2": math.log2,
    "log10": math.log10,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "factorial": _factorial,
}
CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e}

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_UNSUPPORTED_HINTS: dict[type[ast.AST], str] = {
    ast.BitXor: "'^' is bitwise xor, not a power: write ** for powers",
    ast.Compare: "comparisons are not arithmetic",
    ast.Tuple: "a comma outside a function call (write 1000, not 1,000)",
    ast.Attribute: "attribute access",
    ast.Subscript: "indexing",
    ast.Lambda: "lambda",
}


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression, or a `CalculatorError` saying what is wrong with it."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression is {len(expression)} characters long; the limit is {MAX_EXPRESSION_CHARS}")
    text = expression.strip()
    if not text:
        raise CalculatorError("expression is empty")
    try:
        with warnings.catch_warnings():  # "1if 2 else 3" parses with a SyntaxWarning printed to stderr: refuse it
            warnings.simplefilter("error", SyntaxWarning)
            tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        where = f" at column {exc.offset}" if exc.offset else ""
        raise CalculatorError(f"invalid syntax{where}: {exc.msg}") from None
    except ValueError as exc:  # null bytes and the like, before tokenizing
        raise CalculatorError(f"invalid expression: {exc}") from None
    except (RecursionError, MemoryError):
        raise CalculatorError("expression is nested too deeply") from None
    return _evaluate(tree.body, depth=0)


def _evaluate(node: ast.AST, depth: int) -> Number:
    if depth > MAX_NESTING:
        raise CalculatorError(f"expression is nested more than {MAX_NESTING} levels deep")
    if isinstance(node, ast.Constant):
        return _literal(node.value)
    if isinstance(node, ast.Name):
        if node.id not in CONSTANTS:
            raise CalculatorError(f"unknown name {node.id!r}; known constants: {', '.join(CONSTANTS)}")
        return CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_evaluate(node.operand, depth + 1)))
    if isinstance(node, ast.BinOp) and (type(node.op) in _BINARY or isinstance(node.op, ast.Pow)):
        left, right = _evaluate(node.left, depth + 1), _evaluate(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        return _apply(_BINARY[type(node.op)], left, right)
    if isinstance(node, ast.Call):
        return _call(node, depth)
    construct = node.op if isinstance(node, ast.BinOp | ast.UnaryOp) else node
    hint = _UNSUPPORTED_HINTS.get(type(construct), type(construct).__name__)
    raise CalculatorError(f"unsupported syntax: {hint}")


def _literal(value: Any) -> Number:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CalculatorError(f"unsupported literal {value!r}: only int and float numbers")
    return _bounded(value)


def _call(node: ast.Call, depth: int) -> Number:
    if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
        name = node.func.id if isinstance(node.func, ast.Name) else ast.unparse(node.func)[:40]
        raise CalculatorError(f"unknown function {name!r}; available: {', '.join(FUNCTIONS)}")
    if node.keywords or any(isinstance(arg, ast.Starred) for arg in node.args):
        raise CalculatorError(f"{node.func.id}() takes plain positional arguments only")
    args = [_evaluate(arg, depth + 1) for arg in node.args]
    return _apply(FUNCTIONS[node.func.id], *args, name=node.func.id)


def _power(base: Number, exponent: Number) -> Number:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        # the result has at least (bit_length - 1) * exponent bits: refuse before computing it
        if (abs(base).bit_length() - 1) * exponent > MAX_RESULT_BITS:
            raise CalculatorError(f"result too large: {base} ** {exponent} exceeds 2**{MAX_RESULT_BITS}")
    return _apply(operator.pow, base, exponent)


def _apply(fn: Callable[..., Any], *args: Number, name: str | None = None) -> Number:
    try:
        result = fn(*args)
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError:
        raise CalculatorError("result too large") from None
    except CalculatorError:
        raise
    except (TypeError, ValueError) as exc:
        raise CalculatorError(f"{name}(): {exc}" if name else str(exc)) from None
    return _bounded(result)


def _bounded(value: Any) -> Number:
    if isinstance(value, complex):
        raise CalculatorError("no real result (a negative number to a fractional power)")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CalculatorError(f"unexpected result {value!r}")
    if isinstance(value, int) and value.bit_length() > MAX_RESULT_BITS:
        raise CalculatorError(f"result too large: exceeds 2**{MAX_RESULT_BITS}")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result too large" if math.isinf(value) else "result is not a number")
    return value


def format_number(value: Number) -> str:
    """Integers exactly; floats to 15 significant digits (``0.1 + 0.2`` shows as ``0.3``, ``10 / 2`` as ``5``)."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.15g}"


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Supports numbers, + - * / // % ** and parentheses, the constants pi and e, and the functions abs, round, min,
    max, sqrt, floor, ceil, exp, log, log2, log10, sin, cos, tan and factorial.

    Args:
        expression: The expression to evaluate, for example "(12 + 30) * 3 / 7" or "sqrt(2) ** 2".
    """
    try:
        return format_number(evaluate(expression))
    except CalculatorError as exc:
        raise ToolFailure(str(exc)) from None
