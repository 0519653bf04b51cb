"""The generated world of ``LongStraw/NeedleSearch-v0``: places and people, documents about them, and questions.

Each documented entity has facts (a place: its founding year and population; a person: their birth year) that
its own document states exactly once, in one fixed phrasing ("... was founded in 1611."). A question combines such
facts from several documents ("How many years passed between the founding of Harrowgate and the birth of Ilse
Marrow?"), so it needs several searches and several opened documents.

The documents a question needs ("needle documents") are long: their facts sit at random depths inside paragraphs
of filler that is full of other years, numbers and names, written to about ``document_tokens`` tokens each; this
is how an episode reaches its target length. The other documents are short distractors with their own facts of
the same kinds. Filler only mentions minor names that have no document of their own, so a search for a
documented name finds that entity's document. Generation draws its random numbers in vectorised blocks and
builds text with ``join``: a million-token corpus takes about a second.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from longstraw_agents.tools import Corpus, Document

QuestionKind = Literal["founding_to_birth", "total_population", "founding_span"]
QUESTION_KINDS: tuple[QuestionKind, ...] = ("founding_to_birth", "total_population", "founding_span")

_PREFIXES = (
    "Ash", "Bel", "Cor", "Dal", "Eld", "Fen", "Gar", "Hal", "Ivel", "Jor", "Kel", "Lor", "Mar", "Nor", "Orm",
    "Pel", "Quin", "Ros", "Sel", "Tam", "Ul", "Ver", "Wyn", "Yar", "Zel", "Brin", "Cal", "Dun", "Har", "Mor",
)  # fmt: skip
_PLACE_SUFFIXES = ("bridge", "brook", "bury", "field", "gate", "haven", "mere", "moor", "port", "stead", "vale", "wood")
_SURNAME_SUFFIXES = ("by", "dale", "den", "ford", "gard", "holm", "ley", "mont", "ner", "ric", "ston", "wick")
_FIRST_NAMES = (
    "Ada", "Bram", "Cora", "Dmitri", "Elin", "Farah", "Gideon", "Hana", "Ilse", "Jonas", "Kaia", "Leif", "Mira",
    "Nadia", "Osric", "Priya", "Quentin", "Rosa", "Soren", "Talia", "Ugo", "Vera", "Wendell", "Xenia", "Yusuf",
    "Zora", "Anselm", "Beatrix", "Cyrus", "Delphine",
)  # fmt: skip
_PLACE_KINDS = ("town", "village", "port", "market town", "city", "river town")
_REGIONS = ("northern", "southern", "eastern", "western", "central", "coastal", "upland", "lowland")
_OCCUPATIONS = ("cartographer", "merchant", "clockmaker", "physician", "printer", "engineer", "botanist", "sailor")
_GOODS = ("salt", "wool", "timber", "flax", "copper", "barley", "amber", "tea", "linen", "iron")
_LANDMARKS = ("old bridge", "harbour", "clock tower", "mill", "north gate", "chapel", "granary", "lighthouse")
_BUILDINGS = ("warehouse", "school", "guesthouse", "library", "tannery", "bathhouse")
_TRADES = ("weaving", "pottery", "glass", "rope", "clock", "printing")
_ADJECTIVES = ("cold", "wet", "mild", "dry", "windy", "bright")
_TOPICS = ("astronomy", "botany", "navigation", "bookkeeping", "geology", "music")

# Filler about a document's subject {s}. None of them says "founded", "born" or "population": those phrasings
# belong to the facts, so a document states each of its facts exactly once.
_PLACE_FILLER = (
    "In {year}, {person} opened a {trade} workshop near the {landmark} of {s}.",
    "The {landmark} of {s} was repaired in {year} at a cost of {n} silver coins.",
    "Records from {year} list {n} barrels of {goods} shipped from {s} to {place}.",
    "{person} described the winter of {year} in {s} as unusually {adjective}.",
    "A {building} with {k} rooms stood on the {direction} side of {s} until {year}.",
    "The market of {s} in {year} drew traders from {place} with {n} carts of {goods}.",
    "In {year} the council of {s} paid {person} {n} coins to map the {landmark}.",
    "A flood in {year} reached the {landmark} of {s} and ruined {n} sacks of {goods}.",
)
_PERSON_FILLER = (
    "In {year}, {s} travelled to {place} with {n} crates of {goods}.",
    "{s} wrote {n} letters to {person} about the {landmark} of {place} in {year}.",
    "A ledger from {year} shows that {s} bought {n} bales of {goods} in {place}.",
    "{s} and {person} rebuilt the {building} at {place} in {year}.",
    "In {year}, {s} lectured on {topic} to {k} students in {place}.",
    "{person} remembered meeting {s} at the {landmark} of {place} in {year}.",
    "{s} spent the {adjective} summer of {year} sorting {n} bundles of {goods} in {place}.",
)
_DIRECTIONS = ("north", "south", "east", "west")
_VOCABULARY: dict[str, tuple[str, ...]] = {
    "goods": _GOODS,
    "landmark": _LANDMARKS,
    "building": _BUILDINGS,
    "trade": _TRADES,
    "adjective": _ADJECTIVES,
    "topic": _TOPICS,
    "direction": _DIRECTIONS,
}

_SENTENCES_PER_BLOCK = 96
_PARAGRAPH_SENTENCES = (4, 8)  # each paragraph has 4..7 sentences
_DISTRACTOR_FILLER_SENTENCES = (2, 5)
_MINOR_NAMES = 24
MAX_DOCUMENTS = len(_PREFIXES) * len(_PLACE_SUFFIXES) - _MINOR_NAMES
"""Every documented entity needs a unique name from the generated pools."""

CountTokens = Callable[[str], int]


@dataclass(frozen=True)
class Place:
    name: str
    kind: str
    region: str
    founded: int
    population: int

    @property
    def title(self) -> str:
        return f"{self.name} ({self.kind})"


@dataclass(frozen=True)
class Person:
    name: str
    occupation: str
    home: str
    born: int

    @property
    def title(self) -> str:
        return f"{self.name} ({self.occupation})"


Entity = Place | Person


@dataclass(frozen=True)
class Needle:
    """A document the answer needs, and the fact it contributes."""

    doc_id: str
    entity: Entity
    fact: Literal["founded", "population", "born"]

    @property
    def value(self) -> int:
        return int(getattr(self.entity, self.fact))


@dataclass(frozen=True)
class NeedleTask:
    question: str
    answer: int
    kind: QuestionKind
    needles: tuple[Needle, ...]
    """In the order the question names them."""
    corpus: Corpus

    @property
    def longest_document_chars(self) -> int:
        return max(len(document.title) + len(document.text) for document in self.corpus)


# ------------------------------------------------------------------------------------------------------------------
# Names and entities
# ------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Names:
    places: list[str]
    surnames: list[str]
    minor_places: list[str]
    minor_people: list[str]


def _pick(rng: np.random.Generator, options: Sequence[str]) -> str:
    return options[int(rng.integers(len(options)))]


def _draw_names(rng: np.random.Generator, num_documented: int, num_minor: int) -> _Names:
    """Unique place names and surnames (disjoint by their suffixes): ``num_documented`` of each for entities
    that may get a document, ``num_minor`` more for the minor names that filler mentions."""
    places = [p + s for p in _PREFIXES for s in _PLACE_SUFFIXES]
    surnames = [p + s for p in _PREFIXES for s in _SURNAME_SUFFIXES]
    chosen_places = [places[i] for i in rng.permutation(len(places))[: num_documented + num_minor]]
    chosen_surnames = [surnames[i] for i in rng.permutation(len(surnames))[: num_documented + num_minor]]
    minor_people = [f"{_pick(rng, _FIRST_NAMES)} {surname}" for surname in chosen_surnames[num_documented:]]
    return _Names(
        places=chosen_places[:num_documented],
        surnames=chosen_surnames[:num_documented],
        minor_places=chosen_places[num_documented:],
        minor_people=minor_people,
    )


def _place(rng: np.random.Generator, name: str, founded: int | None = None) -> Place:
    return Place(
        name=name,
        kind=_pick(rng, _PLACE_KINDS),
        region=_pick(rng, _REGIONS),
        founded=int(rng.integers(1100, 1850)) if founded is None else founded,
        population=int(rng.integers(400, 250_000)),
    )


def _person(rng: np.random.Generator, surname: str, names: _Names, born: int | None = None) -> Person:
    return Person(
        name=f"{_pick(rng, _FIRST_NAMES)} {surname}",
        occupation=_pick(rng, _OCCUPATIONS),
        home=_pick(rng, names.minor_places),
        born=int(rng.integers(1600, 1990)) if born is None else born,
    )


# ------------------------------------------------------------------------------------------------------------------
# Text
# ------------------------------------------------------------------------------------------------------------------


def _intro(entity: Entity) -> str:
    if isinstance(entity, Place):
        article = "an" if entity.kind[0] in "aeiou" else "a"
        return f"{entity.name} is {article} {entity.kind} in the {entity.region} region."
    return f"{entity.name} was a {entity.occupation} from {entity.home}."


def _fact_sentences(entity: Entity) -> list[str]:
    if isinstance(entity, Place):
        return [
            f"The charter of {entity.name} records that {entity.name} was founded in {entity.founded}.",
            f"At the last census, {entity.name} had a population of {entity.population}.",
        ]
    return [f"{entity.name} was born in {entity.born} in {entity.home}."]


class _FillerWriter:
    """Sentences about one subject, drawn in vectorised blocks (one numpy call per field per block).

    ``people`` and ``places`` are the names the sentences may mention besides the subject.
    """

    def __init__(self, rng: np.random.Generator, entity: Entity, people: Sequence[str], places: Sequence[str]) -> None:
        self._rng = rng
        self._subject = entity.name
        self._templates = _PLACE_FILLER if isinstance(entity, Place) else _PERSON_FILLER
        self._people = people
        self._places = places

    def sentences(self, count: int) -> list[str]:
        rng = self._rng

        def column(options: Sequence[str]) -> list[str]:
            return [options[i] for i in rng.integers(len(options), size=count)]

        columns: dict[str, list[Any]] = {
            "year": rng.integers(1100, 2000, size=count).tolist(),
            "n": rng.integers(2, 5000, size=count).tolist(),
            "k": rng.integers(2, 60, size=count).tolist(),
            "person": column(self._people),
            "place": column(self._places),
            **{field: column(words) for field, words in _VOCABULARY.items()},
        }
        return [
            template.format(s=self._subject, **{field: values[i] for field, values in columns.items()})
            for i, template in enumerate(column(self._templates))
        ]

    def paragraphs(self, count_sentences: int) -> list[list[str]]:
        sentences = self.sentences(count_sentences)
        paragraphs, start = [], 0
        while start < len(sentences):
            size = int(self._rng.integers(*_PARAGRAPH_SENTENCES))
            paragraphs.append(sentences[start : start + size])
            start += size
        return paragraphs


def long_document_text(
    rng: np.random.Generator, entity: Entity, names: _Names, document_tokens: int, count_tokens: CountTokens
) -> str:
    """An intro, then filler paragraphs up to about ``document_tokens`` tokens, with each fact at a random depth
    past the first paragraph (so that no search snippet shows it). The filler mentions minor names only."""
    writer = _FillerWriter(rng, entity, names.minor_people, names.minor_places)
    intro = _intro(entity)
    body: list[list[str]] = []
    tokens = count_tokens(intro)
    while tokens < document_tokens:
        for paragraph in writer.paragraphs(_SENTENCES_PER_BLOCK):
            body.append(paragraph)
            tokens += count_tokens(" ".join(paragraph)) + 1  # + the paragraph break
            if tokens >= document_tokens:
                break
    for fact in _fact_sentences(entity):
        if not body:
            body.append([])
        paragraph = body[int(rng.integers(min(1, len(body) - 1), len(body)))]
        paragraph.insert(int(rng.integers(len(paragraph) + 1)), fact)
    return "\n\n".join([intro, *(" ".join(paragraph) for paragraph in body)])


def short_document_text(rng: np.random.Generator, entity: Entity, names: _Names, documented: Sequence[Entity]) -> str:
    """A distractor: intro, facts and a few sentences that may mention documented names too (so that a search
    for a name also finds documents that merely mention it)."""
    people = [*names.minor_people, *(e.name for e in documented if isinstance(e, Person) and e != entity)]
    places = [*names.minor_places, *(e.name for e in documented if isinstance(e, Place) and e != entity)]
    writer = _FillerWriter(rng, entity, people, places)
    sentences = writer.sentences(int(rng.integers(*_DISTRACTOR_FILLER_SENTENCES)))
    for fact in _fact_sentences(entity):
        sentences.insert(int(rng.integers(len(sentences) + 1)), fact)
    return " ".join([_intro(entity), *sentences])


# ------------------------------------------------------------------------------------------------------------------
# Questions
# ------------------------------------------------------------------------------------------------------------------


def _needle_entities(
    rng: np.random.Generator, kind: QuestionKind, count: int, names: _Names
) -> list[tuple[Entity, Literal["founded", "population", "born"]]]:
    if kind == "founding_to_birth":
        place = _place(rng, names.places[0], founded=int(rng.integers(1100, 1800)))
        person = _person(rng, names.surnames[0], names, born=int(rng.integers(place.founded + 20, 1991)))
        return [(place, "founded"), (person, "born")]
    if kind == "total_population":
        return [(_place(rng, name), "population") for name in names.places[:count]]
    years = rng.choice(np.arange(1100, 1850), size=count, replace=False).tolist()  # distinct: a clear oldest
    return [(_place(rng, name, founded=year), "founded") for name, year in zip(names.places, years, strict=False)]


def _question(kind: QuestionKind, needles: Sequence[Needle]) -> tuple[str, int]:
    names = [needle.entity.name for needle in needles]
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    values = [needle.value for needle in needles]
    if kind == "founding_to_birth":
        return f"How many years passed between the founding of {names[0]} and the birth of {names[1]}?", (
            values[1] - values[0]
        )
    if kind == "total_population":
        return f"What is the combined population of {listed}?", sum(values)
    if len(names) == 2:
        question = f"How many years passed between the founding of {names[0]} and the founding of {names[1]}?"
    else:
        question = f"How many years passed between the founding of the oldest and of the newest of {listed}?"
    return question, max(values) - min(values)


def question_kinds_for(needles: int) -> tuple[QuestionKind, ...]:
    """The question kinds that need exactly ``needles`` documents."""
    return QUESTION_KINDS if needles == 2 else ("total_population", "founding_span")


def build_needle_task(
    rng: np.random.Generator,
    *,
    needles: int,
    num_documents: int,
    document_tokens: int,
    count_tokens: CountTokens,
) -> NeedleTask:
    """A question that needs ``needles`` documents, and a corpus of ``num_documents`` documents holding them."""
    if not 2 <= needles < num_documents <= MAX_DOCUMENTS:
        raise ValueError(
            f"need 2 <= needles < num_documents <= {MAX_DOCUMENTS}, "
            f"got needles={needles}, num_documents={num_documents}"
        )
    kinds = question_kinds_for(needles)
    kind = kinds[int(rng.integers(len(kinds)))]
    names = _draw_names(rng, num_documented=num_documents, num_minor=_MINOR_NAMES)
    chosen = _needle_entities(rng, kind, needles, names)
    places_used = sum(isinstance(entity, Place) for entity, _ in chosen)
    people_used = needles - places_used
    distractors = num_documents - needles
    num_places = distractors // 2
    others: list[Entity] = [_place(rng, name) for name in names.places[places_used : places_used + num_places]]
    others += [
        _person(rng, surname, names) for surname in names.surnames[people_used : people_used + distractors - num_places]
    ]
    order = rng.permutation(num_documents)  # document positions: needles are not always first
    doc_ids = [f"doc-{int(position):03d}" for position in order]

    documents: list[Document] = []
    needle_list = []
    for (entity, fact), doc_id in zip(chosen, doc_ids[:needles], strict=True):
        text = long_document_text(rng, entity, names, document_tokens, count_tokens)
        documents.append(Document(doc_id, entity.title, text))
        needle_list.append(Needle(doc_id, entity, fact))
    documented = [entity for entity, _ in chosen] + others
    for entity, doc_id in zip(others, doc_ids[needles:], strict=True):
        documents.append(Document(doc_id, entity.title, short_document_text(rng, entity, names, documented)))
    documents.sort(key=lambda document: document.id)
    question, answer = _question(kind, needle_list)
    return NeedleTask(question, answer, kind, tuple(needle_list), Corpus(documents))
