"""The viewer's page: one HTML file with its script, styles and data inline (``static/``), so it opens from disk with
no network. The static page embeds the selected groups; the served page embeds only the index and fetches each
group, and token ranges, from its server (``viewer.server``)."""

from __future__ import annotations

import dataclasses
import html
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from longstraw_agents.viewer.source import ViewSource

MAX_GROUPS = 20
"""Groups a static page embeds by default (select others with ``--where`` / ``--group``; a server loads any)."""
_PLACEHOLDER = re.compile(r"__(TITLE|STYLE|SCRIPT|DATA)__")


def _asset(name: str) -> str:
    return (resources.files("longstraw_agents.viewer") / "static" / name).read_text(encoding="utf-8")


def script_json(data: Any) -> str:
    """``data`` as JSON that can sit inside ``<script type="application/json">``: strict (no NaN), and without a
    ``<`` (written ``\\u003c``, which reads back the same), so that no text in it (``</script>``, ``<!--``) can end
    or change the element."""
    return json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":")).replace("<", "\\u003c")


def page_html(data: dict[str, Any], title: str) -> str:
    """The page with ``data`` (``{"mode": ..., "index": ..., "groups": ...}``) and the viewer's assets inline."""
    parts = {
        "TITLE": html.escape(title),
        "STYLE": _asset("viewer.css"),
        "SCRIPT": _asset("viewer.js"),
        "DATA": script_json(data),
    }
    # one pass: what is put in is never scanned for placeholders again
    return _PLACEHOLDER.sub(lambda match: parts[match.group(1)], _asset("viewer.html"))


@dataclass(frozen=True)
class WrittenPage:
    """A static page: where, its size, and how many of the selected groups it embeds."""

    path: Path
    bytes: int
    groups: int
    selected: int


def static_page(source: ViewSource, max_groups: int = MAX_GROUPS) -> tuple[str, int]:
    """The self-contained page of ``source``'s first ``max_groups`` selected groups, and how many it embeds."""
    if max_groups < 1:
        raise ValueError(f"max_groups must be at least 1, got {max_groups}")
    index = source.index()
    selected = len(index["groups"])
    index["groups"] = index["groups"][:max_groups]
    groups = {str(entry["key"]): dataclasses.asdict(source.group(entry["key"])) for entry in index["groups"]}
    data: dict[str, Any] = {"mode": "static", "index": index, "groups": groups}
    if selected > len(groups):
        data["note"] = (
            f"This page embeds the first {len(groups)} of the {selected:,} selected groups: choose others with "
            "--where or --group, raise --max-groups, or use --serve (it loads any group on demand)."
        )
    return page_html(data, f"longstraw view: {source.db}"), len(groups)


def served_page(source: ViewSource) -> str:
    """The page a server sends: the index, groups fetched on demand."""
    return page_html({"mode": "served", "index": source.index()}, f"longstraw view: {source.db}")


def write_page(source: ViewSource, out: str | Path, max_groups: int = MAX_GROUPS) -> WrittenPage:
    out = Path(out)
    text, embedded = static_page(source, max_groups)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return WrittenPage(path=out, bytes=out.stat().st_size, groups=embedded, selected=len(source.summaries))
