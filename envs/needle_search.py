"""``LongStraw/NeedleSearch-v0``: the long-context environment.

The agent answers a question about a generated world (see `needle_corpus`) that needs facts from several
documents: it searches (``search_documents`` returns ids, titles and snippets), opens whole documents
(``open_document``), and answers with one number. The documents the answer needs are long, sized so that an
episode that opens just them — the scripted solution — is about ``target_tokens`` long: 4K by default, up to
millions. Reward 1 for the right number, else 0.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
from pydantic import Field, model_validator

from longstraw_agents.tools import Tool, format_tool_call, make_document_tools

from .answers import number_matches
from .base import ToolEnv, ToolEnvConfig
from .context import ContextConfig, SummaryTurn
from .needle_corpus import MAX_DOCUMENTS, NeedleTask, build_needle_task

# What the scripted episode spends besides the needle documents' filler, measured on the shipped BPE: the prompt
# (system message with the two tool schemas, the question) and the answer; per needle, a search call and its
# results, an open call, the document's header, its fact sentences and the chat framing. They size the documents
# so that the scripted episode comes within a few percent of target_tokens (within ~15 % at 4K, where the
# number of search hits and the last paragraph of each document weigh more).
PROMPT_TOKENS = 660
PER_NEEDLE_TOKENS = 470
SEARCH_RESULTS = 3
"""Hits the scripted solution asks for: the searched name's own document always ranks among them."""
MIN_DOCUMENT_TOKENS = 256
"""Needle documents are at least this long, so that their facts hide in filler, not in the search snippet."""


class NeedleSearchConfig(ToolEnvConfig):
    target_tokens: int = Field(
        default=4096, ge=2048, le=1 << 24, description="About how long the scripted solution's episode is, in tokens."
    )
    needles: int = Field(default=2, ge=2, le=12, description="How many documents the answer needs.")
    num_documents: int = Field(default=24, ge=4, le=MAX_DOCUMENTS, description="Documents in the corpus.")
    max_turns: int = Field(
        default=8,
        ge=1,
        description="Assistant turns per episode (default: 2 * needles + 4, and one summary turn per needle more "
        "with a summary context policy).",
    )
    max_tokens: int = Field(default=12_288, ge=1, description="Token budget (default: 2 * target_tokens + 4096).")

    @model_validator(mode="before")
    @classmethod
    def _budgets_follow_the_task(cls, data: Any) -> Any:
        """Unless given, the budgets leave room for the scripted solution and as much again."""
        if isinstance(data, dict):
            data = dict(data)
            target, needles = data.get("target_tokens", 4096), data.get("needles", 2)
            if isinstance(target, int) and "max_tokens" not in data:
                data["max_tokens"] = 2 * target + 4096
            if isinstance(needles, int) and "max_turns" not in data:
                data["max_turns"] = 2 * needles + 4 + (needles if _summarises(data.get("context")) else 0)
        return data

    @model_validator(mode="after")
    def _consistent(self) -> NeedleSearchConfig:
        if self.num_documents <= self.needles:
            raise ValueError(f"num_documents ({self.num_documents}) must exceed needles ({self.needles})")
        smallest = PROMPT_TOKENS + self.needles * (PER_NEEDLE_TOKENS + MIN_DOCUMENT_TOKENS)
        if self.target_tokens < smallest:
            raise ValueError(
                f"target_tokens={self.target_tokens} is too small for {self.needles} needles; use >= {smallest}"
            )
        return self

    @property
    def document_tokens(self) -> int:
        """Tokens per needle document so that the scripted episode is about ``target_tokens`` long."""
        return (self.target_tokens - PROMPT_TOKENS) // self.needles - PER_NEEDLE_TOKENS


def _summarises(context: Any) -> bool:
    """Whether a ``context`` setting (a ``ContextConfig`` or its dict form) asks for summary turns."""
    if isinstance(context, ContextConfig):
        return isinstance(context.strategy, SummaryTurn)
    if isinstance(context, dict):
        strategy = context.get("strategy")
        return isinstance(strategy, SummaryTurn) or (isinstance(strategy, dict) and strategy.get("kind") == "summary")
    return False


class NeedleSearchEnv(ToolEnv[NeedleTask]):
    """Multi-document question answering over a generated corpus; the trajectory grows with opened documents."""

    config_class = NeedleSearchConfig
    config: NeedleSearchConfig
    instructions: ClassVar[str] = (
        "Answer the question from the documents. Search them, open the ones you need (search snippets are not "
        "enough), and answer with a single number."
    )

    def make_task(self, rng: np.random.Generator) -> NeedleTask:
        return build_needle_task(
            rng,
            needles=self.config.needles,
            num_documents=self.config.num_documents,
            document_tokens=self.config.document_tokens,
            count_tokens=self._count_tokens,
        )

    def _count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def tools(self, task: NeedleTask) -> list[Tool]:
        # open_document's output cap must let the longest document through whole: that is the point.
        return make_document_tools(task.corpus, max_document_chars=task.longest_document_chars + 64)

    def user_prompt(self, task: NeedleTask) -> str:
        return task.question

    def score(self, task: NeedleTask, answer: str) -> float:
        return float(number_matches(answer, task.answer))

    def scripted_summary(self, task: NeedleTask, played: int) -> str:
        """The facts of the needle documents opened in the first ``played`` turns (two turns per needle: search,
        open), and the names still to look up: what the answer needs, in a few tokens."""
        opened = task.needles[: played // 2]
        facts = "; ".join(f"{n.entity.name}: {n.fact} {n.value}" for n in opened) or "none yet"
        left = ", ".join(n.entity.name for n in task.needles[len(opened) :]) or "nothing"
        return f"Facts found: {facts}. Still to look up: {left}."

    def scripted_turns(self, task: NeedleTask) -> list[str]:
        turns = []
        for needle in task.needles:
            turns.append(format_tool_call("search_documents", {"query": needle.entity.name, "k": SEARCH_RESULTS}))
            turns.append(format_tool_call("open_document", {"doc_id": needle.doc_id}))
        turns.append(f"<answer>{task.answer}</answer>")
        return turns
