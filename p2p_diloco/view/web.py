"""A read-only web status page for a swarm, served by the standard library alone.

`StatusServer(source)` serves one self-contained HTML page at `/`, the snapshot `source()` returns as JSON at
`/api/status` (the page polls it) and, when given, Prometheus text at `/metrics`. Nothing a visitor sends can
change anything: there is no state-changing route at all, every method other than GET and HEAD is answered 405,
and the only input read from a request is its path. Records in the snapshot come from untrusted peers, so the
page renders every string as text (never as HTML), and the headers below forbid the page from loading or
sending anything anywhere but this server.

Only the standard library is imported: the view sits above `net` and below `peer`, and this module needs
nothing from either (the caller hands it a callable).
"""

from __future__ import annotations

import json
import logging
import math
import socket
import socketserver
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

Source = Callable[[], Any]
Metrics = Callable[[], tuple[bytes, str]]

# Sent with every response, errors included: the page may talk to this server only ('self'), may not be framed
# (clickjacking), and leaks no referrer; inline script and style are allowed because the page is one file.
SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": ("default-src 'self'; script-src 'self' 'unsafe-inline'; "
                                "style-src 'self' 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; "
                                "frame-ancestors 'none'"),
    "Referrer-Policy": "no-referrer",
}
ALLOW = "GET, HEAD"
HTML_TYPE = "text/html; charset=utf-8"
JSON_TYPE = "application/json"
LOOPBACK_NAMES = {"localhost", "localhost.", "::1", "ip6-localhost"}


def load_page() -> bytes:
    """The page, shipped as package data (see pyproject.toml) so an installed wheel serves it too."""
    return resources.files("p2p_diloco.view").joinpath("static/status.html").read_bytes()


def finite(obj: Any) -> Any:
    """`obj` with NaN and infinities replaced by None: a diverged loss is NaN, and JSON.parse refuses NaN."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    return host in LOOPBACK_NAMES or host.startswith("127.")


class _Handler(BaseHTTPRequestHandler):
    """One request. `server` is a `_Server`, which holds the page, the source and the metrics callable."""

    server: _Server
    server_version = "p2p-diloco-status"
    sys_version = ""  # no Python version in the Server header: nothing to fingerprint
    timeout = 30  # seconds a silent client may hold its thread (a socket timeout; slow-loris clients are dropped)

    # ---- routes --------------------------------------------------------------------------------------------

    def do_GET(self) -> None:
        self._route(head=False)

    def do_HEAD(self) -> None:
        self._route(head=True)

    def _route(self, *, head: bool) -> None:
        if not self._host_allowed():
            return self._send(403, _error_json("unexpected Host header"), JSON_TYPE, head=head)
        # Exact matches only: the path is never joined to a directory, so `..` and encoded tricks reach a 404.
        path = urlsplit(self.path).path
        srv = self.server
        if path in ("/", "/index.html"):
            return self._send(200, srv.page, HTML_TYPE, head=head, cache="no-cache")
        if path == "/api/status":
            try:
                body = (json.dumps(finite(srv.source()), separators=(",", ":")) + "\n").encode()
            except Exception as e:  # a broken source must not take the page down: answer, log, keep serving
                srv.source_failed(e)
                return self._send(500, _error_json(f"status source failed: {type(e).__name__}"), JSON_TYPE, head=head)
            srv.source_ok()
            return self._send(200, body, JSON_TYPE, head=head)
        if path == "/metrics" and srv.metrics is not None:
            try:
                body, ctype = srv.metrics()
            except Exception as e:
                log.warning("metrics source failed: %s: %s", type(e).__name__, e)
                return self._send(500, _error_json("metrics source failed"), JSON_TYPE, head=head)
            return self._send(200, bytes(body), ctype, head=head)
        return self._send(404, _error_json("not found"), JSON_TYPE, head=head)

    def __getattr__(self, name: str):
        # http.server dispatches a request to `do_<METHOD>` and answers 501 when there is none; every method but
        # GET and HEAD (POST, PUT, DELETE, PATCH, OPTIONS, TRACE, made-up ones) gets 405 and the Allow header
        # instead, so a client learns at once that this server changes nothing.
        if name.startswith("do_"):
            return self._not_allowed
        raise AttributeError(name)

    def _not_allowed(self) -> None:
        self.close_connection = True  # the request body is never read: don't parse it as a next request
        self._send(405, _error_json("method not allowed: this page is read-only"), JSON_TYPE, head=False,
                   extra={"Allow": ALLOW})

    # ---- plumbing ------------------------------------------------------------------------------------------

    def _host_allowed(self) -> bool:
        """On a loopback bind, refuse a Host naming another machine: that is a DNS-rebinding page trying to read
        the status through the visitor's browser. (A port is not checked: SSH tunnels change it.)"""
        if not is_loopback(self.server.bind_host):
            return True
        host = self.headers.get("Host")
        if host is None:
            return True  # HTTP/1.0 clients; a browser always sends Host
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        return is_loopback(name)

    def _send(self, status: int, body: bytes, ctype: str, *, head: bool, cache: str = "no-store",
              extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", cache)
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def end_headers(self) -> None:
        for k, v in SECURITY_HEADERS.items():
            self.send_header(k, v)
        super().end_headers()

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Malformed requests (bad request line, oversized headers): a short JSON answer, not http.server's HTML
        page, with the same headers as everything else."""
        self.close_connection = True
        if getattr(self, "request_version", "HTTP/0.9") == "HTTP/0.9":
            self.request_version = "HTTP/1.0"  # else http.server sends a bare body: no status line, no headers
        try:
            self._send(code, _error_json(message or self.responses.get(code, ("error",))[0]), JSON_TYPE,
                       head=getattr(self, "command", None) == "HEAD" or code < 200 or code in (204, 304))
        except OSError:
            pass  # the client is gone

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


def _error_json(message: str) -> bytes:
    return (json.dumps({"error": message}) + "\n").encode()


class _Server(ThreadingHTTPServer):
    """ThreadingHTTPServer holding what the handlers need. Handler threads are daemons (set by the base class), so
    a stuck client never keeps the process alive."""

    allow_reuse_port = False  # SO_REUSEPORT would let a second server share a port in use instead of failing

    def __init__(self, addr: tuple[str, int], page: bytes, source: Source, metrics: Metrics | None,
                 family: socket.AddressFamily):
        self.address_family = family
        self.page, self.source, self.metrics, self.bind_host = page, source, metrics, addr[0]
        self._failing = False
        super().__init__(addr, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind looks up the host's FQDN, which stalls for seconds where reverse DNS is broken;
        # nothing here uses the name.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    def source_failed(self, e: Exception) -> None:
        # Polled every 2 s by each open page: warn once when the source breaks, then quietly until it recovers.
        if not self._failing:
            log.warning("status source failed: %s: %s", type(e).__name__, e, exc_info=True)
        else:
            log.debug("status source still failing: %s: %s", type(e).__name__, e)
        self._failing = True

    def source_ok(self) -> None:
        if self._failing:
            log.info("status source recovered")
        self._failing = False


class StatusServer:
    """The status page and its JSON, served from a daemon thread until `close()`.

    `source()` is called on a handler thread, once per `/api/status` request (every 2 s per open page), so it
    must be cheap and thread-safe (return a copy, not a live structure another thread mutates). `metrics()`
    returns `(body, content_type)` for `/metrics`; without it `/metrics` is a 404.

        with StatusServer(snapshot, port=8080).start() as server:
            print("status page at", server.url)
    """

    def __init__(self, source: Source, *, host: str = "127.0.0.1", port: int = 0, metrics: Metrics | None = None):
        if not callable(source):
            raise TypeError("source must be a zero-argument callable returning the snapshot dict")
        if metrics is not None and not callable(metrics):
            raise TypeError("metrics must be a zero-argument callable returning (bytes, content_type)")
        self.source, self.metrics, self.host, self._want_port = source, metrics, host, port
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> StatusServer:
        """Bind (port 0: a free one) and serve in a daemon thread. Raises OSError naming host:port on failure."""
        with self._lock:
            if self._closed:
                raise RuntimeError("StatusServer was closed; make a new one")
            if self._server is not None:
                return self
            page = load_page()
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            try:
                server = _Server((self.host, self._want_port), page, self.source, self.metrics, family)
            except OSError as e:  # in use, no such address, bad name: say where, in one line
                raise OSError(e.errno, f"cannot serve the status page on {self._where(self._want_port)}: "
                                       f"{e.strerror or e}") from e
            self._server = server
            self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                            name=f"status-page:{server.server_address[1]}", daemon=True)
            self._thread.start()
            log.info("status page at %s", self.url)
            return self

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("StatusServer is not started")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self._where(self.port)}/"

    def _where(self, port: int) -> str:
        return f"[{self.host}]:{port}" if ":" in self.host else f"{self.host}:{port}"

    def close(self) -> None:
        """Stop serving and free the port; safe to call twice, and before `start()`."""
        with self._lock:
            self._closed = True
            server, thread, self._server, self._thread = self._server, self._thread, None, None
        if server is None:
            return
        server.shutdown()  # returns once serve_forever has stopped (the thread is running: started with it)
        server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def __enter__(self) -> StatusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
