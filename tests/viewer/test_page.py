"""The self-contained page: everything inline, the data readable back exactly, only the selected groups embedded, and
a group of million-token episodes kept to a small page."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import pytest
from viewer_stores import TOOL_OUTPUT, long_group, write_run_directory

from longstraw_agents.store import Store
from longstraw_agents.viewer import ViewSource, static_page, write_page
from longstraw_agents.viewer.page import served_page

MILLION = 1_000_000
PAGE_LIMIT_BYTES = 1_000_000  # "a few MB" at most; the text of a million tokens alone would be several MB


class _Elements(HTMLParser):
    """Tags with their attributes, and the text of the data element."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.data = ""
        self._in_data = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._in_data = dict(attrs).get("id") == "longstraw-data"

    def handle_endtag(self, tag: str) -> None:
        self._in_data = False

    def handle_data(self, data: str) -> None:
        if self._in_data:
            self.data += data


def parsed(page: str) -> _Elements:
    elements = _Elements()
    elements.feed(page)
    return elements


def test_the_page_is_self_contained_and_its_data_reads_back(tmp_path: Path) -> None:
    source = ViewSource(write_run_directory(tmp_path / "run"))
    page, embedded = static_page(source)
    elements = parsed(page)
    assert embedded == 3
    sources = [attrs.get("src") or attrs.get("href") for _, attrs in elements.tags if {"src", "href"} & set(attrs)]
    assert sources == ["data:,"]  # no script, style sheet, image or font fetched from anywhere (an empty icon)
    assert [tag for tag, _ in elements.tags].count("script") == 2 and page.count("</script>") == 2
    data = json.loads(elements.data)
    assert data["mode"] == "static" and sorted(data["groups"]) == ["1", "2", "4"]
    assert data["index"] == json.loads(json.dumps(source.index()))
    tool_piece = data["groups"]["4"]["branches"][1]["pieces"][1]
    assert TOOL_OUTPUT in "".join(tool_piece["windows"][0]["text"])  # "</script>" in a tool output stays text
    assert "<" not in elements.data
    assert "note" not in data


def test_only_the_first_selected_groups_are_embedded(tmp_path: Path) -> None:
    run_dir = write_run_directory(tmp_path / "run")
    written = write_page(ViewSource(run_dir), tmp_path / "out" / "view.html", max_groups=2)
    assert (written.groups, written.selected) == (2, 3) and written.bytes == written.path.stat().st_size
    data = json.loads(parsed(written.path.read_text()).data)
    assert sorted(data["groups"]) == ["1", "2"] and [g["key"] for g in data["index"]["groups"]] == [1, 2]
    assert "first 2 of the 3 selected groups" in data["note"]
    with pytest.raises(ValueError, match="max_groups must be at least 1"):
        static_page(ViewSource(run_dir), max_groups=0)


def test_the_served_page_carries_the_index_only(tmp_path: Path) -> None:
    source = ViewSource(write_run_directory(tmp_path / "run"))
    data = json.loads(parsed(served_page(source)).data)
    assert data["mode"] == "served" and "groups" not in data and len(data["index"]["groups"]) == 3


def test_a_group_of_million_token_episodes_is_a_small_page(tmp_path: Path) -> None:
    group = long_group(MILLION)
    with Store.open(tmp_path / "trajectories.db") as store:
        run = store.add_run(config={"tokenizer": "longstraw-bpe"}, model="m", tokenizer="longstraw-bpe-v1")
        store.add_episodes(group, run_id=run)
    source = ViewSource(tmp_path)
    written = write_page(source, tmp_path / "view.html")
    assert written.bytes < PAGE_LIMIT_BYTES, f"{written.bytes:,} bytes"
    data = json.loads(parsed(written.path.read_text()).data)
    page = data["groups"]["1"]
    assert page["total_tokens"] == sum(t.num_tokens for t in group) and page["total_tokens"] > 4 * MILLION
    root = page["branches"][0]
    assert (root["start"], root["end"], root["members"]) == (0, MILLION, [0, 1, 2, 3])
    tool = root["pieces"][2]
    assert (tool["role"], tool["end"] - tool["start"]) == ("tool", MILLION - 1100)
    assert [len(w["text"]) for w in tool["windows"]] == [128, 128]  # its two ends; the middle is fetched
    assert "100,000 characters" in tool["tool_calls"][0]["content"]
    # every member's own turns are embedded whole
    for branch in page["branches"][1:]:
        assert sum(len(w["text"]) for p in branch["pieces"] for w in p["windows"]) == branch["end"] - branch["start"]
    middle = source.window(1, 0, MILLION // 2, MILLION)
    assert (middle.start, len(middle.text)) == (MILLION // 2, source.limits.range_tokens)
