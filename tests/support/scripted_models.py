"""A tiny Llama that writes a given text, token for token: a random-init model never emits a tool call, so the tests
of the served chat path build one that does.

Its attention and MLP outputs are zero, so the hidden state at a position is the embedding of the token there and
the next token depends on the current one only (a bigram model). Each token of the script gets its own embedding
direction and the output head maps it to the next token with a margin of hundreds of nats: sampled at any
temperature up to a few, the script is what comes out, on any CPU. A text whose usual tokens repeat with different
successors (``":`` twice in a tool call) is spelled with other tokens of the vocabulary, every one used once
(``distinct_spelling``): decoding gives the same text.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from longstraw_agents.models.presets import tiny_model
from longstraw_agents.tokenizer import Tokenizer

WEIGHT = 40.0
"""The next token's output weight along its predecessor's direction (where the normalised state is sqrt(hidden))."""


SEARCH_STEPS = 100_000
"""How many positions ``distinct_spelling`` tries before it gives up (a text with many quotes has no spelling, and
proving it takes exponential time)."""


def distinct_spelling(tokenizer: Tokenizer, text: str, taken: Sequence[int] = ()) -> list[int]:
    """Ids that decode to ``text`` with no id twice and none of ``taken`` (special tokens are never used, so
    ``text`` holds plain text only). Depth-first over the vocabulary's tokens that match at each position, longest
    first; a ``ValueError`` when none is found within ``SEARCH_STEPS``."""
    pieces = _plain_pieces(tokenizer)
    used = set(taken)
    steps = 0

    def spell(start: int) -> list[int] | None:
        nonlocal steps
        if start == len(text):
            return []
        steps += 1
        if steps > SEARCH_STEPS:
            return None
        for piece, token in pieces:
            if token not in used and text.startswith(piece, start):
                used.add(token)
                rest = spell(start + len(piece))
                if rest is not None:
                    return [token, *rest]
                used.discard(token)
        return None

    ids = spell(0)
    if ids is None:
        raise ValueError(f"no spelling of {text!r} uses each token once")
    return ids


def _plain_pieces(tokenizer: Tokenizer) -> list[tuple[str, int]]:
    """Every ordinary token whose text decodes on its own, longest first."""
    special = set(tokenizer.special_tokens.values())
    pieces = []
    for token in range(tokenizer.vocab_size):
        piece = tokenizer.decode([token])
        if token not in special and piece and "\ufffd" not in piece:
            pieces.append((piece, token))
    return sorted(pieces, key=lambda item: -len(item[0]))


def scripted_llama(vocab_size: int, script: Sequence[int], *, hidden: int = 64) -> torch.nn.Module:
    """A tiny Llama that, after ``script[k]``, writes ``script[k + 1]`` (ids once each, at most ``hidden`` of them
    with a successor); after any other token its next-token distribution is uniform."""
    if len(set(script)) != len(script):
        raise ValueError("a bigram script needs every id once (spell the text with distinct_spelling)")
    if len(script) - 1 > hidden:
        raise ValueError(f"{len(script) - 1} scripted steps need hidden >= {len(script) - 1}")
    model = tiny_model("llama", vocab_size=vocab_size, hidden=hidden, layers=1)
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for k, (token, successor) in enumerate(zip(script[:-1], script[1:], strict=True)):
            model.model.embed_tokens.weight[token, k] = 1.0
            model.lm_head.weight[successor, k] = WEIGHT
    return model
