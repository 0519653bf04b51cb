"""``longstraw view --serve``: the viewer over HTTP on loopback, loading one group at a time.

Routes (GET): ``/`` the page (the index inline, read again at each load); ``/api/index``; ``/api/group/KEY`` one
group's page data (``KEY``: its first episode's id); ``/api/tokens/KEY?member=M&start=S&end=E`` tokens ``[S, E)`` of
member ``M`` (at most ``ViewLimits.range_tokens``). Errors are JSON ``{"error": ...}`` with status 400 or 404.

Only requests addressed to this server by a loopback name are answered: the ``Host`` header must be ``localhost``,
``127.0.0.1``, ``[::1]`` or the address it listens on, with its port; any other is a 403. A web page the browser
loaded from elsewhere cannot read the store through a name of its own that resolves to 127.0.0.1 (DNS
rebinding): the browser sends that name as the ``Host``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from longstraw_agents.store import StoreError
from longstraw_agents.viewer.page import script_json, served_page
from longstraw_agents.viewer.source import ViewSource

LOOPBACK = "127.0.0.1"
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_GROUP = re.compile(r"^/api/group/(\d+)$")
_TOKENS = re.compile(r"^/api/tokens/(\d+)$")


class _BadRequest(ValueError):
    """A request the routes cannot answer as asked (a parameter missing or not an integer)."""


def _int_param(query: dict[str, list[str]], name: str) -> int:
    values = query.get(name)
    if not values:
        raise _BadRequest(f"missing query parameter {name!r}")
    try:
        return int(values[0])
    except ValueError:
        raise _BadRequest(f"query parameter {name!r} must be an integer, got {values[0]!r}") from None


class ViewerServer(ThreadingHTTPServer):
    """A loopback HTTP server for ``source``; ``url`` is where to point a browser (port 0 picks a free port)."""

    daemon_threads = True

    def __init__(self, source: ViewSource, port: int = 0, host: str = LOOPBACK) -> None:
        self.source = source
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}/"


class _Handler(BaseHTTPRequestHandler):
    server: ViewerServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        refused = self._refused_host()
        if refused is not None:
            self._json({"error": refused}, HTTPStatus.FORBIDDEN)
            return
        parts = urlsplit(self.path)
        try:
            self._route(parts.path, parse_qs(parts.query))
        except ValueError as err:  # a bad parameter, a range outside the member
            self._json({"error": str(err)}, HTTPStatus.BAD_REQUEST)
        except KeyError as err:  # no such group
            self._json({"error": err.args[0] if err.args else str(err)}, HTTPStatus.NOT_FOUND)
        except StoreError as err:
            self._json({"error": str(err)}, HTTPStatus.INTERNAL_SERVER_ERROR)

    def _route(self, path: str, query: dict[str, list[str]]) -> None:
        source = self.server.source
        routes: dict[str, Callable[[], None]] = {
            "/": lambda: self._send(served_page(self._refreshed()).encode(), "text/html; charset=utf-8"),
            "/api/index": lambda: self._json(self._refreshed().index()),
        }
        if path in routes:
            routes[path]()
        elif match := _GROUP.match(path):
            self._json(dataclasses.asdict(source.group(int(match.group(1)))))
        elif match := _TOKENS.match(path):
            member, start, end = (_int_param(query, name) for name in ("member", "start", "end"))
            self._json(dataclasses.asdict(source.window(int(match.group(1)), member, start, end)))
        else:
            self._json({"error": f"no such page: {path}"}, HTTPStatus.NOT_FOUND)

    def _refused_host(self) -> str | None:
        """Why the request's ``Host`` is not this server by a loopback name and its port (None: it is)."""
        host = self.headers.get("Host")
        if not host:
            return "no Host header: this server answers requests for its own address only"
        bound, port = self.server.server_address[:2]
        try:
            parts = urlsplit(f"//{host}")
            name, asked_port = parts.hostname, parts.port or 80  # (no port in Host: HTTP's 80)
        except ValueError:  # a port that is not a number, a bracket left open
            name, asked_port = None, None
        if name not in LOOPBACK_NAMES | {str(bound)} or asked_port != port:
            return f"Host {host!r} is not this server: it answers requests for localhost:{port} only"
        return None

    def _refreshed(self) -> ViewSource:
        self.server.source.refresh()
        return self.server.source

    def _json(self, data: Any, status: HTTPStatus = HTTPStatus.OK) -> None:
        self._send(script_json(data).encode(), "application/json", status)

    def _send(self, body: bytes, content_type: str, status: HTTPStatus = HTTPStatus.OK) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
        pass  # one line per request would bury what the command printed
