"""The status page in a real headless Chromium, fed a recorded three-peer swarm snapshot that moves on at each
poll: rows per peer, live refreshes, charts drawn, untrusted strings shown as text, no console errors."""

from __future__ import annotations

import copy
import shutil
import threading

import pytest

pytest.importorskip("selenium", reason="selenium is not installed: the browser test needs it")
if not shutil.which("chromedriver"):
    pytest.skip("no chromedriver on PATH: the browser test needs it", allow_module_level=True)

from selenium.webdriver.common.by import By  # noqa: E402 (after the skips on purpose)
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from p2p_diloco.view.browser import find_chromium, headless_chromium  # noqa: E402
from p2p_diloco.view.web import StatusServer  # noqa: E402

if find_chromium()[0] is None:
    pytest.skip("no Chromium browser on PATH: the browser test needs it", allow_module_level=True)

A = "12D3KooWLrDzS1x8GmMqLhKcbB9kYpGfW3UeZsVn4aPq7Xc2Tt8R"
B = "12D3KooWQe2Jm5TgHs7bFqVzK9cYw3RdLpXn6AuM8EoGh1Zi4Sv"
EVIL = "12D3KooW<img src=x onerror=alert(1)>"  # a peer id from a hostile peer: must stay text
T0 = 1764074000.0
# Recorded from a three-peer swarm on one machine (then EVIL's id and address swapped in). The source below
# replays it moving forward: each poll is one more round for every peer.
RECORDED = {
    "run_id": "default", "spec_hash": "3f2a9c1b7d4e", "now": T0 + 600.0,
    "observer": {"kind": "peer", "peer_id": A, "reachability": "loopback",
                 "addrs": [f"/ip4/127.0.0.1/tcp/4001/p2p/{A}", "/ip4/10.0.0.5/tcp/4001/<svg onload=alert(2)>"]},
    "self": {"round": 10, "loss": 2.61, "eval_loss": 2.70, "bytes_sent": 10_000_000, "bytes_received": 21_000_000,
             "merged": 20, "rejected": 0, "utilization": 0.93, "tau": 2, "peers": 3, "vv_total": 30},
    "peers": [
        {"peer_id": A, "short": A[-8:], "state": "training", "round": 10, "step": 200, "loss": 2.61,
         "eval_loss": 2.70, "samples_per_s": 121.5, "utilization": 0.93, "tau": 2, "age_s": 0.4,
         "update_age_s": 0.8, "bytes_sent": 10_000_000, "bytes_received": 21_000_000, "reachability": "loopback",
         "vv_total": 30, "vv_digest": "a1b2c3d4e5f60718", "seq": 10, "rejected": 0, "banned": 0},
        {"peer_id": B, "short": B[-8:], "state": "training", "round": 10, "step": 200, "loss": 2.66,
         "eval_loss": None, "samples_per_s": 98.0, "utilization": 0.88, "tau": 3, "age_s": 1.2,
         "update_age_s": 2.5, "bytes_sent": 9_500_000, "bytes_received": 20_000_000, "reachability": "private",
         "vv_total": 30, "vv_digest": "a1b2c3d4e5f60718", "seq": 10, "rejected": 0, "banned": 0},
        {"peer_id": EVIL, "short": "<b>x</b>", "state": "<i>pwn</i>", "round": 9, "step": 180, "loss": 2.9,
         "eval_loss": None, "samples_per_s": 50.0, "utilization": None, "tau": 4, "age_s": 3.0,
         "update_age_s": None, "bytes_sent": 100, "bytes_received": 5_000_000, "reachability": "<u>relayed</u>",
         "vv_total": 28, "vv_digest": "<script>1</script>", "seq": 9, "rejected": 2, "banned": 1},
    ],
    "agreement": {"state": "diverged", "agree": False, "behind": {EVIL: 75.0}, "stuck_s": 60.0, "groups": [
        {"digest": "a1b2c3d4e5f60718", "vv_total": 30, "peers": [A, B]},
        {"digest": "<img src=y onerror=alert(3)>", "vv_total": 28, "peers": [EVIL]}]},
    "vv_matrix": {"holders": [A, B, EVIL], "senders": [A, B, EVIL],
                  "seq": [[10, 10, 9], [10, 9, 9], [8, None, 9]]},
    "curves": {p: [[T0 + 60.0 * r, r, round(3.4 - 0.08 * r + 0.03 * i, 3), 3.45 - 0.08 * r if r % 3 == 0 else None]
                   for r in range(1, 11)] for i, p in enumerate((A, B, EVIL))},
    "local": [{"time": T0 + 60.0 * r, "round": r, "loss": 3.4 - 0.08 * r, "eval_loss": None,
               "bytes_sent": 1_000_000 * r, "bytes_received": 2_100_000 * r, "utilization": 0.9}
              for r in range(1, 11)],
}
EMPTY = {"run_id": "default", "spec_hash": None, "now": T0, "self": None, "peers": [], "curves": {}, "local": [],
         "observer": {"kind": "bootstrap", "peer_id": None, "reachability": "unknown", "addrs": []},
         "agreement": {"agree": True, "groups": []}, "vv_matrix": {"holders": [], "senders": [], "seq": []}}
POLL = "?interval=300"  # the page polls every 2 s by default; faster here to keep the test short
WAIT_S = 10


class Replay:
    """The recorded snapshot, one round further at each call (thread-safe: the server calls from many threads)."""

    def __init__(self):
        self.calls, self.lock = 0, threading.Lock()

    def __call__(self) -> dict:
        with self.lock:
            k, self.calls = self.calls, self.calls + 1
        snap = copy.deepcopy(RECORDED)
        snap["now"] += 2.0 * k
        snap["self"]["round"] += k
        for p in snap["peers"]:
            p["round"] += k
            p["step"] += 20 * k
        for i, curve in enumerate(snap["curves"].values()):
            curve += [[T0 + 60.0 * r, r, round(3.4 - 0.08 * r + 0.03 * i, 3), None] for r in range(11, 11 + k)]
        snap["local"] += [{"time": T0 + 60.0 * r, "round": r, "loss": 3.4 - 0.08 * r, "eval_loss": None,
                           "bytes_sent": 1_000_000 * r, "bytes_received": 2_100_000 * r, "utilization": 0.9}
                          for r in range(11, 11 + k)]
        return snap


@pytest.fixture(scope="module")
def driver():
    try:
        d = headless_chromium(1280, 900)
    except RuntimeError as e:
        pytest.skip(str(e))
    # Catch any alert() an injected element would fire, instead of a modal that blocks the page.
    d.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument",
                      {"source": "window.__alerts = []; window.alert = (m) => window.__alerts.push(String(m));"})
    try:
        yield d
    finally:
        d.quit()


def severe(driver) -> list[str]:
    """The console's errors since the last call (reading the log drains it)."""
    try:
        entries = driver.get_log("browser")
    except Exception:  # a driver without log support: nothing to check
        return []
    return [e["message"] for e in entries if e.get("level") == "SEVERE"]


def page_errors(driver, server) -> list[str]:
    """The console's errors that come from this server's page: the page of an earlier test may still be polling
    a server that has gone, and its refused fetches land in the same log."""
    return [m for m in severe(driver) if server.url.rstrip("/") in m]


def text(driver, css: str) -> str:
    # Read in one script call: the page re-renders while it polls, and an element found by one WebDriver call
    # may be gone by the next one (StaleElementReferenceException).
    got = driver.execute_script("const e = document.querySelector(arguments[0]); return e ? e.innerText : null", css)
    assert got is not None, f"no element {css!r} on the page"
    return got


def texts(driver, css: str) -> list[str]:
    return driver.execute_script("return [...document.querySelectorAll(arguments[0])].map(e => e.innerText)", css)


def row_round(driver, peer: str) -> int:
    return int(text(driver, f'tr[data-peer="{peer}"] td[data-col="round"]').replace(",", ""))


PAINT = """
const c = document.getElementById(arguments[0]), want = arguments[1];
const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
const near = want.map(() => 0);
for (let i = 0; i < d.length; i += 4) {
  if (d[i + 3] < 200) continue;
  want.forEach((w, k) => {
    if (Math.abs(d[i] - w[0]) + Math.abs(d[i + 1] - w[1]) + Math.abs(d[i + 2] - w[2]) < 40) near[k]++;
  });
}
return {w: c.width, h: c.height, cw: c.clientWidth, ch: c.clientHeight, near: near};
"""
BLUE, ORANGE, RED = (0x4E, 0x79, 0xA7), (0xF2, 0x8E, 0x2B), (0xE1, 0x57, 0x59)  # the page's first three colours


def test_a_live_swarm_renders_and_refreshes(driver, tmp_path):
    source = Replay()
    with StatusServer(source) as server:
        severe(driver)
        driver.get(server.url + POLL)
        wait = WebDriverWait(driver, WAIT_S)
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#peers tbody tr")) == 3)
        for peer in (A, B, EVIL):
            assert driver.find_elements(By.CSS_SELECTOR, f'tr[data-peer="{peer}"]')

        # Live: the counter and a peer's round move on without a reload.
        first_count, first_round = int(text(driver, "#refreshes")), row_round(driver, A)
        wait.until(lambda d: int(text(d, "#refreshes")) >= first_count + 2)
        wait.until(lambda d: row_round(d, A) > first_round)
        assert source.calls >= 3

        header = text(driver, "header")
        assert "default" in header and "3f2a9c1b7d4e" in header and "updated" in header
        assert "peer" in text(driver, "#observer") and "loopback" in text(driver, "#observer")
        assert "2 groups of replicas" in text(driver, "#agreement")
        assert A in text(driver, "#connectivity")
        assert not driver.find_element(By.ID, "no-peers").is_displayed()

        # The heat map: 3 x 3 lag cells, the unknown one marked, labels are short ids.
        cells = texts(driver, "#vv-matrix tbody td")
        assert len(cells) == 9 and cells.count("?") == 1
        assert A[-8:] in text(driver, "#vv-matrix thead")

        # The charts: sized, and drawn in the peers' colours (lines and bars, not just an "empty" message).
        for canvas, colours in (("loss-chart", [BLUE, ORANGE, RED]), ("bytes-chart", [BLUE, ORANGE])):
            paint = driver.execute_script(PAINT, canvas, colours)
            assert paint["w"] > 0 and paint["h"] > 0 and paint["cw"] > 300 and paint["ch"] > 100, paint
            assert all(n > 20 for n in paint["near"]), (canvas, paint)
        assert len(driver.find_elements(By.CSS_SELECTOR, "#loss-legend .key")) == 3

        # Untrusted strings are text: the hostile id is shown verbatim and created no element, ran no script.
        evil_row = text(driver, f'tr[data-peer="{EVIL}"]')
        assert "<b>x</b>" in evil_row and "<i>pwn</i>" in evil_row and "<u>relayed</u>" in evil_row
        title = driver.execute_script("return document.querySelector(arguments[0]).title",
                                      f'tr[data-peer="{EVIL}"] td[data-col="peer"]')
        assert title == EVIL
        assert "<svg onload=alert(2)>" in text(driver, "#connectivity")
        assert "digest <img src" in text(driver, "#agreement")  # digests are cut to 8 characters
        injected = driver.execute_script(
            "return document.querySelectorAll('img, svg, i, u, b:not([id]), script:not(:first-of-type)').length")
        assert injected == 0
        assert driver.execute_script("return window.__alerts") == []

        # Fits a 1280-wide window, and makes a real picture.
        assert driver.execute_script("return document.documentElement.scrollWidth") <= 1280
        shot = tmp_path / "status.png"
        assert driver.save_screenshot(str(shot))
        data = shot.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
        assert page_errors(driver, server) == []


def test_an_empty_snapshot_renders_placeholders(driver):
    """What a bootstrap or a fresh status client serves: no self, no peers, no curves. Nothing may throw."""
    with StatusServer(lambda: EMPTY) as server:
        severe(driver)
        driver.get(server.url + POLL)
        WebDriverWait(driver, WAIT_S).until(lambda d: int(text(d, "#refreshes")) >= 2)
        assert driver.find_element(By.ID, "no-peers").is_displayed()
        assert driver.find_elements(By.CSS_SELECTOR, "#peers tbody tr") == []
        assert "bootstrap" in text(driver, "#observer")
        assert "no version vectors yet" in text(driver, "#vv-matrix")
        assert "no replica versions reported yet" in text(driver, "#agreement")
        for canvas in ("loss-chart", "bytes-chart"):
            assert driver.execute_script(PAINT, canvas, [])["w"] > 0
        assert page_errors(driver, server) == []


def test_a_failing_source_keeps_the_last_snapshot_on_screen(driver):
    replay, broken = Replay(), threading.Event()

    def source():
        if broken.is_set():
            raise RuntimeError("snapshot failed")
        return replay()

    with StatusServer(source) as server:
        severe(driver)
        driver.get(server.url + POLL)
        wait = WebDriverWait(driver, WAIT_S)
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#peers tbody tr")) == 3)
        broken.set()
        wait.until(lambda d: d.find_element(By.ID, "error").is_displayed())
        assert "status source failed" in text(driver, "#error")
        assert len(driver.find_elements(By.CSS_SELECTOR, "#peers tbody tr")) == 3
        broken.clear()
        wait.until(lambda d: not d.find_element(By.ID, "error").is_displayed())
        # The only console errors are the failed fetches themselves (Chromium logs a 500 response), no JS errors.
        errors = page_errors(driver, server)
        assert all("500" in m for m in errors), errors


def test_updates_in_flight_are_not_shown_as_divergence(driver):
    """Several version vectors while updates travel: said plainly, without a warning or group letters; the peer
    that is behind is named when the snapshot says the replicas diverged."""
    snap = copy.deepcopy(RECORDED)
    snap["agreement"].update(state="in_flight", behind={})
    with StatusServer(lambda: snap) as server:
        driver.get(server.url + POLL)
        WebDriverWait(driver, WAIT_S).until(lambda d: "replicas in flight" in text(d, "#agreement"))
        shown = text(driver, "#agreement")
        assert "2 versions" in shown and "⚠" not in shown and "groups of replicas" not in shown
        assert driver.find_element(By.ID, "agreement").get_attribute("class") != "split"
        assert "·" not in text(driver, f'tr[data-peer="{EVIL}"] td[data-col="vv"]')  # no group letter
        snap["agreement"].update(state="diverged", behind={EVIL: 75.0})
        WebDriverWait(driver, WAIT_S).until(lambda d: "replicas diverged" in text(d, "#agreement"))
        assert "behind 1 m 15 s" in text(driver, f'tr[data-peer="{EVIL}"] td[data-col="peer"]')
        assert page_errors(driver, server) == []
