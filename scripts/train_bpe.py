"""Train the shipped byte-level BPE (``longstraw_agents/data/longstraw_bpe.tiktoken``) on text the project generates.

    python scripts/train_bpe.py                       # writes the shipped rank file (about 5 s)
    python scripts/train_bpe.py --out /tmp/r.tiktoken --vocab-size 1024 --scale 0.2

The corpus is generated here, deterministically from a seed, and resembles what the environments produce:
arithmetic word problems, encyclopedia-style documents full of names, places, dates and numbers, small Python
functions with tests, JSON tool calls and results, and ChatML dialogues. Training is plain byte-level BPE in the
tiktoken style: text is split on special tokens and pre-tokenised with the same regex the tokenizer uses, then the
most frequent adjacent pair is merged until the vocabulary is full. Pair counts are updated incrementally (only
the words that contain the merged pair are touched), so the whole run stays well under a minute in pure Python.
Ties are broken by the smaller pair of token ids, so the ranks depend only on the seed and the settings.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from itertools import pairwise
from pathlib import Path

import regex

from longstraw_agents.tokenizer import (
    CHAT_SPECIAL_TOKENS,
    PRETOKENIZE_PATTERN,
    SHIPPED_BPE_NAME,
    TiktokenTokenizer,
    save_ranks,
    shipped_ranks_path,
)

DEFAULT_VOCAB_SIZE = 2048  # merge ranks + chat special tokens
DEFAULT_SEED = 0

Pair = tuple[int, int]

# --------------------------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------------------------


def count_pretokens(texts: Iterable[str], *, pattern: str, special_tokens: Sequence[str] = ()) -> Counter[bytes]:
    """UTF-8 pre-tokens and their counts. Special-token strings split the text and are not learned, as in encode."""
    split_re = regex.compile(pattern)
    special_re = regex.compile("|".join(map(regex.escape, special_tokens))) if special_tokens else None
    counts: Counter[bytes] = Counter()
    for text in texts:
        chunks = special_re.split(text) if special_re else [text]
        for chunk in chunks:
            counts.update(piece.encode("utf-8") for piece in split_re.findall(chunk))
    return counts


def train_bpe(
    texts: Iterable[str],
    num_ranks: int,
    *,
    pattern: str = PRETOKENIZE_PATTERN,
    special_tokens: Sequence[str] = CHAT_SPECIAL_TOKENS,
    min_frequency: int = 2,
) -> dict[bytes, int]:
    """Learn byte-level BPE ranks: the 256 bytes, then one token per merge, until ``num_ranks`` or no pair is left
    that occurs ``min_frequency`` times. Returns tiktoken's ``mergeable_ranks`` (token bytes → rank)."""
    if num_ranks < 256:
        raise ValueError(f"num_ranks must be at least 256 (one per byte), got {num_ranks}")
    if min_frequency < 1:
        raise ValueError(f"min_frequency must be at least 1, got {min_frequency}")
    word_counts = count_pretokens(texts, pattern=pattern, special_tokens=special_tokens)
    words = [list(word) for word in word_counts]  # byte b is token id b
    freqs = list(word_counts.values())
    vocab = [bytes([b]) for b in range(256)]
    token_id = {token: i for i, token in enumerate(vocab)}

    pair_counts: defaultdict[Pair, int] = defaultdict(int)
    words_with: defaultdict[Pair, set[int]] = defaultdict(set)
    for w, (symbols, freq) in enumerate(zip(words, freqs, strict=True)):
        for pair in pairwise(symbols):
            pair_counts[pair] += freq
            words_with[pair].add(w)
    # Max-heap by count with lazy invalidation: every count change pushes a fresh entry, stale ones are skipped.
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)

    while len(vocab) < num_ranks and heap:
        neg_count, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -neg_count:
            continue
        if -neg_count < min_frequency:
            break
        merged = vocab[pair[0]] + vocab[pair[1]]
        new_id = token_id.get(merged)
        if new_id is None:  # the same bytes can be reached by two different pairs: keep one token
            new_id = token_id[merged] = len(vocab)
            vocab.append(merged)
        changed = _apply_merge(pair, new_id, words, freqs, pair_counts, words_with)
        for p in changed:
            if pair_counts[p] > 0:
                heapq.heappush(heap, (-pair_counts[p], p))
            else:
                del pair_counts[p]
                words_with.pop(p, None)
    return {token: rank for rank, token in enumerate(vocab)}


def _apply_merge(
    pair: Pair,
    new_id: int,
    words: list[list[int]],
    freqs: list[int],
    pair_counts: defaultdict[Pair, int],
    words_with: defaultdict[Pair, set[int]],
) -> set[Pair]:
    """Merge ``pair`` in every word that holds it, updating the pair statistics; return the pairs whose count moved."""
    changed: set[Pair] = set()
    for w in sorted(words_with.pop(pair, ())):
        old = words[w]
        new = _merge_word(old, pair, new_id)
        if len(new) == len(old):  # stale index entry: an earlier merge already consumed the pair here
            continue
        freq = freqs[w]
        for p in pairwise(old):
            pair_counts[p] -= freq
            changed.add(p)
        for p in pairwise(new):
            pair_counts[p] += freq
            words_with[p].add(w)
            changed.add(p)
        words[w] = new
    return changed


def _merge_word(symbols: list[int], pair: Pair, new_id: int) -> list[int]:
    out: list[int] = []
    i = 0
    while i < len(symbols):
        if i + 1 < len(symbols) and symbols[i] == pair[0] and symbols[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return out


# --------------------------------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------------------------------

_ONSETS = ["b", "br", "c", "d", "dr", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "st", "t", "th", "v", "w", "z"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou", "y"]
_CODAS = ["", "", "n", "r", "l", "s", "th", "nd", "rk", "m"]
_PLACE_SUFFIXES = ["ford", "ton", "vale", "mark", "haven", "burg", "field", "moor", "wick", "port"]
_MONTHS = [
    "January", "February", "March", "April", "May", "June",
    "July", "August", "September", "October", "November", "December",
]  # fmt: skip
_ITEMS = ["apples", "books", "coins", "marbles", "tickets", "boxes", "stamps", "pencils", "shells", "cards"]
_OCCUPATIONS = ["botanist", "engineer", "cartographer", "composer", "physician", "astronomer", "merchant", "poet"]
_FIELDS = ["river trade", "glassmaking", "tidal mills", "star charts", "textile dyes", "bridge design", "salt mining"]


def _name(rng: random.Random, syllables: int | None = None) -> str:
    n = syllables or rng.randint(2, 3)
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(n)).capitalize()


def _place(rng: random.Random) -> str:
    return _name(rng, 2) + rng.choice(_PLACE_SUFFIXES)


def _date(rng: random.Random) -> str:
    return f"{rng.randint(1, 28)} {rng.choice(_MONTHS)} {rng.randint(1450, 2023)}"


def _number(rng: random.Random) -> str:
    return f"{rng.randint(1_000, 9_999_999):,}"


def _expression(rng: random.Random, depth: int = 2) -> str:
    if depth == 0 or rng.random() < 0.3:
        return str(rng.randint(1, 999))
    op = rng.choice(["+", "-", "*", "/"])
    left, right = _expression(rng, depth - 1), _expression(rng, depth - 1)
    text = f"{left} {op} {right}"
    return f"({text})" if rng.random() < 0.4 else text


def word_problem(rng: random.Random) -> tuple[str, str, int]:
    """A two-step word problem, the expression that solves it and the answer."""
    person, item = _name(rng), rng.choice(_ITEMS)
    start, groups, per_group, lost = rng.randint(2, 500), rng.randint(2, 40), rng.randint(2, 60), rng.randint(1, 99)
    question = (
        f"{person} has {start} {item}. {person} buys {groups} packs with {per_group} {item} in each pack, "
        f"then gives away {lost} {item}. How many {item} does {person} have now?"
    )
    expression = f"{start} + {groups} * {per_group} - {lost}"
    return question, expression, start + groups * per_group - lost


def encyclopedia_document(rng: random.Random, doc_id: int) -> str:
    place, founder, region = _place(rng), _name(rng) + " " + _name(rng), _name(rng)
    person, occupation, field = _name(rng) + " " + _name(rng), rng.choice(_OCCUPATIONS), rng.choice(_FIELDS)
    return (
        f"# Document {doc_id}: {place}\n\n"
        f"{place} is a town in the province of {region}, founded on {_date(rng)} by {founder}. "
        f"Its population was {_number(rng)} at the census of {rng.randint(1900, 2023)}, and it lies "
        f"{rng.randint(3, 900)} km from the capital at an elevation of {rng.randint(1, 4000)} m.\n"
        f"The town is known for {field}. The {occupation} {person} was born there on {_date(rng)} and later "
        f"moved to {_place(rng)}, where the {field} guild elected them in {rng.randint(1500, 2020)}.\n"
        f"- Area: {rng.randint(5, 900)}.{rng.randint(0, 9)} km²\n- Mayor: {_name(rng)} {_name(rng)}\n"
        f"- Twin town: {_place(rng)} ({rng.randint(1950, 2020)})\n"
    )


_PYTHON_TEMPLATES = [
    (
        "def {f}(values: list[int]) -> int:\n"
        '    """Return the sum of the even numbers in values."""\n'
        "    return sum(v for v in values if v % 2 == 0)\n\n\n"
        "def test_{f}():\n    assert {f}([{a}, {b}, {c}]) == {even_sum}\n    assert {f}([]) == 0\n"
    ),
    (
        "def {f}(text: str) -> str:\n"
        '    """Reverse the words of text."""\n'
        '    return " ".join(reversed(text.split()))\n\n\n'
        'def test_{f}():\n    assert {f}("{w1} {w2}") == "{w2} {w1}"\n'
    ),
    (
        "def {f}(n: int) -> int:\n"
        "    if n < 2:\n        return n\n"
        "    a, b = 0, 1\n    for _ in range(n - 1):\n        a, b = b, a + b\n    return b\n\n\n"
        "def test_{f}():\n    assert {f}(10) == 55\n    assert {f}({small}) == {fib}\n"
    ),
    (
        "def {f}(x: float, low: float, high: float) -> float:\n"
        '    if low > high:\n        raise ValueError(f"low={{low}} > high={{high}}")\n'
        "    return max(low, min(x, high))\n\n\n"
        "def test_{f}():\n    assert {f}({a}, 0, {b}) == {clamped}\n"
    ),
    (
        "class {cls}:\n"
        "    def __init__(self, name: str, count: int = 0) -> None:\n"
        "        self.name = name\n        self.count = count\n\n"
        "    def add(self, k: int) -> None:\n        self.count += k\n\n\n"
        'def test_{f}():\n    c = {cls}("{w1}")\n    c.add({a})\n    assert c.count == {a}\n'
    ),
]


def _fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def python_snippet(rng: random.Random) -> str:
    a, b, c = rng.randint(1, 99), rng.randint(1, 99), rng.randint(1, 99)
    small = rng.randint(1, 20)
    fields = {
        "f": f"{_name(rng, 1).lower()}_{rng.choice(['sum', 'count', 'value', 'words', 'clamp', 'total'])}",
        "cls": _name(rng, 2) + "Counter",
        "a": a,
        "b": b,
        "c": c,
        "even_sum": sum(v for v in (a, b, c) if v % 2 == 0),
        "w1": _name(rng).lower(),
        "w2": _name(rng).lower(),
        "small": small,
        "fib": _fib(small),
        "clamped": max(0, min(a, b)),
    }
    return rng.choice(_PYTHON_TEMPLATES).format(**fields)


def tool_call(rng: random.Random) -> dict[str, object]:
    kind = rng.randrange(4)
    if kind == 0:
        return {"name": "calculator", "arguments": {"expression": _expression(rng)}}
    if kind == 1:
        return {"name": "search", "arguments": {"query": f"{_place(rng)} {rng.choice(_FIELDS)}"}}
    if kind == 2:
        return {"name": "open", "arguments": {"doc_id": rng.randint(0, 99_999)}}
    return {"name": "python", "arguments": {"code": f"print({_expression(rng, 1)})"}}


def dialogue(rng: random.Random, doc_id: int) -> str:
    question, expression, answer = word_problem(rng)
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    searched = json.dumps(tool_call(rng))
    return (
        "<|im_start|>system\nYou are a careful assistant. Use the tools when they help, and put the final answer "
        "inside <answer></answer>.<|im_end|>\n"
        f"<|im_start|>user\n{question}<|im_end|>\n"
        f"<|im_start|>assistant\nLet me compute it.\n<tool_call>\n{call}\n</tool_call><|im_end|>\n"
        f'<|im_start|>tool\n<tool_response>\n{{"result": {answer}}}\n</tool_response><|im_end|>\n'
        f"<|im_start|>assistant\n<tool_call>\n{searched}\n</tool_call><|im_end|>\n"
        f'<|im_start|>tool\n<tool_response>\n{{"ids": [{doc_id}, {doc_id + 7}]}}\n</tool_response><|im_end|>\n'
        f"<|im_start|>assistant\n{person_answer(rng, answer)}<|im_end|>"
    )


def person_answer(rng: random.Random, answer: int) -> str:
    lead = rng.choice(["The result is", "So the total is", "That makes", "The answer is"])
    return f"{lead} {answer}.\n<answer>{answer}</answer>"


def generate_corpus(seed: int = DEFAULT_SEED, scale: float = 1.0) -> Iterator[str]:
    """The training text, one document at a time; ``scale`` multiplies the number of documents."""
    rng = random.Random(seed)
    for doc_id in range(int(3000 * scale)):
        yield encyclopedia_document(rng, doc_id)
        question, expression, answer = word_problem(rng)
        yield f"Problem: {question}\nSolution: {expression} = {answer}. The answer is {answer}.\n"
        yield python_snippet(rng)
        yield json.dumps(tool_call(rng)) + "\n"
        if doc_id % 2 == 0:
            yield dialogue(rng, doc_id)


# --------------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------------


def bytes_per_token(tokenizer: TiktokenTokenizer, texts: Iterable[str]) -> float:
    texts = list(texts)
    num_bytes = sum(len(t.encode("utf-8")) for t in texts)
    num_tokens = sum(len(tokenizer.encode(t, allow_special=True)) for t in texts)
    return num_bytes / num_tokens


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=shipped_ranks_path(), help="rank file to write")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="total, special tokens included")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--scale", type=float, default=1.0, help="corpus size multiplier")
    args = parser.parse_args(argv)

    num_ranks = args.vocab_size - len(CHAT_SPECIAL_TOKENS)
    start = time.perf_counter()
    corpus = list(generate_corpus(args.seed, args.scale))
    ranks = train_bpe(corpus, num_ranks)
    elapsed = time.perf_counter() - start
    save_ranks(ranks, args.out)

    tokenizer = TiktokenTokenizer.from_ranks_file(args.out, name=SHIPPED_BPE_NAME)
    held_out = list(generate_corpus(args.seed + 1, scale=0.05))
    corpus_mb = sum(len(t.encode("utf-8")) for t in corpus) / 1e6
    print(
        f"{len(ranks)} ranks + {len(CHAT_SPECIAL_TOKENS)} specials = vocab {tokenizer.vocab_size}; "
        f"corpus {corpus_mb:.2f} MB; trained in {elapsed:.1f} s; "
        f"held-out compression {bytes_per_token(tokenizer, held_out):.2f} bytes/token; wrote {args.out}"
    )


if __name__ == "__main__":
    main()
