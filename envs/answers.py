"""Reading what an agent answered: the ``<answer>…</answer>`` block of a turn, and numbers inside it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"

_ANSWER = re.compile(re.escape(ANSWER_OPEN) + r"(?P<body>.*?)" + re.escape(ANSWER_CLOSE), re.DOTALL)
# A number as people write it: optional sign, digits with optional thousands separators, optional decimals.
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\w])")


@dataclass(frozen=True)
class AnswerParse:
    """The outcome of looking for an answer in one assistant turn."""

    answer: str | None
    """The text inside the first complete ``<answer>…</answer>`` block, stripped; None when there is none."""
    unclosed: bool = False
    """True when the turn opens ``<answer>`` but never closes it (a hint worth giving the policy)."""


def find_answer(text: str) -> AnswerParse:
    """The first ``<answer>…</answer>`` block of ``text``."""
    match = _ANSWER.search(text)
    if match:
        return AnswerParse(match["body"].strip())
    return AnswerParse(None, unclosed=ANSWER_OPEN in text)


def single_number(text: str) -> Fraction | None:
    """The one number written in ``text`` (``"12"``, ``"-3.5"``, ``"12,345 people"``), exactly; None when ``text``
    holds no number or several (so an answer cannot hedge by listing candidates)."""
    found = _NUMBER.findall(text)
    if len(found) != 1:
        return None
    try:
        return Fraction(found[0].replace(",", ""))
    except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits): not a usable answer
        return None


def number_matches(answer: str, expected: int | Fraction) -> bool:
    value = single_number(answer)
    return value is not None and value == expected
