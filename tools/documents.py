"""Document search over a local corpus: ``search_documents`` (BM25, ids + titles + snippets) and ``open_document``.

A `Corpus` is built per episode (NeedleSearch generates one), so the tools are made by `make_document_tools`,
bound to that corpus. Search returns short snippets and ids; open returns the whole document: that is how an
episode's context grows long.
"""

from __future__ import annotations

import difflib
import heapq
import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field

from .function import Tool, tool
from .result import ToolFailure, preview

MAX_SEARCH_RESULTS = 20
MAX_QUERY_CHARS = 1_000
MAX_DOCUMENT_ID_CHARS = 200
SNIPPET_CHARS = 200
DEFAULT_MAX_DOCUMENT_CHARS = 100_000
"""open_document's output cap: whole documents are the point, so it is five times the default tool cap."""

_WORD = re.compile(r"\w+")


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens (Unicode ``\\w+``)."""
    return _WORD.findall(text.lower())


@dataclass(frozen=True)
class Document:
    id: str
    title: str
    text: str

    def __post_init__(self) -> None:
        for name in ("id", "title", "text"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"Document.{name} must be a string, got {type(getattr(self, name)).__name__}")
        if not self.id or any(char.isspace() for char in self.id):
            raise ValueError(f"document ids must be non-empty and contain no whitespace, got {self.id!r}")


@dataclass(frozen=True)
class SearchHit:
    doc_id: str
    title: str
    score: float
    snippet: str


class Corpus:
    """Documents with a BM25 index over their titles and texts (Robertson & Zaragoza's Okapi BM25)."""

    def __init__(self, documents: Iterable[Document | Mapping[str, Any]], *, k1: float = 1.2, b: float = 0.75) -> None:
        self.k1, self.b = k1, b
        self._documents: list[Document] = []
        self._index_of: dict[str, int] = {}
        self._postings: dict[str, list[tuple[int, int]]] = {}  # term → [(document index, term frequency)]
        self._lengths: list[int] = []
        for item in documents:
            self._add(item if isinstance(item, Document) else Document(**item))
        self._mean_length = sum(self._lengths) / len(self._lengths) if self._lengths else 0.0

    def _add(self, document: Document) -> None:
        if document.id in self._index_of:
            raise ValueError(f"duplicate document id {document.id!r}")
        index = len(self._documents)
        self._index_of[document.id] = index
        self._documents.append(document)
        counts = Counter(tokenize(document.title) + tokenize(document.text))
        self._lengths.append(sum(counts.values()))
        for term, frequency in counts.items():
            self._postings.setdefault(term, []).append((index, frequency))

    def __len__(self) -> int:
        return len(self._documents)

    def __iter__(self) -> Iterator[Document]:
        return iter(self._documents)

    def __contains__(self, doc_id: object) -> bool:
        return isinstance(doc_id, str) and doc_id in self._index_of

    def __getitem__(self, doc_id: str) -> Document:
        return self._documents[self._index_of[doc_id]]

    def get(self, doc_id: str) -> Document | None:
        return self[doc_id] if doc_id in self else None

    @property
    def ids(self) -> list[str]:
        return [document.id for document in self._documents]

    def search(self, query: str, k: int = 5) -> list[SearchHit]:
        """The ``k`` best documents for ``query`` by BM25, ties in corpus order; those sharing no term are left out."""
        terms = set(tokenize(query))
        scores = self._scores(terms)
        best = heapq.nlargest(k, scores.items(), key=lambda item: (item[1], -item[0]))
        return [self._hit(index, score, terms) for index, score in best]

    def _scores(self, terms: set[str]) -> dict[int, float]:
        scores: dict[int, float] = {}
        n_documents = len(self._documents)
        for term in terms:
            postings = self._postings.get(term, [])
            idf = math.log(1 + (n_documents - len(postings) + 0.5) / (len(postings) + 0.5))
            for index, frequency in postings:
                norm = self.k1 * (1 - self.b + self.b * self._lengths[index] / self._mean_length)
                scores[index] = scores.get(index, 0.0) + idf * frequency * (self.k1 + 1) / (frequency + norm)
        return scores

    def _hit(self, index: int, score: float, terms: set[str]) -> SearchHit:
        document = self._documents[index]
        return SearchHit(document.id, document.title, score, snippet(document.text, terms))


def snippet(text: str, terms: Iterable[str], width: int = SNIPPET_CHARS) -> str:
    """About ``width`` characters of ``text`` around the first occurrence of any of ``terms``, on one line."""
    pattern = "|".join(re.escape(term) for term in sorted(terms, key=len, reverse=True))
    match = re.search(rf"\b(?:{pattern})\b", text, flags=re.IGNORECASE) if pattern else None
    start = max(0, match.start() - width // 4) if match else 0
    end = min(len(text), start + width)
    piece = " ".join(text[start:end].split())
    return f"{'…' if start > 0 else ''}{piece}{'…' if end < len(text) else ''}"


def make_document_tools(corpus: Corpus, *, max_document_chars: int = DEFAULT_MAX_DOCUMENT_CHARS) -> list[Tool]:
    """``[search_documents, open_document]`` bound to ``corpus``."""

    def search_documents(
        query: Annotated[str, Field(max_length=MAX_QUERY_CHARS)],
        k: Annotated[int, Field(ge=1, le=MAX_SEARCH_RESULTS)] = 5,
    ) -> str:
        """Search the documents by keywords; returns the best matches, each with its id, title and a snippet.

        Args:
            query: Keywords to look for, e.g. "lighthouse keeper 1887".
            k: How many results to return.
        """
        if not tokenize(query):
            raise ToolFailure(f"the query {preview(query)} has no words to search for", kind="bad_arguments")
        hits = corpus.search(query, k)
        if not hits:
            return f"No documents match {preview(query)}. Try other keywords."
        lines = [f"Top {len(hits)} documents for {preview(query)}:"]
        for rank, hit in enumerate(hits, start=1):
            lines += [f"{rank}. {hit.doc_id} — {hit.title}", f"   {hit.snippet}"]
        return "\n".join(lines)

    def open_document(doc_id: Annotated[str, Field(max_length=MAX_DOCUMENT_ID_CHARS)]) -> str:
        """Return the full text of one document.

        Args:
            doc_id: The id of the document, as listed by search_documents.
        """
        document = corpus.get(doc_id)
        if document is None:
            raise ToolFailure(_unknown_document_message(corpus, doc_id), kind="bad_arguments")
        return f"[{document.id}] {document.title}\n\n{document.text}"

    return [tool(search_documents), tool(open_document, max_output_chars=max_document_chars)]


def _unknown_document_message(corpus: Corpus, doc_id: str) -> str:
    close = difflib.get_close_matches(doc_id, corpus.ids, n=3)
    suggestion = f" (did you mean {', '.join(close)}?)" if close else ""
    return f"no document with id {preview(doc_id)}{suggestion}. Use search_documents to find document ids."
