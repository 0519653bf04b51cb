"""The text of each token: byte-level pieces that concatenate to the decoded text, per-id decoding, ids without a
tokenizer."""

from __future__ import annotations

import numpy as np

from longstraw_agents.tokenizer import load_tokenizer
from longstraw_agents.viewer.tokens import ByteLevelText, DecodedText, IdText, token_text

TEXT = "naïve 中文 🦙🎉 <answer>12</answer>\n\tend"


def test_byte_level_pieces_concatenate_to_the_decoded_text() -> None:
    tokenizer = load_tokenizer()
    ids = np.asarray(tokenizer.encode(TEXT, allow_special=True))
    pieces = ByteLevelText(tokenizer).texts(ids)
    assert len(pieces) == len(ids) and "".join(pieces) == tokenizer.decode(ids) == TEXT
    assert all("\ufffd" not in piece for piece in pieces)  # a character split over tokens is shown once
    assert "<answer>" in pieces


def test_a_range_cut_inside_a_character_and_unknown_ids() -> None:
    tokenizer = load_tokenizer()
    llama = np.asarray(tokenizer.encode("🦙"))
    text = ByteLevelText(tokenizer)
    assert len(llama) == 4 and text.texts(llama) == ["", "", "", "🦙"]
    # a range that ends inside a character: a replacement mark on its last token, not an error
    assert text.texts(llama[:2]) == ["", "\ufffd"]
    known = np.asarray(tokenizer.encode("ab"))
    shown = text.texts(np.asarray([*known, 10**6, *known]))
    assert shown == [*text.texts(known), "⟨1000000⟩", *text.texts(known)]
    assert DecodedText(tokenizer).texts(np.asarray([10**6])) == ["⟨1000000⟩"]


def test_each_id_decoded_on_its_own_for_other_tokenizers() -> None:
    tokenizer = load_tokenizer()
    ids = np.asarray(tokenizer.encode("plain words, 42"))
    assert DecodedText(tokenizer).texts(ids) == [tokenizer.decode([int(i)]) for i in ids]


def test_without_a_tokenizer_tokens_show_their_ids_and_the_reason() -> None:
    assert IdText("why").texts(np.asarray([3, 70])) == ["⟨3⟩", "⟨70⟩"]
    missing = token_text(None)
    assert isinstance(missing, IdText) and "names no tokenizer" in missing.describe()
    unknown = token_text("/no/such/tokenizer")
    assert isinstance(unknown, IdText) and "unknown tokenizer" in unknown.describe()
    assert isinstance(token_text("longstraw-bpe-v1"), ByteLevelText)
