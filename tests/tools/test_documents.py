"""`Corpus` (BM25) and the ``search_documents`` / ``open_document`` tools (tools/documents.py)."""

from __future__ import annotations

import math
import re

import pytest

from longstraw_agents.tools import Corpus, Document, ToolRegistry, make_document_tools
from longstraw_agents.tools.documents import snippet, tokenize

DOCUMENTS = [
    Document("doc-001", "The lighthouse at Grey Point", "Keeper Ada Lind lit the lighthouse lamp every night in 1887."),
    Document("doc-002", "Harbour records", "The harbour master logged ships. The lighthouse is mentioned once."),
    Document("doc-003", "Orchard notes", "Apples, pears and plums grew in the orchard behind the mill."),
    Document("doc-004", "Lighthouse lamps", "Lighthouse lamps burned whale oil; later lighthouse lamps used kerosene."),
]


@pytest.fixture
def corpus() -> Corpus:
    return Corpus(DOCUMENTS)


@pytest.fixture
def tools(corpus: Corpus) -> ToolRegistry:
    return ToolRegistry(make_document_tools(corpus, max_document_chars=50_000))


def test_tokenize() -> None:
    assert tokenize("Keeper's lamp, 1887 — Café!") == ["keeper", "s", "lamp", "1887", "café"]


def test_bm25_ranks_by_term_frequency_and_rarity(corpus: Corpus) -> None:
    hits = corpus.search("lighthouse lamps", k=10)
    assert [hit.doc_id for hit in hits] == ["doc-004", "doc-001", "doc-002"]  # doc-003 shares no term
    assert hits[0].score > hits[1].score > hits[2].score > 0
    assert [hit.doc_id for hit in corpus.search("orchard", k=2)] == ["doc-003"]
    assert corpus.search("submarine") == []


def test_bm25_matches_the_formula() -> None:
    corpus = Corpus([Document("a", "", "x x y"), Document("b", "", "y z")], k1=1.2, b=0.75)
    mean_length = 2.5
    idf = math.log(1 + (2 - 1 + 0.5) / (1 + 0.5))
    expected = idf * 2 * 2.2 / (2 + 1.2 * (1 - 0.75 + 0.75 * 3 / mean_length))
    [hit] = corpus.search("x")
    assert hit.doc_id == "a" and hit.score == pytest.approx(expected)


def test_ties_keep_corpus_order() -> None:
    corpus = Corpus([Document(f"d{i}", "same", "same words") for i in range(5)])
    assert [hit.doc_id for hit in corpus.search("same", k=3)] == ["d0", "d1", "d2"]


def test_snippet_centres_on_a_query_term() -> None:
    text = "filler " * 100 + "the needle is here " + "filler " * 100
    piece = snippet(text, {"needle"}, width=60)
    assert "needle" in piece and piece.startswith("…") and piece.endswith("…") and len(piece) <= 62
    assert snippet("short text", {"absent"}) == "short text"


def test_corpus_container_api(corpus: Corpus) -> None:
    assert len(corpus) == 4 and "doc-003" in corpus and "doc-999" not in corpus and 3 not in corpus
    assert corpus["doc-002"].title == "Harbour records" and corpus.get("nope") is None
    assert corpus.ids == [document.id for document in corpus]
    assert Corpus([{"id": "m", "title": "From a mapping", "text": "ok"}])["m"].text == "ok"


def test_corpus_rejects_bad_documents() -> None:
    with pytest.raises(ValueError, match="duplicate document id"):
        Corpus([Document("a", "", ""), Document("a", "", "")])
    with pytest.raises(ValueError, match="whitespace"):
        Document("has space", "", "")
    with pytest.raises(TypeError, match="must be a string"):
        Document("a", "", None)  # type: ignore[arg-type]


def test_search_tool_lists_ids_titles_and_snippets(tools: ToolRegistry) -> None:
    [result] = tools.execute_text(
        '<tool_call>{"name": "search_documents", "arguments": {"query": "lighthouse keeper", "k": 2}}</tool_call>'
    )
    assert result.ok
    lines = result.content.splitlines()
    assert lines[0] == "Top 2 documents for 'lighthouse keeper':"
    assert re.fullmatch(r"1\. doc-001 — The lighthouse at Grey Point", lines[1])
    assert "Keeper Ada Lind" in lines[2]
    assert lines[3].startswith("2. doc-004 — ")


def test_search_tool_edge_cases(tools: ToolRegistry) -> None:
    none = tools.call({"name": "search_documents", "arguments": {"query": "submarine"}})
    assert none.ok and none.content == "No documents match 'submarine'. Try other keywords."
    empty = tools.call({"name": "search_documents", "arguments": {"query": " ,;! "}})
    assert empty.error == "bad_arguments" and "no words to search for" in empty.content
    too_many = tools.call({"name": "search_documents", "arguments": {"query": "lamp", "k": 500}})
    assert too_many.error == "bad_arguments" and "less than or equal to 20" in too_many.content


def test_open_returns_the_whole_document() -> None:
    long_text = "word " * 8_000  # 40 000 characters: more than the default tool cap of 20 000
    tools = ToolRegistry(make_document_tools(Corpus([Document("long", "A long one", long_text)])))
    result = tools.call({"name": "open_document", "arguments": {"doc_id": "long"}})
    assert result.ok and not result.truncated
    assert result.content == f"[long] A long one\n\n{long_text}"


def test_open_truncates_beyond_its_cap() -> None:
    tools = ToolRegistry(make_document_tools(Corpus([Document("big", "Big", "z" * 500)]), max_document_chars=100))
    result = tools.call({"name": "open_document", "arguments": {"doc_id": "big"}})
    assert (result.error, result.truncated, result.original_length) == ("output_too_large", True, 511)
    assert result.content.endswith("…[truncated 411 characters]")


def test_open_unknown_id_suggests_close_ones(tools: ToolRegistry) -> None:
    result = tools.call({"name": "open_document", "arguments": {"doc_id": "doc-01"}})
    assert result.error == "bad_arguments"
    assert result.content.startswith("Error: no document with id 'doc-01' (did you mean doc-001")
    assert result.content.endswith("Use search_documents to find document ids.")
    far = tools.call({"name": "open_document", "arguments": {"doc_id": "zzz"}})
    assert far.content == "Error: no document with id 'zzz'. Use search_documents to find document ids."
