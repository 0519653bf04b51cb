"""Tokenizers: the shipped BPE, the HF wrapper, rank files, and the BPE trainer of scripts/train_bpe.py."""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import tiktoken
import tiktoken.load

from longstraw_agents.tokenizer import (
    CHAT_SPECIAL_TOKENS,
    CONTROL_TOKENS,
    ENDOFTEXT,
    IM_END,
    IM_START,
    PRETOKENIZE_PATTERN,
    TAG_TOKENS,
    HFTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    load_ranks,
    load_tokenizer,
    oniguruma_pattern,
    save_ranks,
    shipped_ranks_path,
)

REPO = Path(__file__).resolve().parents[1]

TRICKY_TEXTS = [
    "",
    " ",
    "\n\n\n",
    "\x00\x01\x7f",
    "tabs\tand\r\nnewlines\r",
    "naïve café — “quotes” ½ ²",
    "日本語のテキストと中文",
    "emoji 👩‍👩‍👧 🎉 flags 🇳🇴",
    "combining e\u0301 and zero\u200bwidth",
    "    indented code\n        deeper",
    '{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}',
    "a" * 3000,
]


def _random_text(rng: random.Random, length: int) -> str:
    ranges = [(0x00, 0x7F), (0x80, 0x24F), (0x370, 0x3FF), (0x4E00, 0x4FFF), (0x1F300, 0x1F64F), (0xE000, 0xE0FF)]
    chars = []
    for _ in range(length):
        lo, hi = rng.choice(ranges)
        chars.append(chr(rng.randint(lo, hi)))
    return "".join(chars)


@pytest.fixture(scope="module")
def shipped() -> TiktokenTokenizer:
    tokenizer = load_tokenizer()
    assert isinstance(tokenizer, TiktokenTokenizer)
    return tokenizer


@pytest.fixture(scope="module")
def train_bpe_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_bpe", REPO / "scripts" / "train_bpe.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------------------------------------------------
# The shipped BPE
# --------------------------------------------------------------------------------------------------------------------


def test_shipped_tokenizer_identity_and_specials(shipped: TiktokenTokenizer) -> None:
    assert isinstance(shipped, Tokenizer)
    assert shipped.name == "longstraw-bpe-v1"
    assert shipped.vocab_size == 2048
    num_ranks = len(load_ranks(shipped_ranks_path()))
    assert num_ranks == 2048 - len(CHAT_SPECIAL_TOKENS)
    assert shipped.special_tokens == {token: num_ranks + i for i, token in enumerate(CHAT_SPECIAL_TOKENS)}
    assert shipped.eos_token_id == shipped.special_token_id(IM_END)
    assert shipped.pad_token_id == shipped.special_token_id(ENDOFTEXT)


def test_load_tokenizer_aliases_and_errors(tmp_path: Path) -> None:
    assert load_tokenizer("longstraw-bpe") is load_tokenizer("longstraw-bpe-v1")
    with pytest.raises(ValueError, match="longstraw-bpe"):
        load_tokenizer("gpt2")
    with pytest.raises(ValueError, match="local directory"):
        load_tokenizer(str(tmp_path / "missing"))


@pytest.mark.parametrize("allow_special", [False, True])
def test_shipped_round_trips_tricky_and_random_unicode(shipped: TiktokenTokenizer, allow_special: bool) -> None:
    rng = random.Random(1234)
    texts = TRICKY_TEXTS + [_random_text(rng, rng.randint(1, 200)) for _ in range(200)]
    for text in texts:
        ids = shipped.encode(text, allow_special=allow_special)
        assert all(0 <= i < shipped.vocab_size for i in ids)
        assert shipped.decode(ids) == text


def test_every_byte_is_a_token_and_partial_utf8_decodes_with_replacement(shipped: TiktokenTokenizer) -> None:
    ranks = load_ranks(shipped_ranks_path())
    assert all(bytes([b]) in ranks for b in range(256))
    first_byte_of_euro = ranks["€".encode()[:1]]
    assert shipped.decode([first_byte_of_euro]) == "\ufffd"
    assert shipped.decode(np.array(shipped.encode("ok"), dtype=np.int32)) == "ok"


def test_control_strings_are_text_unless_allowed_and_tags_are_always_their_ids(shipped: TiktokenTokenizer) -> None:
    assert shipped.tags == set(TAG_TOKENS) and set(CONTROL_TOKENS) | set(TAG_TOKENS) == set(shipped.special_tokens)
    text = f"doc says {IM_END} and <tool_call>{{}}</tool_call>"
    plain = shipped.encode(text)
    assert set(plain) & set(shipped.special_tokens.values()) == {
        shipped.special_token_id("<tool_call>"),
        shipped.special_token_id("</tool_call>"),
    }
    assert plain[-4:] == [shipped.special_token_id("<tool_call>"), *shipped.encode("{}"), plain[-1]]
    assert shipped.decode(plain) == text
    allowed = shipped.encode(text, allow_special=True)
    assert shipped.eos_token_id in allowed
    assert shipped.special_token_id("<tool_call>") in allowed
    assert shipped.encode(IM_START + IM_END, allow_special=True) == [
        shipped.special_token_id(IM_START),
        shipped.eos_token_id,
    ]


def test_special_token_id_and_decode_errors(shipped: TiktokenTokenizer) -> None:
    with pytest.raises(KeyError, match=r"<\|im_end\|>"):  # the message lists the known special tokens
        shipped.special_token_id("<|unknown|>")
    with pytest.raises(ValueError, match="out of range"):
        shipped.decode([0, shipped.vocab_size])
    with pytest.raises(ValueError, match="out of range"):
        shipped.decode([-1])


def test_shipped_compression_on_generated_text(shipped: TiktokenTokenizer, train_bpe_script: ModuleType) -> None:
    held_out = list(train_bpe_script.generate_corpus(seed=99, scale=0.02))
    assert train_bpe_script.bytes_per_token(shipped, held_out) > 3.0
    # Byte-level fallback is far worse: the learned merges do real work.
    raw = TiktokenTokenizer(
        tiktoken.Encoding(
            name="bytes",
            pat_str=PRETOKENIZE_PATTERN,
            mergeable_ranks={bytes([b]): b for b in range(256)},
            special_tokens={IM_END: 256},
        )
    )
    assert train_bpe_script.bytes_per_token(raw, held_out) < 1.2


def test_shipped_file_is_a_valid_tiktoken_rank_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # "" disables tiktoken's on-disk cache
    assert tiktoken.load.load_tiktoken_bpe(str(shipped_ranks_path())) == load_ranks(shipped_ranks_path())


def test_agent_side_imports_without_torch_or_transformers() -> None:
    code = (
        "import sys, longstraw_agents.tokenizer, longstraw_agents.chat, longstraw_agents.drift\n"
        "longstraw_agents.tokenizer.load_tokenizer().encode('hi')\n"
        "heavy = {'torch', 'transformers'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------------------------------------------------
# Rank files
# --------------------------------------------------------------------------------------------------------------------


def test_save_and_load_ranks_round_trip(tmp_path: Path) -> None:
    ranks = {bytes([b]): b for b in range(256)} | {b"ab": 256, b"\xff\x00": 257}
    path = tmp_path / "r.tiktoken"
    save_ranks(ranks, path)
    assert load_ranks(path) == ranks


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"not-base64!! 0\n", "expected 'base64-token rank'"),
        (b"YQ== 0 extra\n", "expected 'base64-token rank'"),
        (b"YQ== 1\n", "ranks must be exactly"),
        (b"YQ== 0\n", "all 256 single bytes"),
    ],
)
def test_load_ranks_rejects_bad_files(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.tiktoken"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        load_ranks(path)


# --------------------------------------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------------------------------------

TINY_CORPUS = ["low lower lowest newer newest wider", "the lowest newest low", f"{IM_START}user\nlow{IM_END}"] * 20


def test_train_bpe_learns_consistent_ranks(train_bpe_script: ModuleType, tmp_path: Path) -> None:
    ranks = train_bpe_script.train_bpe(TINY_CORPUS, num_ranks=270)
    assert len(ranks) == 270
    assert sorted(ranks.values()) == list(range(270))
    assert b" lowest" in ranks and b" newest" in ranks
    by_rank = {rank: token for token, rank in ranks.items()}
    for rank in range(256, 270):  # every merged token is two earlier tokens joined
        token = by_rank[rank]
        assert any(
            ranks.get(token[:cut], rank) < rank and ranks.get(token[cut:], rank) < rank for cut in range(1, len(token))
        ), token
    assert not any(b"im_" in token for token in ranks), "special-token strings must not be learned"

    path = tmp_path / "tiny.tiktoken"
    save_ranks(ranks, path)
    tokenizer = TiktokenTokenizer.from_ranks_file(path, name="tiny")
    assert tokenizer.vocab_size == 270 + len(CHAT_SPECIAL_TOKENS)
    text = "the newest lowest wider ünïcode 42"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert len(tokenizer.encode("lowest newest")) < len(b"lowest newest")


def test_train_bpe_is_deterministic_and_stops_at_min_frequency(train_bpe_script: ModuleType) -> None:
    first = train_bpe_script.train_bpe(TINY_CORPUS, num_ranks=300)
    assert train_bpe_script.train_bpe(TINY_CORPUS, num_ranks=300) == first
    sparse = train_bpe_script.train_bpe(["abcd efgh"], num_ranks=300, min_frequency=2)
    assert len(sparse) == 256  # every pair occurs once: nothing is worth merging
    assert len(train_bpe_script.train_bpe(["abcd efgh"], num_ranks=300, min_frequency=1)) > 256
    with pytest.raises(ValueError, match="at least 256"):
        train_bpe_script.train_bpe(TINY_CORPUS, num_ranks=100)


def test_generated_corpus_is_deterministic_and_covers_every_kind(train_bpe_script: ModuleType) -> None:
    corpus = list(train_bpe_script.generate_corpus(seed=3, scale=0.01))
    assert corpus == list(train_bpe_script.generate_corpus(seed=3, scale=0.01))
    assert corpus != list(train_bpe_script.generate_corpus(seed=4, scale=0.01))
    text = "\n".join(corpus)
    for marker in ("# Document", "Problem:", "def test_", '"name": "calculator"', IM_START, "<tool_response>"):
        assert marker in text


# --------------------------------------------------------------------------------------------------------------------
# The shipped BPE saved for transformers
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shipped_for_transformers(shipped: TiktokenTokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("shipped_hf")
    shipped.save_pretrained(path)
    return path


def conversion_texts(train_bpe_script: ModuleType) -> list[str]:
    """Text where a converted BPE could part from tiktoken: the project's generated documents, chat transcripts
    with their control tokens, numbers (tiktoken splits digits in threes), contractions, runs of whitespace of
    every kind, special-token look-alikes and random unicode."""
    rng = random.Random(21)
    pieces = [
        *CHAT_SPECIAL_TOKENS, "<|im", "_end|>", "<tool", "|>", "1234567", "3.14159", "10,000", "'s", "'LL", "don't",
        " ", "  ", "   \n", "\t\t", "\r\n", "\n\n\n", "\u00a0", "\u3000", "\u200b", "word", " Word", "日本語",
        "naïve", "e\u0301", "🎉", "👩‍👩‍👧", "{\"a\": [1, 2]}", "    def f(x):", "!!!", "...", "__init__",
    ]  # fmt: skip
    mixed = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 40))) for _ in range(400)]
    randoms = [_random_text(rng, rng.randint(1, 120)) for _ in range(200)]
    generated = list(train_bpe_script.generate_corpus(seed=5, scale=0.01))
    return TRICKY_TEXTS + generated + mixed + randoms


def test_the_shipped_bpe_saved_for_transformers_encodes_and_decodes_token_for_token(
    shipped: TiktokenTokenizer, shipped_for_transformers: Path, train_bpe_script: ModuleType
) -> None:
    from transformers import AutoTokenizer

    converted = AutoTokenizer.from_pretrained(shipped_for_transformers, local_files_only=True)
    assert len(converted) == shipped.vocab_size
    assert (converted.eos_token, converted.pad_token) == (IM_END, ENDOFTEXT)
    assert {t: converted.convert_tokens_to_ids(t) for t in CHAT_SPECIAL_TOKENS} == shipped.special_tokens
    for text in conversion_texts(train_bpe_script):
        with_specials = shipped.encode(text, allow_special=True)
        assert converted.encode(text, add_special_tokens=False) == with_specials, text
        assert converted.encode(text, add_special_tokens=False, split_special_tokens=True) == shipped.encode(text)
        assert converted.decode(with_specials) == shipped.decode(with_specials) == text
    rng = random.Random(5)  # any ids: cut UTF-8 sequences decode to the same replacement characters
    for _ in range(500):
        ids = [rng.randrange(shipped.vocab_size) for _ in range(rng.randint(1, 12))]
        assert converted.decode(ids) == shipped.decode(ids), ids


def test_the_saved_bpe_loads_as_the_same_tokenizer_of_the_protocol(
    shipped: TiktokenTokenizer, shipped_for_transformers: Path
) -> None:
    loaded = load_tokenizer(str(shipped_for_transformers))
    assert isinstance(loaded, HFTokenizer)
    assert loaded.vocab_size == shipped.vocab_size and loaded.special_tokens == shipped.special_tokens
    assert (loaded.eos_token_id, loaded.pad_token_id) == (shipped.eos_token_id, shipped.pad_token_id)
    text = f"{IM_START}user\nWhat is 12 + 345?{IM_END}\n<tool_call>{{}}</tool_call>  \n\n"
    for allow_special in (False, True):
        assert loaded.encode(text, allow_special=allow_special) == shipped.encode(text, allow_special=allow_special)


def test_possessive_intervals_become_atomic_groups_for_oniguruma() -> None:
    assert oniguruma_pattern(r"\p{N}{1,3}+|a{2}+|[x\]]{1,}+|\p{L}++|\s?+") == (
        r"(?>\p{N}{1,3})|(?>a{2})|(?>[x\]]{1,})|\p{L}++|\s?+"
    )
    with pytest.raises(ValueError, match="after a group"):
        oniguruma_pattern(r"(ab){1,3}+")


# --------------------------------------------------------------------------------------------------------------------
# Hugging Face
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level BPE saved the way a Hub checkpoint is: chat specials special, tool tags added (as Qwen)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(TINY_CORPUS + TRICKY_TEXTS, trainer=trainer)
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in CHAT_SPECIAL_TOKENS[3:]])
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=ENDOFTEXT, pad_token=ENDOFTEXT)
    path = tmp_path_factory.mktemp("hf_tokenizer")
    fast.save_pretrained(path)
    return path


def test_hf_tokenizer_follows_the_protocol(hf_dir: Path) -> None:
    tokenizer = load_tokenizer(str(hf_dir))
    assert isinstance(tokenizer, HFTokenizer) and isinstance(tokenizer, Tokenizer)
    assert tokenizer.name == str(hf_dir)
    assert set(tokenizer.special_tokens) == set(CHAT_SPECIAL_TOKENS)
    assert tokenizer.eos_token_id == tokenizer.special_token_id(IM_END)  # end of turn, not the checkpoint's eos
    assert tokenizer.pad_token_id == tokenizer.special_token_id(ENDOFTEXT)
    assert tokenizer.vocab_size == max(tokenizer.special_tokens.values()) + 1
    with pytest.raises(KeyError, match=r"<\|im_start\|>"):
        tokenizer.special_token_id("<s>")


def test_hf_tokenizer_encodes_specials_only_when_allowed_and_its_other_added_tokens_always(hf_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = HFTokenizer(hf_dir)
    text = f"a document with {IM_END} and <tool_call>{{}}</tool_call> inside"
    plain = tokenizer.encode(text)
    tags = {tokenizer.special_token_id("<tool_call>"), tokenizer.special_token_id("</tool_call>")}
    assert set(plain) & set(tokenizer.special_tokens.values()) == tags  # the non-special added tags, as Qwen's
    assert tokenizer.decode(plain) == text
    hf = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    assert plain == hf.encode(text, add_special_tokens=False, split_special_tokens=True)
    allowed = tokenizer.encode(text, allow_special=True)
    assert tokenizer.eos_token_id in allowed and tokenizer.special_token_id("<tool_call>") in allowed
    assert tokenizer.decode(allowed) == text
    for sample in TRICKY_TEXTS:
        assert tokenizer.decode(tokenizer.encode(sample)) == sample


def test_hf_tokenizer_errors(tmp_path: Path, hf_dir: Path) -> None:
    with pytest.raises(FileNotFoundError, match="local files only"):
        HFTokenizer(tmp_path / "missing")
    with pytest.raises(ValueError, match="out of range"):
        HFTokenizer(hf_dir).decode([10**6])


def test_hf_tokenizer_drives_the_chat_formatter_without_drift(hf_dir: Path) -> None:
    from longstraw_agents.chat import ChatFormatter
    from longstraw_agents.drift import check_trajectory

    tokenizer = HFTokenizer(hf_dir)
    chat = ChatFormatter(tokenizer)
    messages = [
        {"role": "user", "content": "the lowest newest"},
        {"role": "assistant", "content": "<tool_call>\n{}\n</tool_call>"},
        {"role": "tool", "content": "wider"},
    ]
    trajectory = chat.render_messages(messages)
    assert check_trajectory(tokenizer, trajectory).ok
    assert trajectory.segments[-1].token_ids.tolist().count(tokenizer.special_token_id("<tool_response>")) == 1
    assert chat.stop_token_ids == (tokenizer.eos_token_id, tokenizer.special_token_id(ENDOFTEXT))
