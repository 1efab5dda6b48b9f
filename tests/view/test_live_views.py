"""The views against a live local swarm (a bootstrap and two `join` peers as real processes on 127.0.0.1, each
with `--status-port 0`): the web page in headless Chromium, /metrics against the peer's own counters, the
bootstrap's page, `status --watch` in a pseudo-terminal, and join's progress bars on a terminal.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.faults import peer_id_of
from tests.helpers.swarm import PACED, Launcher, Proc, cli, wait_until

PAGE_RE = r"^status page: (http://127\.0\.0\.1:\d+/)"


def get(url: str, timeout_s: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read()


def page_of(proc: Proc, timeout_s: float = 90.0) -> str:
    return proc.wait_for_line(PAGE_RE, timeout_s).group(1)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("live-views")
    with Launcher(workdir) as launcher:
        boot, bootstrap = launcher.bootstrap(extra=("--status-port", "0"))
        # niced and paced like the other swarms' peers: they train for the whole module (where the kernel has
        # autogroups, as here, nice does not lower their share against other sessions: `Launcher.peer`)
        peers = [launcher.peer(name, bootstrap, "--status-port", "0", *PACED, nice=10) for name in ("a", "b")]
        for proc in peers:
            proc.wait_rounds(2, timeout_s=120)
        yield {"boot": boot, "bootstrap": bootstrap, "peers": peers, "workdir": workdir}


@pytest.mark.slow  # this module's swarm of processes costs 40 s on 2 cores; the default suite keeps the views
# in-process: tests/view/test_metrics.py, test_web.py, test_web_browser.py, test_snapshot.py
def test_metrics_match_the_peers_own_counters(swarm) -> None:
    a = swarm["peers"][0]
    url = page_of(a) + "metrics"

    def scrape_counting_both():
        # Under load a peer counts the other only once it has proven itself (merged work): wait for that scrape.
        samples = {s.name: s.value for f in text_string_to_metric_families(get(url).decode()) for s in f.samples
                   if not s.labels}
        return samples if samples["p2p_diloco_peers_known"] == 2 else None

    samples = wait_until(scrape_counting_both, 90, "a's /metrics to count both peers", procs=[a])
    at_round = int(samples["p2p_diloco_round"])
    # The counters only grow: what a scrape between round r's line and round r+1's says lies between the two.
    lines = {r["round"]: r for r in a.wait_rounds(at_round + 1, timeout_s=60)}
    before, after = lines[at_round], lines[at_round + 1]
    for metric, key in (("p2p_diloco_bytes_sent_total", "bytes_sent"),
                        ("p2p_diloco_bytes_received_total", "bytes_received"),
                        ("p2p_diloco_updates_merged_total", "merged")):
        assert before[key] <= samples[metric] <= after[key], (metric, before[key], samples[metric], after[key])
    assert samples["p2p_diloco_loss"] == before["loss"] and samples["p2p_diloco_tau"] == before["tau"]
    assert samples["p2p_diloco_peers_known"] == before["peers"] == 2


@pytest.mark.slow  # the swarm above
def test_the_bootstrap_page_lists_both_peers(swarm) -> None:
    url = page_of(swarm["boot"])
    ids = {peer_id_of(p) for p in swarm["peers"]}

    def both_training():
        snap = json.loads(get(url + "api/status"))
        rows = {r["peer_id"]: r for r in snap["peers"]}
        return snap if set(rows) >= ids and all(rows[i]["round"] > 0 for i in ids) else None

    snap = wait_until(both_training, 60, "the bootstrap's page to list both peers", procs=[swarm["boot"]])
    assert snap["observer"]["kind"] == "bootstrap" and snap["self"] is None
    assert snap["curves"], "the bootstrap keeps the peers' loss curves"
    request = urllib.request.Request(url + "api/status", method="POST", data=b"{}")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 405


@pytest.mark.slow  # the swarm above
def test_the_page_in_headless_chromium_shows_the_live_swarm(swarm) -> None:
    from p2p_diloco.view.browser import headless_chromium

    try:
        driver = headless_chromium()
    except RuntimeError as e:
        pytest.skip(f"no headless browser here: {e}")
    a = swarm["peers"][0]
    ids = [peer_id_of(p) for p in swarm["peers"]]
    try:
        driver.get(page_of(a))

        def rounds_shown() -> dict[str, int] | None:
            shown = driver.execute_script(
                "return Array.from(document.querySelectorAll('#peers tr[data-peer]'))"
                ".map(r => [r.dataset.peer, r.cells[2].textContent])")
            found = {pid: int(text) for pid, text in shown if text.strip().isdigit()}
            return found if set(found) >= set(ids) else None

        first = wait_until(rounds_shown, 30, "both peers' rows on the page")
        wait_until(lambda: (now := rounds_shown()) and now[ids[0]] > first[ids[0]], 30, "the page to update")
        drawn = driver.execute_script("const c = document.getElementById('loss-chart');"
                                      "return [c.width, c.height, c.toDataURL().length]")
        assert drawn[0] > 100 and drawn[1] > 100 and drawn[2] > 5000, drawn
        severe = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
        assert not severe, severe
        shot = swarm["workdir"] / "status-page.png"
        driver.save_screenshot(str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        driver.quit()


def read_pty(fd: int, until, timeout_s: float, proc: subprocess.Popen) -> bytes:
    """Read the pty until `until(bytes so far)` or the deadline; EOF (the child exited) ends it too."""
    out = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not until(out):
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the child closed its side
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    return out


def run_in_pty(argv: list[str]) -> tuple[subprocess.Popen, int]:
    main, child = pty.openpty()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TERM": "xterm-256color", "COLUMNS": "160", "LINES": "40"}
    proc = subprocess.Popen(argv, stdin=child, stdout=child, stderr=child, env=env, start_new_session=True)
    os.close(child)
    return proc, main


@pytest.mark.slow  # a pty and a second `status` (23 s)
def test_status_watch_in_a_terminal_shows_the_peers_and_leaves_cleanly_on_ctrl_c(swarm) -> None:
    shorts = [peer_id_of(p)[-8:].encode() for p in swarm["peers"]]
    proc, fd = run_in_pty(cli("status", "--watch", "--bootstrap", swarm["bootstrap"], "--interval-s", "0.5",
                              "--timeout-s", "20"))
    try:
        out = read_pty(fd, lambda o: all(s in o for s in shorts), 60, proc)
        assert all(s in out for s in shorts), out[-3000:]
        assert b"training" in out
        proc.send_signal(signal.SIGINT)
        out += read_pty(fd, lambda o: False, 20, proc)
        assert proc.wait(timeout=20) == 0, out[-3000:]
        assert b"Traceback" not in out, out[-3000:]
        assert b"\x1b[?25h" in out[-200:], out[-400:]  # the cursor shown again: the terminal left clean
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        os.close(fd)


@pytest.mark.slow  # an 18-second peer of its own in a pseudo-terminal; the suite's other live views share a swarm
def test_join_shows_progress_bars_on_a_terminal_and_plain_lines_when_piped(swarm, tmp_path: Path) -> None:
    from tests.helpers.swarm import PEER_ARGS

    argv = cli("join", *PEER_ARGS, "--identity", str(tmp_path / "c.key"), "--bootstrap", swarm["bootstrap"],
               "--rounds", "3", "--linger-s", "0", "--checkpoint-every", "0")
    proc, fd = run_in_pty(argv)
    try:
        out = read_pty(fd, lambda o: b"final:" in o, 120, proc)
        assert proc.wait(timeout=30) == 0, out[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        os.close(fd)
    text = out.decode(errors="replace")
    assert "inner phase" in text and "state sync (MB)" in text, text[-3000:]  # the bars (the run had begun)
    assert re.search(r"round\s+3\s+step", text)  # the round lines still print, above the bars
    piped = [line for line in Path(swarm["peers"][1].log_path).read_text().splitlines() if "inner phase" in line]
    assert not piped, "a piped peer draws no bars"
