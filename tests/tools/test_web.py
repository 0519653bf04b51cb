"""The ``http_get`` tool (tools/web.py) against a loopback server the test starts; no other traffic."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from longstraw_agents.tools import HttpGetConfig, ToolRegistry, make_http_get_tool

BIG_BODY = b"b" * 50_000
TIMEOUT_S = 0.5  # the tool's
RELEASE_SLOW = threading.Event()  # /slow answers once the test sets it (or after a minute)


class Handler(BaseHTTPRequestHandler):
    requests: list[str] = []  # paths served, in order (one server per module)

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.requests.append(self.path)
        route = {
            "/hello": lambda: self.reply(200, "Hello, agent! ☀".encode(), "text/plain; charset=utf-8"),
            "/big": lambda: self.reply(200, BIG_BODY, "text/plain"),
            "/big-chunked": self.chunked,
            "/fail": lambda: self.reply(500, b"database on fire", "text/plain"),
            "/missing": lambda: self.reply(404, b"", "text/plain"),
            "/slow": self.slow,
            "/image": lambda: self.reply(200, b"\x89PNG\r\n", "image/png"),
            "/redirect-in": lambda: self.redirect("/hello"),
            "/redirect-out": lambda: self.redirect("http://example.com/"),
            "/redirect-loop": lambda: self.redirect("/redirect-loop"),
        }.get(self.path, lambda: self.reply(404, b"no such page", "text/plain"))
        route()

    def reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def chunked(self) -> None:
        self.protocol_version = "HTTP/1.1"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for _ in range(10):
            self.wfile.write(b"1000\r\n" + b"c" * 4096 + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")

    def slow(self) -> None:
        RELEASE_SLOW.wait(60)
        self.reply(200, b"too late", "text/plain")

    def log_message(self, format: str, *args: object) -> None:  # keep the test output clean
        pass


class QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that hung up early (the timeout test) is expected


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = QuietServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def http_get(server: str):
    Handler.requests.clear()
    return make_http_get_tool(HttpGetConfig(allowed_hosts=("127.0.0.1",), timeout_s=TIMEOUT_S, max_bytes=10_000))


def test_allowed_fetch(server: str, http_get) -> None:
    result = http_get.invoke({"url": f"{server}/hello"})
    assert (result.ok, result.content) == (True, "Hello, agent! ☀")
    assert Handler.requests == ["/hello"]


def test_schema_names_the_reachable_hosts(http_get) -> None:
    assert http_get.schema["function"]["description"].endswith("Reachable hosts: 127.0.0.1.")


@pytest.mark.parametrize(
    "url",
    [
        "http://example.com/",
        "http://localhost:{port}/hello",  # allowed by address, not by name
        "http://127.0.0.1@example.com/",  # userinfo trick: the host is example.com
        "ftp://127.0.0.1/hello",
        "file:///etc/passwd",
    ],
)
def test_other_hosts_and_schemes_are_denied_without_traffic(server: str, http_get, url: str) -> None:
    result = http_get.invoke({"url": url.format(port=server.rsplit(":", 1)[1])})
    assert (result.ok, result.error) == (False, "denied")
    assert "denied" in result.content
    assert Handler.requests == []


def test_port_restricted_entry(server: str) -> None:
    port = int(server.rsplit(":", 1)[1])
    other = make_http_get_tool(HttpGetConfig(allowed_hosts=(f"127.0.0.1:{port + 1}",)))
    assert other.invoke({"url": f"{server}/hello"}).error == "denied"
    same = make_http_get_tool(HttpGetConfig(allowed_hosts=(f"127.0.0.1:{port}",)))
    assert same.invoke({"url": f"{server}/hello"}).ok


def test_redirects_are_followed_inside_the_allow_list_only(server: str, http_get) -> None:
    inside = http_get.invoke({"url": f"{server}/redirect-in"})
    assert inside.ok and inside.content == "Hello, agent! ☀"
    outside = http_get.invoke({"url": f"{server}/redirect-out"})
    assert outside.error == "denied" and "example.com" in outside.content
    loop = http_get.invoke({"url": f"{server}/redirect-loop"})
    assert loop.error == "exception" and "redirected more than 5 times" in loop.content
    assert Handler.requests.count("/redirect-loop") == 6


def test_oversize_body_is_truncated(server: str, http_get) -> None:
    result = http_get.invoke({"url": f"{server}/big"})
    assert (result.error, result.truncated, result.original_length) == ("output_too_large", True, len(BIG_BODY))
    assert result.content == "b" * 10_000 + "\n…[truncated 40000 bytes]"
    chunked = http_get.invoke({"url": f"{server}/big-chunked"})
    assert chunked.truncated and chunked.content.endswith("…[truncated: the body is longer than 10000 bytes]")


def test_server_errors_become_error_results(server: str, http_get) -> None:
    result = http_get.invoke({"url": f"{server}/fail"})
    assert result.error == "exception"
    assert result.content == f"Error: HTTP 500 Internal Server Error from {server}/fail: database on fire"
    assert http_get.invoke({"url": f"{server}/missing"}).content.startswith("Error: HTTP 404 Not Found")


def test_timeout(server: str, http_get) -> None:
    """The server holds /slow until the test releases it: an answer within 10x the tool's timeout can only come
    from the timeout (a generous bound, so a busy machine does not fail it)."""
    RELEASE_SLOW.clear()
    start = time.perf_counter()
    try:
        result = http_get.invoke({"url": f"{server}/slow"})
        elapsed = time.perf_counter() - start
    finally:
        RELEASE_SLOW.set()
    assert result.error == "timeout" and "timed out after 0.5 s" in result.content
    assert elapsed < 10 * TIMEOUT_S


def test_binary_content_is_described_not_shown(server: str, http_get) -> None:
    result = http_get.invoke({"url": f"{server}/image"})
    assert result.ok and result.content == "The response is image/png (6 bytes), not text; it is not shown."


def test_connection_refused_is_an_error(http_get) -> None:
    closed = make_http_get_tool(HttpGetConfig(allowed_hosts=("127.0.0.1:9",), timeout_s=0.5))  # discard port
    result = closed.invoke({"url": "http://127.0.0.1:9/"})
    assert result.error in ("exception", "timeout") and result.content.startswith("Error: request to")


@pytest.mark.parametrize("url", ["not a url", "/relative/path", "http://"])
def test_invalid_urls(http_get, url: str) -> None:
    result = http_get.invoke({"url": url})
    assert not result.ok and result.error in ("bad_arguments", "denied")
    assert Handler.requests == []


def test_registry_round_trip(server: str, http_get) -> None:
    tools = ToolRegistry([http_get])
    [result] = tools.execute_text(
        f'<tool_call>{{"name": "http_get", "arguments": {{"url": "{server}/hello"}}}}</tool_call>'
    )
    assert result.ok and result.arguments == {"url": f"{server}/hello"}


@pytest.mark.parametrize("entry", ["a.com/path", "user@a.com", "a.com:http", "", "two words"])
def test_config_rejects_bad_host_entries(entry: str) -> None:
    with pytest.raises(ValueError):
        HttpGetConfig(allowed_hosts=(entry,))
