"""The viewer in a real browser (headless Chromium): the static page opens from disk with no request beyond it, a
group is drawn as its tree, branches and tool results expand, a metrics step lists its groups; the served page
loads a group of million-token episodes and fetches a range of the shared tool output on demand."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from browser import INSTALL, REQUIRE, chromium, require_or_skip  # noqa: F401 (chromium: a fixture)
from viewer_stores import TOOL_OUTPUT, long_group, write_run_directory

from longstraw_agents.store import Store
from longstraw_agents.viewer import ViewerServer, ViewSource, write_page

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def page(chromium: Any) -> Iterator[Any]:  # noqa: F811 (the fixture imported above)
    """A fresh tab that records every request it makes and every script error."""
    context = chromium.new_context(viewport={"width": 1400, "height": 900})
    tab = context.new_page()
    tab.requests, tab.errors = [], []
    tab.on("request", lambda request: tab.requests.append(request.url))
    tab.on("pageerror", lambda error: tab.errors.append(str(error)))
    yield tab
    context.close()


@pytest.mark.browser
def test_the_static_page_draws_a_group_as_its_tree(page: Any, tmp_path: Path) -> None:
    written = write_page(ViewSource(write_run_directory(tmp_path / "run")), tmp_path / "view.html")
    page.goto(written.path.as_uri())
    assert page.locator("#groups tbody tr").count() == 3
    page.locator("#groups tbody tr", has_text="step2-g0").click()
    tree = page.locator("#tree")
    tree.locator(".branch").first.wait_for()

    assert tree.locator(".branch").count() == 6 and tree.locator(".leaf").count() == 4
    root = tree.locator(".branch").first
    head = root.locator(":scope > .branch-head")
    assert "shared prefix" in head.inner_text() and "33 tokens" in head.inner_text()
    body = root.locator(":scope > .branch-body")
    assert body.is_hidden()  # the shared prefix starts collapsed, with its token count
    assert root.locator(":scope > .fork").inner_text() == "◆ branch point after token 33: 2 continuations"
    head.locator(".label").click()  # expand it
    assert body.is_visible()
    assert body.locator(".piece").evaluate_all("ps => ps.map(p => p.className)") == [
        "piece role-system",
        "piece role-user",
    ]
    leaf = tree.locator(".leaf", has_text="#0 episode 4")
    assert "reward 1.000" in leaf.inner_text() and "A +1.500" in leaf.inner_text()

    call_branch = tree.locator('.branch[data-branch="1"] > .branch-body')
    assert call_branch.locator(".piece.role-assistant .t.loss").count() == 22  # the tool call's tokens carry loss
    result = call_branch.locator("details.tool", has_text="result of calculator: ok, truncated")
    result.locator("summary").click()
    assert TOOL_OUTPUT in result.locator("pre").inner_text()  # markup in a tool output shows as text
    assert "truncated (4,096 chars)" in call_branch.locator(".piece.role-tool .piece-head").inner_text()

    tree.locator('.chip[data-member="0"]').first.click()  # member #0's path: root, call, "<answer>", "12..."
    assert tree.locator(".branch.on-path").count() == 4 and tree.locator(".branch.off-path").count() == 2
    page.locator("#shade-lp").uncheck()
    assert "shade-lp" not in (tree.get_attribute("class") or "")

    page.locator('svg.chart[data-metric="loss"] circle[data-step="1"]').click()  # a step of the curve ...
    assert page.locator("#groups tbody tr").all_inner_texts()[0].startswith("step1-g0")  # ... lists its groups
    assert page.locator("#groups tbody tr").count() == 1

    shot = tmp_path / "static.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes().startswith(PNG_MAGIC)
    assert page.errors == [] and page.requests == [written.path.as_uri()]  # nothing but the file itself


@pytest.fixture
def million_token_server(tmp_path: Path) -> Iterator[ViewerServer]:
    with Store.open(tmp_path / "trajectories.db") as store:
        run = store.add_run(config={"tokenizer": "longstraw-bpe"}, model="m", tokenizer="longstraw-bpe-v1")
        store.add_episodes(long_group(1_000_000), run_id=run)
    server = ViewerServer(ViewSource(tmp_path), port=0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


@pytest.mark.browser
def test_the_served_page_fetches_token_ranges_on_demand(page: Any, million_token_server: ViewerServer) -> None:
    page.goto(million_token_server.url)
    tree = page.locator("#tree")
    tree.locator(".branch").first.wait_for()  # the only group opens at once
    root = tree.locator(".branch").first
    assert "1,000,000 tokens" in root.locator(":scope > .branch-head").inner_text()
    root.locator(":scope > .branch-head .label").click()
    tool = root.locator(":scope > .branch-body > .piece.role-tool")
    tool.locator(".piece-head").click()  # a long tool output starts collapsed, its length shown
    spans = tool.locator(".t")
    assert spans.count() == 256  # its two ends
    gap = tool.locator("button.gap")
    assert "998,644 tokens: load 4,096" in gap.inner_text()
    gap.click()
    tool.locator("button.gap", has_text="994,548 tokens").wait_for()
    assert spans.count() == 256 + 4096
    assert page.errors == []
    assert all(url.startswith(million_token_server.url) for url in page.requests)


def test_without_a_browser_the_tests_skip_saying_how_to_install_it_or_fail_in_ci(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(REQUIRE, raising=False)
    with pytest.raises(pytest.skip.Exception, match=f"install it with: {INSTALL}"):
        require_or_skip(f"Chromium is not installed; install it with: {INSTALL}")
    monkeypatch.setenv(REQUIRE, "1")
    with pytest.raises(pytest.fail.Exception, match=f"{REQUIRE}=1 but Chromium is not installed"):
        require_or_skip(f"Chromium is not installed; install it with: {INSTALL}")
