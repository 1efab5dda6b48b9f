"""The status page's HTTP server, over real HTTP on 127.0.0.1 (port 0): its routes, that it is read-only, its
security headers, and that a failing snapshot source costs one 500 and not the server."""

from __future__ import annotations

import http.client
import json
import re
import socket
import urllib.error
import urllib.request

import pytest

from p2p_diloco.view.web import SECURITY_HEADERS, StatusServer

PEER_A = "12D3KooWA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8S9t0U1v2"
PEER_B = "12D3KooWZz9Yy8Xx7Ww6Vv5Uu4Tt3Ss2Rr1Qq0Pp9Oo8Nn7Mm6"
SNAPSHOT = {
    "run_id": "default", "spec_hash": "3f2a9c1b7d4e", "now": 1764075000.0,
    "observer": {"kind": "peer", "peer_id": PEER_A, "reachability": "loopback",
                 "addrs": [f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER_A}"]},
    "self": {"round": 12, "loss": 2.31, "eval_loss": 2.40, "bytes_sent": 123456, "bytes_received": 654321,
             "merged": 30, "rejected": 0, "utilization": 0.95, "tau": 2, "peers": 2, "vv_total": 24},
    "peers": [
        {"peer_id": PEER_A, "short": PEER_A[-8:], "state": "training", "round": 12, "step": 240, "loss": 2.31,
         "eval_loss": 2.4, "samples_per_s": 120.5, "utilization": 0.95, "tau": 2, "age_s": 1.5, "update_age_s": 0.8,
         "bytes_sent": 123456, "bytes_received": 654321, "reachability": "loopback", "vv_total": 24,
         "vv_digest": "a1b2c3d4e5f60718", "seq": 12, "rejected": 0, "banned": 0},
        {"peer_id": PEER_B, "short": PEER_B[-8:], "state": "syncing", "round": 11, "step": 220, "loss": None,
         "eval_loss": None, "samples_per_s": 0.0, "utilization": None, "tau": 3, "age_s": 3.0, "update_age_s": None,
         "bytes_sent": 1000, "bytes_received": 2000, "reachability": "private", "vv_total": 23,
         "vv_digest": "ffeeddccbbaa9988", "seq": 11, "rejected": 1, "banned": 0},
    ],
    "agreement": {"agree": False, "groups": [{"digest": "a1b2c3d4e5f60718", "vv_total": 24, "peers": [PEER_A]},
                                             {"digest": "ffeeddccbbaa9988", "vv_total": 23, "peers": [PEER_B]}]},
    "vv_matrix": {"holders": [PEER_A, PEER_B], "senders": [PEER_A, PEER_B], "seq": [[12, 12], [11, None]]},
    "curves": {PEER_A: [[1764074000.0, 1, 3.1, None], [1764074100.0, 2, 2.9, 2.95]], PEER_B: []},
    "local": [{"time": 1764074000.0, "round": 1, "loss": 3.1, "eval_loss": None, "bytes_sent": 1000,
               "bytes_received": 2000, "utilization": 0.9}],
}
JSON = "application/json"
OTHER_METHODS = ("POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "BREW")


def fetch(url: str, method: str = "GET", data: bytes | None = None, headers: dict | None = None):
    """(status, headers, body) of one request; HTTP errors are answers here, not exceptions."""
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.headers, e.read()


def raw(server: StatusServer, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """One request with http.client, which sends any method and any path exactly as given (no normalizing)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.headers, r.read()
    finally:
        conn.close()


def assert_secure(headers) -> None:
    for name, value in SECURITY_HEADERS.items():
        assert headers.get(name) == value, name
    assert "frame-ancestors 'none'" in headers["Content-Security-Policy"]


@pytest.fixture(scope="module")
def server():
    """One server for the module (it keeps no state between requests); `calls` counts the source's calls."""
    calls = []

    def source():
        calls.append(1)
        return SNAPSHOT

    with StatusServer(source) as s:
        s.calls = calls
        yield s


def test_the_page_is_served_self_contained(server):
    status, headers, body = fetch(server.url)
    assert status == 200
    assert headers["Content-Type"] == "text/html; charset=utf-8"
    page = body.decode()
    for needle in ('id="peers"', 'id="refreshes"', 'id="agreement"', 'id="loss-chart"', 'id="vv-matrix"',
                   'id="bytes-chart"', 'id="connectivity"', "api/status"):
        assert needle in page
    # Offline and private: no external script, style, font or image, and no HTML built from data.
    assert not re.search(r"https?://", page), "the page must not name any external URL"
    assert "innerHTML" not in page and "outerHTML" not in page and "insertAdjacentHTML" not in page
    assert "document.write" not in page and "eval(" not in page
    assert_secure(headers)
    assert fetch(server.url + "index.html")[2] == body


def test_status_json_round_trips_the_snapshot(server):
    status, headers, body = fetch(server.url + "api/status")
    assert status == 200
    assert headers["Content-Type"] == "application/json"
    assert headers["Cache-Control"] == "no-store"
    assert json.loads(body) == SNAPSHOT
    assert fetch(server.url + "api/status?t=123")[2] == body  # a cache-busting query string is fine
    assert_secure(headers)


def test_nan_and_infinity_become_null():
    """JSON.parse rejects NaN: a diverged loss must reach the page as null, not break it."""
    snap = {"self": {"loss": float("nan"), "eval_loss": float("inf")}, "curves": {"p": [[1.0, 1, float("-inf"), 2.0]]}}
    with StatusServer(lambda: snap) as s:
        status, _, body = fetch(s.url + "api/status")
    assert status == 200
    assert json.loads(body) == {"self": {"loss": None, "eval_loss": None}, "curves": {"p": [[1.0, 1, None, 2.0]]}}


def test_head_answers_like_get_without_a_body(server):
    for path in ("", "api/status"):
        _, get_headers, get_body = fetch(server.url + path)
        status, headers, body = fetch(server.url + path, method="HEAD")
        assert status == 200 and body == b""
        assert int(headers["Content-Length"]) == len(get_body)
        assert headers["Content-Type"] == get_headers["Content-Type"]
        assert_secure(headers)


def test_metrics_are_served_when_given_and_404_otherwise(server):
    assert fetch(server.url + "metrics")[0] == 404
    body = b"# HELP p2p_round Round.\n# TYPE p2p_round gauge\np2p_round 12\n"
    ctype = "text/plain; version=0.0.4; charset=utf-8"
    with StatusServer(lambda: SNAPSHOT, metrics=lambda: (body, ctype)) as s:
        status, headers, got = fetch(s.url + "metrics")
        assert (status, headers["Content-Type"], got) == (200, ctype, body)
        assert_secure(headers)
        status, headers, got = fetch(s.url + "metrics", method="HEAD")
        assert (status, got, int(headers["Content-Length"])) == (200, b"", len(body))


@pytest.mark.parametrize("method", OTHER_METHODS)
@pytest.mark.parametrize("path", ["/", "/api/status", "/metrics", "/anything"])
def test_every_other_method_is_405_and_changes_nothing(server, method, path):
    before = len(server.calls)
    status, headers, body = raw(server, method, path, body=b'{"round": 99}', headers={"Content-Type": JSON})
    assert status == 405
    assert headers["Allow"] == "GET, HEAD"
    assert "error" in json.loads(body)
    assert_secure(headers)
    assert len(server.calls) == before  # the source was not even asked
    assert json.loads(fetch(server.url + "api/status")[2]) == SNAPSHOT  # and the server still answers



@pytest.mark.parametrize("path", ["/../../etc/passwd", "/static/../web.py", "/static/status.html", "/web.py",
                                  "/%2e%2e/%2e%2e/etc/passwd", "/api/status/../../web.py", "/api/status/",
                                  "/api", "/status.html", "//etc/passwd", "/favicon.ico", "/metrics/"])
def test_unknown_paths_and_traversal_are_404(server, path):
    status, headers, body = raw(server, "GET", path)
    assert status == 404, path
    assert json.loads(body) == {"error": "not found"}
    assert b"root:" not in body and b"import" not in body
    assert_secure(headers)


def test_a_failing_source_is_a_500_in_json_and_the_server_keeps_serving():
    answers = iter([RuntimeError("disk on fire\nTraceback (most recent call last)"), SNAPSHOT,
                    {"bad": object()}, SNAPSHOT])

    def source():
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    with StatusServer(source) as s:
        status, headers, body = fetch(s.url + "api/status")
        assert status == 500
        assert headers["Content-Type"] == "application/json"
        assert body.count(b"\n") == 1 and b"Traceback" not in body and b"disk on fire" not in body
        assert json.loads(body) == {"error": "status source failed: RuntimeError"}
        assert_secure(headers)
        assert fetch(s.url + "api/status")[0] == 200
        status, _, body = fetch(s.url + "api/status")  # not JSON-serializable: also a 500, not a dead thread
        assert status == 500 and json.loads(body)["error"] == "status source failed: TypeError"
        assert json.loads(fetch(s.url + "api/status")[2]) == SNAPSHOT
        assert fetch(s.url)[0] == 200


def test_malformed_requests_get_a_short_json_answer(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"this is not http at all\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 400")
    assert b"X-Content-Type-Options: nosniff" in head
    assert "error" in json.loads(body) and b"<html" not in body.lower()


def test_a_foreign_host_header_is_refused_on_loopback(server):
    """DNS rebinding: a page on evil.example resolving to 127.0.0.1 must not read the status through a browser."""
    assert raw(server, "GET", "/api/status", headers={"Host": "evil.example"})[0] == 403
    assert raw(server, "GET", "/api/status", headers={"Host": "evil.example:80"})[0] == 403
    for host in ("localhost:9999", "127.0.0.1", "[::1]:8080", "localhost"):  # a tunnel may change the port
        assert raw(server, "GET", "/api/status", headers={"Host": host})[0] == 200, host


def test_port_zero_url_and_port_in_use():
    with StatusServer(lambda: {}) as s:
        assert s.port > 0
        assert s.url == f"http://127.0.0.1:{s.port}/"
        with pytest.raises(OSError, match=rf"127\.0\.0\.1:{s.port}"):
            StatusServer(lambda: {}, port=s.port).start()


def test_a_bad_host_names_itself():
    with pytest.raises(OSError, match=r"203\.0\.113\.7:0"):  # TEST-NET-3: never an address of this machine
        StatusServer(lambda: {}, host="203.0.113.7").start()


def test_close_is_idempotent_and_frees_the_port():
    s = StatusServer(lambda: {}).start()
    port = s.port
    assert fetch(s.url)[0] == 200
    s.close()
    s.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)
    StatusServer(lambda: {}, port=port).start().close()  # the port is free again
    StatusServer(lambda: {}).close()  # never started: nothing to do


def test_arguments_are_checked():
    with pytest.raises(TypeError):
        StatusServer({"not": "callable"})
    with pytest.raises(TypeError):
        StatusServer(lambda: {}, metrics=b"nope")
    with pytest.raises(RuntimeError):
        _ = StatusServer(lambda: {}).port
