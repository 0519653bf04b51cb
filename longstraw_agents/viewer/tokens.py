"""Token ids → the text of each token, for pages that shade tokens one by one.

A byte-level BPE (the shipped tokenizer, any tiktoken encoding) knows each token's bytes: ``ByteLevelText`` joins them
through one incremental UTF-8 decoder, so a character split over two tokens is shown once, on the token that
completes it, and the pieces of a range concatenate to its decoded text. Other tokenizers decode each id on its own
(``DecodedText``). Without a tokenizer (``IdText``) a token shows its id. An id the tokenizer does not know shows as
``⟨id⟩`` in every case.
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Callable
from typing import Protocol

import numpy as np

from longstraw_agents.tokenizer import TiktokenTokenizer, Tokenizer, load_tokenizer


def unknown_token(token_id: int) -> str:
    return f"⟨{token_id}⟩"


class TokenText(Protocol):
    """How a run's tokens read: ``describe`` names the source (shown on the page)."""

    def describe(self) -> str: ...

    def texts(self, ids: np.ndarray) -> list[str]:
        """One string per id, in order."""
        ...


class IdText:
    """No tokenizer: each token is shown as its id."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def describe(self) -> str:
        return f"token ids (no text: {self.reason})"

    def texts(self, ids: np.ndarray) -> list[str]:
        return [unknown_token(int(i)) for i in ids]


class ByteLevelText:
    """A tiktoken encoding: each token's bytes, decoded as one UTF-8 stream over the range."""

    def __init__(self, tokenizer: TiktokenTokenizer) -> None:
        self.name = tokenizer.name
        self._token_bytes: Callable[[int], bytes] = functools.cache(tokenizer.encoding.decode_single_token_bytes)

    def describe(self) -> str:
        return f"tokenizer {self.name}"

    def texts(self, ids: np.ndarray) -> list[str]:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        out: list[str] = []
        for token_id in ids.tolist():
            try:
                raw = self._token_bytes(token_id)
            except KeyError:  # not in this vocabulary
                out.append(decoder.decode(b"", final=True) + unknown_token(token_id))
                decoder.reset()
                continue
            out.append(decoder.decode(raw))
        if out:
            out[-1] += decoder.decode(b"", final=True)  # an unfinished character at the end of the range
        return out


class DecodedText:
    """Any tokenizer: each id decoded on its own (a character split over two tokens shows as two marks)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.name = tokenizer.name
        self._tokenizer = tokenizer
        self._decode_one: Callable[[int], str] = functools.cache(self._decoded)

    def describe(self) -> str:
        return f"tokenizer {self.name}"

    def _decoded(self, token_id: int) -> str:
        if not 0 <= token_id < self._tokenizer.vocab_size:
            return unknown_token(token_id)
        return self._tokenizer.decode([token_id])

    def texts(self, ids: np.ndarray) -> list[str]:
        return [self._decode_one(token_id) for token_id in ids.tolist()]


def token_text(spec: str | None) -> TokenText:
    """The token text of the tokenizer ``spec`` names (``load_tokenizer``'s specs); ids when there is none or it
    cannot be loaded here (the reason is shown on the page)."""
    if not spec:
        return IdText("the run names no tokenizer; pass --tokenizer")
    try:
        tokenizer = load_tokenizer(spec)
    except (ValueError, OSError) as err:
        return IdText(f"{err}; pass --tokenizer")
    if isinstance(tokenizer, TiktokenTokenizer):
        return ByteLevelText(tokenizer)
    return DecodedText(tokenizer)
