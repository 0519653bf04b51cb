"""The ``http_get`` tool: fetch a page with httpx, only from an allow-list of hosts.

The allow-list is checked before any traffic, and again for every redirect (redirects are followed by hand, so a
redirect cannot leave the list). Proxies and ``.netrc`` from the environment are ignored. The whole fetch —
redirects and body included — has one deadline, and at most ``max_bytes`` of the body are read.

Not covered: hostnames are checked, not the addresses they resolve to (an allowed name whose DNS points at an
internal address will be fetched).
"""

from __future__ import annotations

import time
from typing import Annotated

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .function import Tool, tool
from .result import ToolFailure, ToolOutput, preview, truncation_marker

DEFAULT_PORTS = {"http": 80, "https": 443}
MAX_URL_CHARS = 2_000
ERROR_BODY_PREVIEW_BYTES = 500
_MARKER_ROOM = 200
_TEXT_TYPES = ("text/", "json", "xml", "javascript", "x-www-form-urlencoded")


class HttpGetConfig(BaseModel):
    """Where ``http_get`` may go and how much it may fetch."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    allowed_hosts: tuple[str, ...] = Field(
        default=(),
        description='Hosts the tool may fetch from: "example.com" (any port) or "127.0.0.1:8080" (that port).',
    )
    allowed_schemes: tuple[str, ...] = Field(default=("http", "https"), description="URL schemes the tool may use.")
    timeout_s: float = Field(
        default=10.0, gt=0, description="Deadline for the whole fetch, redirects and body included."
    )
    max_bytes: int = Field(
        default=100_000, ge=1, description="Bytes of the body read at most; the rest is not downloaded."
    )
    max_redirects: int = Field(
        default=5, ge=0, description="Redirects followed at most (each checked against the list)."
    )
    user_agent: str = Field(default="longstraw-agents http_get", description="The User-Agent header.")

    @field_validator("allowed_hosts")
    @classmethod
    def _parse_hosts(cls, hosts: tuple[str, ...]) -> tuple[str, ...]:
        for entry in hosts:
            _parse_host_entry(entry)  # raises for entries that are not a host or host:port
        return tuple(entry.lower() for entry in hosts)

    def denial(self, url: httpx.URL) -> str | None:
        """Why ``url`` may not be fetched, or None when it may."""
        if url.scheme not in self.allowed_schemes:
            return f"the scheme {url.scheme or '(none)'!r} is not allowed (allowed: {', '.join(self.allowed_schemes)})"
        host = url.raw_host.decode("ascii", errors="replace").lower()
        if not host:
            return "the URL has no host"
        port = url.port or DEFAULT_PORTS.get(url.scheme)
        for allowed_host, allowed_port in map(_parse_host_entry, self.allowed_hosts):
            if host == allowed_host and allowed_port in (None, port):
                return None
        allowed = ", ".join(self.allowed_hosts) if self.allowed_hosts else "none"
        return f"the host {preview(url.host)} (port {port}) is not on the allow-list (allowed: {allowed})"


def _parse_host_entry(entry: str) -> tuple[str, int | None]:
    """``"host"``, ``"host:port"``, ``"::1"`` or ``"[::1]:port"`` → (normalized ASCII host, port or None)."""
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        port_text = rest.removeprefix(":")
    elif entry.count(":") == 1:
        host, port_text = entry.split(":")
    else:
        host, port_text = entry, ""
    if not host or any(char.isspace() for char in entry):
        raise ValueError(f"allowed host {entry!r} is not a host name or address")
    if port_text and not port_text.isdigit():
        raise ValueError(f"allowed host {entry!r}: the port must be a number")
    try:
        url = httpx.URL(f"http://[{host}]/" if ":" in host else f"http://{host}/")
    except (httpx.InvalidURL, ValueError) as exc:
        raise ValueError(f"allowed host {entry!r} is not a host name or address: {exc}") from None
    if not url.raw_host or url.raw_path != b"/" or url.userinfo or url.port is not None:
        raise ValueError(f"allowed host {entry!r} is not a host name or address")
    return url.raw_host.decode("ascii").lower(), int(port_text) if port_text else None


def fetch(url: str, config: HttpGetConfig) -> ToolOutput:
    """GET ``url`` under ``config``; failures raise `ToolFailure` with the matching error kind."""
    current = _parse_url(url)
    deadline = time.monotonic() + config.timeout_s
    headers = {"User-Agent": config.user_agent}
    try:
        with httpx.Client(follow_redirects=False, trust_env=False, headers=headers) as client:
            for _ in range(config.max_redirects + 1):
                denial = config.denial(current)
                if denial:
                    raise ToolFailure(f"request to {preview(str(current))} denied: {denial}", kind="denied")
                timeout = httpx.Timeout(max(deadline - time.monotonic(), 0.001))
                with client.stream("GET", current, timeout=timeout) as response:
                    if response.is_redirect:
                        current = current.join(response.headers["location"])
                        continue
                    return _read_body(response, config, deadline)
    except httpx.TimeoutException:
        raise ToolFailure(f"request to {preview(url)} timed out after {config.timeout_s:g} s", kind="timeout") from None
    except (httpx.HTTPError, httpx.InvalidURL) as exc:  # InvalidURL: a redirect to a URL that does not parse
        raise ToolFailure(f"request to {preview(url)} failed: {type(exc).__name__}: {exc}") from None
    raise ToolFailure(f"request to {preview(url)} was redirected more than {config.max_redirects} times")


def _parse_url(url: str) -> httpx.URL:
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        raise ToolFailure(f"invalid URL {preview(url)}: {exc}", kind="bad_arguments") from None
    if not parsed.scheme or (parsed.scheme in DEFAULT_PORTS and not parsed.host):  # other schemes are denied later
        example = "https://example.com/"
        raise ToolFailure(f"invalid URL {preview(url)}: it needs a scheme and a host, e.g. {example}", "bad_arguments")
    return parsed


def _read_body(response: httpx.Response, config: HttpGetConfig, deadline: float) -> ToolOutput:
    if response.is_error:
        body = _read_at_most(response, ERROR_BODY_PREVIEW_BYTES, deadline)[0]
        detail = f": {_decode(body, response)}" if body else ""
        raise ToolFailure(f"HTTP {response.status_code} {response.reason_phrase} from {response.url}{detail}")
    content_type = response.headers.get("content-type", "")
    if content_type and not any(kind in content_type.lower() for kind in _TEXT_TYPES):
        size = response.headers.get("content-length", "unknown")
        return ToolOutput(f"The response is {content_type} ({size} bytes), not text; it is not shown.")
    body, more = _read_at_most(response, config.max_bytes, deadline)
    text = _decode(body, response) or "(empty response body)"
    if not more:
        return ToolOutput(text)
    declared = response.headers.get("content-length", "")
    if declared.isdigit():
        total = int(declared)
        return ToolOutput(text + truncation_marker(total - len(body), "bytes"), truncated=True, original_length=total)
    marker = f"\n…[truncated: the body is longer than {config.max_bytes} bytes]"
    return ToolOutput(text + marker, truncated=True, original_length=len(body) + 1)  # a lower bound: rest not read


def _read_at_most(response: httpx.Response, limit: int, deadline: float) -> tuple[bytes, bool]:
    """Up to ``limit`` bytes of the body, and whether there was more (which is then not downloaded)."""
    body = bytearray()
    for chunk in response.iter_bytes():
        body += chunk
        if len(body) > limit:
            return bytes(body[:limit]), True
        if time.monotonic() > deadline:
            raise httpx.ReadTimeout("the body did not arrive before the deadline")
    return bytes(body), False


def _decode(body: bytes, response: httpx.Response) -> str:
    try:
        return body.decode(response.charset_encoding or "utf-8", errors="replace")
    except LookupError:  # a charset Python does not know
        return body.decode("utf-8", errors="replace")


def make_http_get_tool(config: HttpGetConfig, *, name: str = "http_get") -> Tool:
    """An ``http_get(url)`` tool restricted to ``config.allowed_hosts``."""

    def http_get(url: Annotated[str, Field(max_length=MAX_URL_CHARS)]) -> ToolOutput:
        """Fetch a URL with HTTP GET and return the body as text.

        Args:
            url: The absolute URL to fetch, e.g. "https://example.com/page".
        """
        return fetch(url, config)

    hosts = ", ".join(config.allowed_hosts) if config.allowed_hosts else "none"
    description = f"Fetch a URL with HTTP GET and return the body as text. Reachable hosts: {hosts}."
    return tool(http_get, name=name, description=description, max_output_chars=config.max_bytes + _MARKER_ROOM)
