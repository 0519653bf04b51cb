"""``longstraw view --serve``'s server: the page, the index, one group at a time and token ranges, on loopback and for
loopback names only (another Host is a 403, against DNS rebinding); bad requests answered with JSON errors."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from viewer_stores import calculator_group, write_run_directory

from longstraw_agents.store import Store
from longstraw_agents.viewer import ViewerServer, ViewSource


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ViewerServer]:
    running = ViewerServer(ViewSource(write_run_directory(tmp_path / "run")), port=0)
    thread = threading.Thread(target=running.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield running
    running.shutdown()
    running.server_close()
    thread.join(timeout=10)


def test_the_server_listens_on_loopback_only(server: ViewerServer) -> None:
    assert server.url.startswith("http://127.0.0.1:") and server.server_address[1] > 0


def test_page_index_group_and_token_ranges(server: ViewerServer) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '"mode":"served"' in page.text
        index = client.get("/api/index").json()
        assert [g["key"] for g in index["groups"]] == [1, 2, 4]
        group = client.get("/api/group/4").json()
        assert [m["episode"] for m in group["members"]] == [4, 5, 6, 7] and len(group["branches"]) == 6
        window = client.get("/api/tokens/4", params={"member": 2, "start": 3, "end": 9}).json()
        assert window["start"] == 3 and len(window["text"]) == len(window["loss"]) == 6


def test_the_page_reads_the_store_again_at_each_load(server: ViewerServer) -> None:
    with Store.open(server.source.db) as store:
        store.add_episodes(calculator_group("step3-g0"), run_id=store.runs()[-1].id)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        assert [g["group_id"] for g in client.get("/api/index").json()["groups"]][-1] == "step3-g0"


@pytest.mark.parametrize(
    ("path", "status", "error"),
    [
        ("/api/group/5", 404, "episode 5 is not the first of its group"),
        ("/api/group/99", 404, "no episode 99"),
        ("/api/tokens/4?member=0&start=0", 400, "missing query parameter 'end'"),
        ("/api/tokens/4?member=x&start=0&end=1", 400, "'member' must be an integer, got 'x'"),
        ("/api/tokens/4?member=0&start=90&end=99", 400, "not inside member 0's 93 tokens"),
        ("/api/tokens/4?member=9&start=0&end=1", 400, "member 9 is not in the group"),
        ("/etc/passwd", 404, "no such page: /etc/passwd"),
    ],
)
def test_bad_requests_get_json_errors(server: ViewerServer, path: str, status: int, error: str) -> None:
    response = httpx.get(server.url.rstrip("/") + path, timeout=30)
    assert response.status_code == status and error in response.json()["error"]


@pytest.mark.parametrize("host", ["localhost:{port}", "127.0.0.1:{port}", "[::1]:{port}", "LOCALHOST:{port}"])
def test_loopback_names_with_the_servers_port_are_answered(server: ViewerServer, host: str) -> None:
    port = server.server_address[1]
    response = httpx.get(server.url + "api/index", headers={"Host": host.format(port=port)}, timeout=30)
    assert response.status_code == 200 and response.json()["groups"]


@pytest.mark.parametrize(
    "host", ["evil.example:{port}", "evil.example", "localhost", "localhost:{other}", "127.0.0.1.evil.example:{port}"]
)
def test_another_host_is_refused_against_dns_rebinding(server: ViewerServer, host: str) -> None:
    port = server.server_address[1]
    named = host.format(port=port, other=port + 1 if port < 65535 else port - 1)
    for path in ("/", "/api/index", "/api/group/4"):
        response = httpx.get(server.url.rstrip("/") + path, headers={"Host": named}, timeout=30)
        assert response.status_code == 403, (path, response.text)
        assert f"Host {named!r} is not this server" in response.json()["error"]


def test_a_request_without_a_host_header_is_refused(server: ViewerServer) -> None:
    with socket.create_connection(server.server_address[:2], timeout=30) as sock:
        sock.sendall(b"GET /api/index HTTP/1.0\r\n\r\n")
        answer = sock.makefile("rb").read()
    assert answer.startswith(b"HTTP/1.0 403") and b"no Host header" in answer
