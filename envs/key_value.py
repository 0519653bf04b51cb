"""``LongStraw/KeyValueRecall-v0``: recall one fact from a long list of key-value facts in the prompt.

The user message lists ``num_facts`` facts, one a line (`` town = pack desk``), hidden among filler lines until it
is about ``prompt_tokens`` long, and asks for the value of one key. Reward 1 when the answer is exactly that value,
else 0. No tools, one turn: answering needs the prompt's representation (attention K/V, recurrent state) to encode
the facts, which is the part of the gradient detached-prefix training drops. No tools: a turn without an answer
gets a correction, and ``max_turns`` (2 by default; 1 makes the episode a plain prompt and response) bounds them.

Keys, values and filler are words that are single tokens of the tokenizer (with their leading space, as they appear
mid-line), drawn from three disjoint pools, so a fact line tokenizes the same wherever it stands and the value's
tokens in the prompt are the ones the answer must repeat.

Two reference policies: `ScriptedPolicy` (the oracle, answering the asked value) and `FormatOnlyPolicy`, which
answers in the same format with a decoy value that the prompt does not hold: supervised traces of it teach the
answer format without the facts of any prompt.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass
from typing import ClassVar

import gymnasium
import numpy as np
from pydantic import Field, model_validator

from longstraw_agents.tokenizer import Tokenizer

from .answers import ANSWER_CLOSE, ANSWER_OPEN
from .base import ToolEnv, ToolEnvConfig
from .policy import unwrap_tool_env

FILLER_WORDS_PER_LINE = 8
_WORD = re.compile(r" [a-z]{2,12}")


class KeyValueRecallConfig(ToolEnvConfig):
    num_facts: int = Field(default=8, ge=1, description="Key-value facts in the prompt (distinct keys).")
    value_tokens: int = Field(default=1, ge=1, le=16, description="Words (one token each) per value.")
    prompt_tokens: int = Field(
        default=0, ge=0, description="Filler lines pad the user message to about this many tokens (0: facts only)."
    )
    max_turns: int = Field(
        default=2, ge=1, description="Assistant turns per episode (a turn without an answer gets a correction)."
    )
    max_tokens: int = Field(default=4096, ge=1, description="Token budget (default: max(4096, prompt_tokens + 1024)).")

    @model_validator(mode="before")
    @classmethod
    def _budget_follows_the_prompt(cls, data: object) -> object:
        """Unless given, the token budget leaves 1024 tokens past the padded user message."""
        if isinstance(data, dict) and "max_tokens" not in data and isinstance(data.get("prompt_tokens"), int):
            data = {**data, "max_tokens": max(4096, data["prompt_tokens"] + 1024)}
        return data


@dataclass(frozen=True)
class WordPools:
    """The tokenizer's single-token words, split into three disjoint pools."""

    keys: tuple[str, ...]
    values: tuple[str, ...]
    filler: tuple[str, ...]


# Per tokenizer object: a rollout makes many envs over one tokenizer, and a large vocabulary takes a while to scan.
_POOLS: weakref.WeakKeyDictionary[Tokenizer, WordPools] = weakref.WeakKeyDictionary()


def word_pools(tokenizer: Tokenizer) -> WordPools:
    """Words (``" town"``) that encode to exactly one token of ``tokenizer``, dealt in turn into keys, values and
    filler (deterministic for a tokenizer)."""
    pools = _POOLS.get(tokenizer)
    if pools is None:
        words = [
            text
            for token_id in range(tokenizer.vocab_size)
            if _WORD.fullmatch(text := tokenizer.decode([token_id])) and tokenizer.encode(text) == [token_id]
        ]
        pools = _POOLS[tokenizer] = WordPools(
            keys=tuple(words[0::3]), values=tuple(words[1::3]), filler=tuple(words[2::3])
        )
    if min(len(pools.keys), len(pools.values), len(pools.filler)) < 2:
        raise ValueError(f"tokenizer {tokenizer.name!r} has too few single-token words for KeyValueRecall")
    return pools


@dataclass(frozen=True)
class KeyValueTask:
    facts: tuple[tuple[str, str], ...]
    """(key, value) in prompt order; words keep their leading space (``(" town", " pack desk")``)."""
    asked: int
    """Index into ``facts`` of the fact the question asks for."""
    filler: tuple[tuple[int, str], ...]
    """(fact index it precedes, filler line); ``len(facts)`` places a line after the last fact."""
    decoy: str
    """A value of the right length that is no fact's value: `FormatOnlyPolicy`'s answer."""

    @property
    def key(self) -> str:
        return self.facts[self.asked][0]

    @property
    def answer(self) -> str:
        """The asked value as the answer holds it (stripped, one space between words)."""
        return self.facts[self.asked][1].strip()


class KeyValueRecallEnv(ToolEnv[KeyValueTask]):
    """Answer the value of one key listed in a long prompt; reward 1 for exactly that value, else 0."""

    config_class = KeyValueRecallConfig
    config: KeyValueRecallConfig
    instructions: ClassVar[str] = "The user lists facts as 'key = value' lines. Answer with the value of the key asked."

    def make_task(self, rng: np.random.Generator) -> KeyValueTask:
        pools = word_pools(self.tokenizer)
        config = self.config
        if config.num_facts > len(pools.keys):
            raise ValueError(f"num_facts={config.num_facts} exceeds the {len(pools.keys)} single-token keys available")
        keys = rng.choice(len(pools.keys), size=config.num_facts, replace=False)
        values = [self._value(rng, pools) for _ in keys]
        facts = tuple((pools.keys[k], value) for k, value in zip(keys, values, strict=True))
        asked = int(rng.integers(config.num_facts))
        decoy = self._value(rng, pools)
        while decoy in values:
            decoy = self._value(rng, pools)
        return KeyValueTask(facts=facts, asked=asked, filler=self._filler(rng, pools, facts), decoy=decoy.strip())

    def _value(self, rng: np.random.Generator, pools: WordPools) -> str:
        return "".join(pools.values[i] for i in rng.integers(len(pools.values), size=self.config.value_tokens))

    def _filler(
        self, rng: np.random.Generator, pools: WordPools, facts: tuple[tuple[str, str], ...]
    ) -> tuple[tuple[int, str], ...]:
        """Filler lines, each at a random place among the facts, until the user message is ~``prompt_tokens``."""
        length = len(self.tokenizer.encode(self.user_prompt(KeyValueTask(facts, 0, (), ""))))
        lines: list[tuple[int, str]] = []
        while length < self.config.prompt_tokens:
            words = rng.integers(len(pools.filler), size=FILLER_WORDS_PER_LINE)
            line = "".join(pools.filler[i] for i in words) + "."
            lines.append((int(rng.integers(len(facts) + 1)), line))
            length += len(self.tokenizer.encode(line + "\n"))
        return tuple(sorted(lines, key=lambda placed: placed[0]))  # stable: keeps the drawing order within a gap

    def user_prompt(self, task: KeyValueTask) -> str:
        return f"{self.facts_text(task)}\n{self.question(task.key)}"

    def facts_text(self, task: KeyValueTask) -> str:
        """The user message before its question: the facts, one a line, among the filler lines."""
        lines = ["Facts:"]
        filler = iter(task.filler)
        pending = next(filler, None)
        for index, (key, value) in enumerate((*task.facts, ("", ""))):
            while pending is not None and pending[0] == index:
                lines.append(pending[1])
                pending = next(filler, None)
            if key:
                lines.append(f"{key} ={value}")
        return "\n".join(lines)

    @staticmethod
    def question(key: str) -> str:
        """The question asking for ``key``'s value (the key with its leading space)."""
        return f"What is the value of{key}?"

    def score(self, task: KeyValueTask, answer: str) -> float:
        return float(" ".join(answer.split()) == task.answer)

    def scripted_turns(self, task: KeyValueTask) -> list[str]:
        # The leading space keeps the answer's tokens those of the value in the prompt (the score strips it).
        return [f"{ANSWER_OPEN} {task.answer}{ANSWER_CLOSE}"]

    def format_only_turns(self, task: KeyValueTask) -> list[str]:
        """The scripted answer's format with the task's decoy value (not in the prompt): no fact is taught."""
        return [f"{ANSWER_OPEN} {task.decoy}{ANSWER_CLOSE}"]


class FormatOnlyPolicy:
    """Answers every `KeyValueRecallEnv` episode in the oracle's format with a decoy value the prompt does not hold
    (reward 0): a supervised warm start on its traces learns the answer format, never a fact or the retrieval."""

    def __init__(self, env: gymnasium.Env) -> None:
        inner = unwrap_tool_env(env)
        if not isinstance(inner, KeyValueRecallEnv):
            raise TypeError(f"FormatOnlyPolicy plays KeyValueRecallEnv, got {type(inner).__name__}")
        self.env = inner

    def act(self, observation: np.ndarray | None = None) -> np.ndarray:
        env = self.env
        (turn,) = env.format_only_turns(env.task)
        return env.formatter.assistant(turn, env.turn).token_ids.astype(np.int64)

    __call__ = act
