"""``LongStraw/PageRecall-v0``: carry a code read on the first page through a long read to the end.

The agent reads ``pages`` pages one ``read_page`` call at a time (each about ``page_tokens`` tokens of filler),
then answers the code that page 1 states in one line (``The code is pac.``) among its filler. A call after the last
page says that none is left. Reward 1 for exactly the code once every page was read, else 0.

It is the long-horizon task for context policies: at the defaults a solving episode reads ~34K tokens, and under a
4K context budget with summary turns (`envs.context.SummaryTurn`) every page past the budget asks for a summary
that replaces the turns so far. After page 1 has left the context, the code exists only in the policy's own
summaries, so the reward depends on every summary the policy wrote carrying it: a summary that loses the code loses
the episode. The scripted solution's summary is the code's line itself.

The code is one word of `key_value.word_pools`' value pool that no text of the environment holds (``code_words``),
and the filler comes from its filler pool (single tokens, disjoint), so the code's token appears nowhere else in an
episode: in page 1's line, then only where the policy wrote it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from pydantic import Field, model_validator

from longstraw_agents.tools import Tool, ToolRegistry, format_tool_call, tool
from longstraw_agents.trajectory import Segment, Trajectory

from .answers import ANSWER_CLOSE, ANSWER_OPEN
from .base import Score, ToolEnv, ToolEnvConfig, system_prompt_with_tools
from .context import SummaryTurn
from .key_value import FILLER_WORDS_PER_LINE, word_pools

NO_PAGE_LEFT = "No pages left. Answer with the code."
TOKENS_PER_LINE = FILLER_WORDS_PER_LINE + 1
"""A filler line's tokens: its single-token words, then the full stop and the newline (one token)."""


def page_header(number: int, pages: int) -> str:
    """A page's first line; the last page's is how ``score`` knows every page was read."""
    return f"Page {number} of {pages}."


class PageRecallConfig(ToolEnvConfig):
    pages: int = Field(default=12, ge=1, le=4096, description="Pages to read; page 1 states the code.")
    page_tokens: int = Field(default=2800, ge=TOKENS_PER_LINE, description="About how many tokens a page holds.")
    codes: int | None = Field(
        default=None, ge=2, description="Draw the code from the first this many code words (None: all of them)."
    )
    scripted_keeps: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="Share of scripted episodes whose first summary reads page 1's code. The rest write a code "
        "drawn at random instead, which every later summary and the answer then carry: a warm start on such traces "
        "writes its first summary right only some of the time, and leaves GRPO that to learn.",
    )
    max_turns: int = Field(
        default=16,
        ge=1,
        description="Assistant turns per episode (default: the reads, one past the last page, the answer and as many "
        "summary turns as pages, plus 2).",
    )
    max_tokens: int = Field(
        default=40_960, ge=1, description="Token budget of the episode (default: pages * (page_tokens + 256) + 4096)."
    )

    @model_validator(mode="before")
    @classmethod
    def _budgets_follow_the_pages(cls, data: Any) -> Any:
        """Unless given, the budgets leave room for the scripted solution with a summary after every page."""
        if isinstance(data, dict):
            data = dict(data)
            pages, page_tokens = data.get("pages", 12), data.get("page_tokens", 2800)
            if isinstance(pages, int) and "max_turns" not in data:
                data["max_turns"] = 2 * pages + 4
            if isinstance(pages, int) and isinstance(page_tokens, int) and "max_tokens" not in data:
                data["max_tokens"] = pages * (page_tokens + 256) + 4096
        return data


@dataclass(frozen=True)
class PageRecallTask:
    code: str
    """The code with its leading space, as page 1 states it (``" pac"``)."""
    pages: tuple[str, ...]
    """Each page's text, header included."""
    scripted_guess: str | None = None
    """Set when the scripted solution misreads the code (``scripted_keeps``): the code word drawn at random that its
    summaries and answer carry instead, with its leading space."""

    @property
    def answer(self) -> str:
        return self.code.strip()

    @property
    def code_line(self) -> str:
        return f"The code is{self.code}."


def _page(rng: np.random.Generator, words: Sequence[str], number: int, pages: int, lines: int, code: str | None) -> str:
    """Page ``number`` of ``pages``: its header, then ``lines`` lines of filler ``words``, and the code's line at a
    random place among them when ``code`` is given."""
    drawn = rng.integers(len(words), size=(lines, FILLER_WORDS_PER_LINE))
    body = ["".join(words[i] for i in row) + "." for row in drawn]
    if code is not None:
        body.insert(int(rng.integers(lines + 1)), f"The code is{code}.")
    return "\n".join([page_header(number, pages), *body])


class PageRecallEnv(ToolEnv[PageRecallTask]):
    """Read every page, then answer the code stated on page 1; reward 1 for exactly that code, else 0."""

    config_class = PageRecallConfig
    config: PageRecallConfig
    _code_words: tuple[str, ...] | None = None
    instructions: ClassVar[str] = (
        "Read all the pages with read_page, one call at a time. Page 1 states a code. When no page is left, answer "
        "with the code."
    )

    def make_task(self, rng: np.random.Generator) -> PageRecallTask:
        pools, words = word_pools(self.tokenizer), self.code_words()
        codes = self.config.codes or len(words)
        if codes > len(words):
            raise ValueError(f"codes={codes} exceeds the {len(words)} code words the tokenizer has")
        code = words[int(rng.integers(codes))]
        lines_per_page = max(1, self.config.page_tokens // TOKENS_PER_LINE)
        pages = [
            _page(rng, pools.filler, number, self.config.pages, lines_per_page, code if number == 1 else None)
            for number in range(1, self.config.pages + 1)
        ]
        return PageRecallTask(code=code, pages=tuple(pages), scripted_guess=self._scripted_guess(rng, words[:codes]))

    def _scripted_guess(self, rng: np.random.Generator, codes: Sequence[str]) -> str | None:
        """A code drawn at random for a scripted episode that misreads page 1's, else None. Drawn after the pages,
        and only when ``scripted_keeps`` < 1, so the tasks at the default are the ones drawn before this setting."""
        if self.config.scripted_keeps >= 1.0:
            return None
        guess = codes[int(rng.integers(len(codes)))]
        return None if rng.random() < self.config.scripted_keeps else guess

    def drill_document(self, rng: np.random.Generator, tokens: int) -> Trajectory:
        """The copy the task turns on, alone: a page of about ``tokens`` tokens stating a code, then ``The code is``
        and the code, as a summary or the answer writes it (loss on the code and its full stop). A tiny policy does
        not learn this copy from the episodes, where the code is ~4 % of the loss tokens and a few dozen episodes
        are told apart more easily by their filler than read; new pages, the code anywhere in them, teach it
        (README, the long-horizon task). Plain text, not the chat layout: a copy with one token between the cue and
        the code is what a tiny model learns first (`bench.ablation_learning` found the same for key-value recall);
        the episodes' stage then carries it into the layout, with these drills rehearsed."""
        words = self.code_words()[: self.config.codes]
        code = words[int(rng.integers(len(words)))]
        page = _page(rng, word_pools(self.tokenizer).filler, 1, 1, max(1, tokens // TOKENS_PER_LINE), code)
        asked, copied = f"{page}\nThe code is", f"{code}."
        encode = self.tokenizer.encode
        return Trajectory(
            [Segment("user", encode(asked), text=asked), Segment("assistant", encode(copied), text=copied)]
        )

    def code_words(self) -> tuple[str, ...]:
        """The value pool's words that no text of the environment's own holds (its system and user prompts, the
        context policy's requests, the calls and summaries of the script), so that in an episode the code's token
        is the code and nothing else. Cached per environment."""
        if self._code_words is None:
            empty = PageRecallTask(code="", pages=("",))
            texts = [
                system_prompt_with_tools(self.instructions, ToolRegistry(self.tools(empty)).schemas()),
                self.user_prompt(empty),
                *self.scripted_turns(empty),
                self.scripted_summary(empty, 0),
                NO_PAGE_LEFT,
            ]
            strategy = self.config.context.strategy if self.config.context is not None else None
            if isinstance(strategy, SummaryTurn):
                texts += [strategy.request, strategy.resume]
            taken = {token for text in texts for token in self.tokenizer.encode(text)}
            words = word_pools(self.tokenizer).values
            self._code_words = tuple(w for w in words if self.tokenizer.encode(w)[0] not in taken)
        return self._code_words

    def tools(self, task: PageRecallTask) -> list[Tool]:
        unread = iter(task.pages)

        def read_page() -> str:
            """Return the next page, or say that none is left."""
            return next(unread, NO_PAGE_LEFT)

        longest = max(len(page) for page in task.pages)
        return [tool(read_page, max_output_chars=longest + 64)]

    def user_prompt(self, task: PageRecallTask) -> str:
        return f"There are {len(task.pages)} pages. Read them all, then answer the code stated on page 1."

    def score(self, task: PageRecallTask, answer: str) -> Score:
        """1 for the code, once every page was read (the last page's header is in a tool output of the episode);
        an answer before that scores 0, else a guess after few summaries would beat carrying the code through all."""
        last = page_header(len(task.pages), len(task.pages))
        read_all = any(s.role == "tool" and last in s.text for s in self.trajectory.segments)
        return Score(float(read_all and answer.strip() == task.answer), {"read_all_pages": read_all})

    def scripted_turns(self, task: PageRecallTask) -> list[str]:
        read = format_tool_call("read_page", {})
        # The leading space keeps the answer's token the code's token on page 1 (the score strips it).
        answer = task.code if task.scripted_guess is None else task.scripted_guess
        return [read] * (len(task.pages) + 1) + [f"{ANSWER_OPEN}{answer}{ANSWER_CLOSE}"]

    def scripted_summary(self, task: PageRecallTask, played: int) -> str:
        """The code's line: all that the rest of the episode needs (the page count is in the pages' headers). A
        scripted episode that misread the code carries its guess the same way."""
        return task.code_line if task.scripted_guess is None else f"The code is{task.scripted_guess}."
