"""Tokenizers behind one small protocol: the shipped byte-level BPE (tiktoken) and local Hugging Face tokenizers.

Token-in / token-out: environments, the chat formatter and the trainer exchange token ids, never text, so every
component must agree on one tokenizer and on how its added tokens are treated. They are of two kinds, as in Qwen's
tokenizers:

- control tokens (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``: Hugging Face's *special* added tokens) only
  the chat template writes. ``encode(text)`` reads their strings as ordinary text, so a document or a tool output
  that contains ``<|im_end|>`` cannot end a turn; ``encode(text, allow_special=True)``, used for what a policy
  emits, maps them to their ids.
- tags (``<tool_call>``, ``<tool_response>``, ``<answer>`` and their closing tags: added tokens that are not
  special) are words of the vocabulary: every text encodes them as their one id, the instructions that name them as
  much as the turns that use them. A tag in a tool output is still no tool call: calls are read from the policy's
  turns only.

So the text of any conversation the chat formatter renders, encoded by transformers as a whole
(``AutoTokenizer.from_pretrained(...).encode(text, add_special_tokens=False)``, what ``apply_chat_template`` does),
gives back the ids the formatter rendered, unless a message holds a control token's string.

The default tokenizer, ``longstraw-bpe``, is a 2048-token byte-level BPE trained by ``scripts/train_bpe.py`` on
text the project generates (word problems, encyclopedia-style documents, Python, JSON tool calls, dialogue). Its
merge ranks ship in ``longstraw_agents/data/`` in tiktoken's rank-file format and are loaded from that local file,
so nothing is ever downloaded. ``HFTokenizer`` wraps any tokenizer saved in a local directory.
"""

from __future__ import annotations

import base64
import copy
import functools
import re
from collections.abc import Collection, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import tiktoken

if TYPE_CHECKING:
    import numpy as np

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# ChatML's control tokens: only the chat template writes them (plain text reads their strings as text).
CONTROL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)
# Qwen-style tool and answer tags: words of the vocabulary, one id wherever they occur in text.
TAG_TOKENS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<answer>",
    "</answer>",
)
# The special tokens of the chat format. In the shipped BPE they take the ids right after the merge ranks, in this
# order.
CHAT_SPECIAL_TOKENS: tuple[str, ...] = CONTROL_TOKENS + TAG_TOKENS

# GPT-4's (cl100k) pre-tokenisation: contractions, letter runs with one leading non-letter, numbers in groups of at
# most three digits, punctuation runs, and whitespace that attaches to the following word.
PRETOKENIZE_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|"""
    r"""\s+(?!\S)|\s"""
)

SHIPPED_BPE_NAME = "longstraw-bpe-v1"
SHIPPED_BPE_ALIASES = ("longstraw-bpe", SHIPPED_BPE_NAME)
SHIPPED_BPE_FILE = "longstraw_bpe.tiktoken"


@runtime_checkable
class Tokenizer(Protocol):
    """What the agent side needs from a tokenizer. ``eos_token_id`` is the end-of-turn token (``<|im_end|>``)."""

    @property
    def name(self) -> str:
        """Identity recorded with every run in the store (``longstraw-bpe-v1`` or the tokenizer's local path)."""
        ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_id(self) -> int: ...

    @property
    def pad_token_id(self) -> int: ...

    @property
    def special_tokens(self) -> dict[str, int]:
        """Every added token (control tokens and tags) by its string."""
        ...

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """``text``'s ids; control-token strings are text unless ``allow_special`` (tags are always their ids)."""
        ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...

    def special_token_id(self, token: str) -> int: ...


def _as_int_list(ids: Sequence[int] | np.ndarray) -> list[int]:
    return ids.tolist() if hasattr(ids, "tolist") else [int(i) for i in ids]


def _lookup_special(name: str, special_tokens: Mapping[str, int], token: str) -> int:
    try:
        return special_tokens[token]
    except KeyError:
        known = ", ".join(special_tokens) or "none"
        raise KeyError(f"{token!r} is not a special token of {name}; known special tokens: {known}") from None


def _check_id_range(ids: list[int], vocab_size: int, name: str) -> None:
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = [i for i in ids if not 0 <= i < vocab_size]
        raise ValueError(f"token ids out of range for {name} (vocab size {vocab_size}): {bad[:8]}")


# --------------------------------------------------------------------------------------------------------------------
# Rank files
# --------------------------------------------------------------------------------------------------------------------


def load_ranks(path: str | Path) -> dict[bytes, int]:
    """Read a tiktoken rank file (one ``base64(token) rank`` per line) from a local path.

    Same format as ``tiktoken.load.load_tiktoken_bpe``, which is not used because it caches every file it reads in
    the temp dir keyed by path: a retrained file at the same path would be shadowed by the stale copy.
    """
    ranks: dict[bytes, int] = {}
    for line_no, line in enumerate(Path(path).read_bytes().splitlines(), start=1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise ValueError(f"{path}:{line_no}: expected 'base64-token rank', got {line[:80]!r}") from e
    _check_ranks(ranks, source=str(path))
    return ranks


def save_ranks(ranks: Mapping[bytes, int], path: str | Path) -> None:
    """Write ``ranks`` in tiktoken's rank-file format, sorted by rank."""
    _check_ranks(ranks, source="ranks to save")
    lines = [base64.b64encode(token) + b" " + str(rank).encode() for token, rank in sorted(ranks.items(), key=_rank)]
    Path(path).write_bytes(b"\n".join(lines) + b"\n")


def _rank(item: tuple[bytes, int]) -> int:
    return item[1]


def _check_ranks(ranks: Mapping[bytes, int], *, source: str) -> None:
    """Byte-level BPE needs every single byte as a token and ranks 0..n-1 without gaps."""
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{source}: ranks must be exactly 0..{len(ranks) - 1}, each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{source}: byte-level BPE needs all 256 single bytes; missing {missing[:8]}...")


# --------------------------------------------------------------------------------------------------------------------
# tiktoken
# --------------------------------------------------------------------------------------------------------------------


class TiktokenTokenizer:
    """A ``tiktoken.Encoding`` behind the ``Tokenizer`` protocol.

    The encoding must contain ``<|im_end|>`` (the end-of-turn / eos token). The pad token is ``<|endoftext|>`` when
    the encoding has it, else eos. Its special tokens that are in ``tags`` are tags (see the module docstring): plain
    text encodes them as their ids; the others are control tokens.
    """

    def __init__(
        self, encoding: tiktoken.Encoding, *, name: str | None = None, tags: Collection[str] = TAG_TOKENS
    ) -> None:
        self._encoding = encoding
        self._name = name or encoding.name
        self._special_tokens = {
            token: encoding.encode_single_token(token)
            for token in sorted(encoding.special_tokens_set, key=encoding.encode_single_token)
        }
        self._tags = frozenset(tags) & encoding.special_tokens_set
        self._eos_token_id = _lookup_special(self._name, self._special_tokens, IM_END)
        self._pad_token_id = self._special_tokens.get(ENDOFTEXT, self._eos_token_id)

    @classmethod
    def from_ranks_file(
        cls,
        path: str | Path,
        *,
        name: str,
        special_tokens: Sequence[str] = CHAT_SPECIAL_TOKENS,
        pattern: str = PRETOKENIZE_PATTERN,
    ) -> TiktokenTokenizer:
        """Build the encoding from a local rank file; the special tokens get the ids right after the ranks."""
        ranks = load_ranks(path)
        specials = {token: len(ranks) + i for i, token in enumerate(special_tokens)}
        encoding = tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
        return cls(encoding, name=name)

    @property
    def encoding(self) -> tiktoken.Encoding:
        return self._encoding

    @property
    def name(self) -> str:
        return self._name

    @property
    def vocab_size(self) -> int:
        return self._encoding.n_vocab

    @property
    def eos_token_id(self) -> int:
        return self._eos_token_id

    @property
    def pad_token_id(self) -> int:
        return self._pad_token_id

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._special_tokens)

    @property
    def tags(self) -> frozenset[str]:
        """The special tokens that plain text encodes as their ids (the others are control tokens)."""
        return self._tags

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        if allow_special:
            return self._encoding.encode(text, allowed_special="all")
        return self._encoding.encode(text, allowed_special=self._tags, disallowed_special=())

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        id_list = _as_int_list(ids)
        _check_id_range(id_list, self.vocab_size, self.name)
        return self._encoding.decode(id_list, errors="replace")

    def special_token_id(self, token: str) -> int:
        return _lookup_special(self._name, self._special_tokens, token)

    def save_pretrained(self, directory: str | Path, *, chat_template: str | None = None) -> None:
        """Write this tokenizer as a Hugging Face fast tokenizer (``tokenizer.json``, ``tokenizer_config.json``, and
        ``chat_template`` when given): ``AutoTokenizer.from_pretrained(directory)`` loads it offline and encodes and
        decodes exactly as this one does, added tokens included: control tokens are special added tokens and tags
        added tokens that are not (as in Qwen's tokenizers), so ``encode(text, add_special_tokens=False)`` is
        ``encode(text, allow_special=True)`` and, with ``split_special_tokens=True``, ``encode(text)``."""
        from transformers import PreTrainedTokenizerFast

        fast = PreTrainedTokenizerFast(
            tokenizer_object=_tokenizers_backend(self._encoding, self._tags),
            eos_token=IM_END,
            pad_token=ENDOFTEXT if ENDOFTEXT in self._special_tokens else IM_END,  # as ``pad_token_id`` chooses
            clean_up_tokenization_spaces=False,  # decode returns the bytes' text, as tiktoken does
            **_chat_template_settings(chat_template),
        )
        fast.save_pretrained(str(directory))

    def __repr__(self) -> str:
        return f"TiktokenTokenizer(name={self._name!r}, vocab_size={self.vocab_size})"


def _tokenizers_backend(encoding: tiktoken.Encoding, tags: Collection[str]) -> Any:
    """``encoding`` as a ``tokenizers.Tokenizer``: byte-level BPE with every merge its ranks imply, ranked as they
    are, the same pre-tokenisation (transformers' ``TikTokenConverter``), and the special tokens at their ids: the
    ``tags`` as added tokens that are not special, the others as special ones."""
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    # tiktoken documents these attributes for building encodings from another (its README, "Extending tiktoken")
    ranks, specials = encoding._mergeable_ranks, encoding._special_tokens
    ordered = sorted(specials, key=specials.__getitem__)
    if [specials[token] for token in ordered] != list(range(len(ranks), len(ranks) + len(ordered))):
        raise ValueError(f"{encoding.name}: special tokens must take the ids right after the merge ranks")

    class RanksConverter(TikTokenConverter):  # the ranks at hand, not a file read through tiktoken's cache
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return ranks

    backend = RanksConverter(pattern=oniguruma_pattern(encoding._pat_str)).converted()
    for token in ordered:  # one at a time, so that each takes the next id
        if token in tags:
            backend.add_tokens([AddedToken(token, normalized=False, special=False)])
        else:
            backend.add_special_tokens([AddedToken(token, normalized=False, special=True)])
    return backend


def _chat_template_settings(chat_template: str | None) -> dict[str, Any]:
    """A transformers tokenizer's settings for ``chat_template``. ``chat_control_tokens`` empty: the tokens that
    ``apply_chat_template(..., sanitize_control_tokens=True)`` reads as text in messages are the special ones only,
    and tags stay words, as ``encode(text)`` treats them."""
    return {} if chat_template is None else {"chat_template": chat_template, "chat_control_tokens": []}


# A bounded repeat made possessive by a trailing "+" (``\p{N}{1,3}+``): the atom, then the bounds.
_POSSESSIVE_INTERVAL = re.compile(r"(\\p\{\w+\}|\\.|\[(?:\\.|[^\]])*\]|[^\\()])(\{\d+(?:,\d*)?\})\+")
_POSSESSIVE_GROUP_INTERVAL = re.compile(r"(?<!\\)\)\{\d+(?:,\d*)?\}\+")


def oniguruma_pattern(pattern: str) -> str:
    """``pattern`` as the Oniguruma engine of ``tokenizers`` must read it. Its Ruby syntax takes ``?+``, ``*+`` and
    ``++`` as possessive, as tiktoken's engine does, but ``{1,3}+`` as an interval repeated one or more times
    (``\\p{N}{1,3}+`` would then take every digit of a number at once): an atomic group says "possessive" to both."""
    if _POSSESSIVE_GROUP_INTERVAL.search(pattern):
        raise ValueError(f"a possessive interval after a group is not translated: {pattern!r}")
    return _POSSESSIVE_INTERVAL.sub(r"(?>\1\2)", pattern)


# --------------------------------------------------------------------------------------------------------------------
# Hugging Face
# --------------------------------------------------------------------------------------------------------------------


class HFTokenizer:
    """A fast Hugging Face tokenizer loaded from a local directory (never from the Hub).

    Special tokens are all added tokens except pure-whitespace ones (Gemma's ``"\\n"`` is ordinary text). The
    tokenizer's own flags say which are control tokens and which tags (see the module docstring): with
    ``allow_special=False`` its *special* added tokens are read as text and the others (Qwen's ``<tool_call>``) still
    match, as transformers encodes with ``split_special_tokens=True``. Eos is ``<|im_end|>`` when the tokenizer has
    it, else its own eos token.
    """

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"no tokenizer directory at {path} (HFTokenizer loads local files only)")
        from tokenizers import Tokenizer as Backend
        from transformers import AutoTokenizer  # lazy: the agent side must import without transformers

        self._tokenizer: Any = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError(f"{path} holds a slow tokenizer; HFTokenizer needs a fast one (tokenizer.json)")
        # a copy that reads special added tokens as text: transformers switches one backend's flag per call
        # (``split_special_tokens``), which concurrent callers would race on
        self._plain: Any = Backend.from_str(backend.to_str())
        self._plain.encode_special_tokens = True
        self._name = str(path)
        self._special_tokens = {
            token.content: int(token_id)
            for token_id, token in sorted(self._tokenizer.added_tokens_decoder.items())
            if not token.content.isspace()
        }
        eos = self._special_tokens.get(IM_END, self._tokenizer.eos_token_id)
        if eos is None:
            raise ValueError(f"{path}: the tokenizer has neither {IM_END!r} nor an eos token")
        self._eos_token_id = int(eos)
        pad = self._tokenizer.pad_token_id
        self._pad_token_id = int(pad) if pad is not None else self._special_tokens.get(ENDOFTEXT, self._eos_token_id)

    @property
    def name(self) -> str:
        return self._name

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    @property
    def eos_token_id(self) -> int:
        return self._eos_token_id

    @property
    def pad_token_id(self) -> int:
        return self._pad_token_id

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._special_tokens)

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        if allow_special:
            return self._tokenizer.encode(text, add_special_tokens=False)
        return list(self._plain.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        id_list = _as_int_list(ids)
        _check_id_range(id_list, self.vocab_size, self.name)
        return self._tokenizer.decode(id_list, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def special_token_id(self, token: str) -> int:
        return _lookup_special(self._name, self._special_tokens, token)

    def save_pretrained(self, directory: str | Path, *, chat_template: str | None = None) -> None:
        """Write the tokenizer's files to ``directory`` (transformers' ``save_pretrained``), with ``chat_template`` in
        place of its own when given."""
        tokenizer = self._tokenizer
        if chat_template is not None:
            tokenizer = copy.deepcopy(tokenizer)  # this one stays as it was loaded
            for name, value in _chat_template_settings(chat_template).items():
                setattr(tokenizer, name, value)
        tokenizer.save_pretrained(str(directory))

    def __repr__(self) -> str:
        return f"HFTokenizer(name={self._name!r}, vocab_size={self.vocab_size})"


# --------------------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------------------


def shipped_ranks_path() -> Path:
    """Where the shipped BPE ranks live inside the installed package."""
    return Path(str(resources.files("longstraw_agents") / "data" / SHIPPED_BPE_FILE))


@functools.cache
def _shipped_tokenizer() -> TiktokenTokenizer:
    return TiktokenTokenizer.from_ranks_file(shipped_ranks_path(), name=SHIPPED_BPE_NAME)


def load_tokenizer(spec: str | Path = "longstraw-bpe") -> Tokenizer:
    """The shipped BPE for ``"longstraw-bpe"`` (or ``"longstraw-bpe-v1"``); a local HF tokenizer directory otherwise."""
    if str(spec) in SHIPPED_BPE_ALIASES:
        return _shipped_tokenizer()
    if Path(spec).is_dir():
        return HFTokenizer(spec)
    raise ValueError(
        f"unknown tokenizer {str(spec)!r}: expected one of {SHIPPED_BPE_ALIASES} or a local directory holding a "
        "Hugging Face tokenizer (tokenizer.json); nothing is downloaded"
    )
