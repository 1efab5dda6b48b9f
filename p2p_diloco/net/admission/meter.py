"""Bandwidth awareness (ARCHITECTURE.md "The network"): this peer's upload rate measured from its own transfers,
the per-remote fair share of it, and the local settings that follow from it. Pure: no asyncio, no I/O; every
method takes `now` (monotonic seconds).

`UplinkMeter` measures what our bulk responses (pull responses, snapshot manifests and chunks) actually
achieved WHILE we were sending: bytes of whole responses divided by the time at least one of them was being
sent (the union of their sending intervals), so an idle uplink does not read as a slow one and refusing a
remote does not lower the estimate. A sending interval runs from the response's first frame to our END frame
drained (net/transport/rpc_server.py): a completed stream write means the bytes reached the p2pd daemon's
buffers (unix socket, then libp2p's stream window: 256 KB, growing to a few MB), which stop taking more only
when the remote has not acknowledged them, so over responses larger than those buffers the rate is the
delivery rate, and over smaller ones it reads high (the safe side: a peer then adapts less, it never refuses
honest remotes for a link it does not have). The caller's close after our END is not waited for: an honest
puller verifies each update as it reads, and timing to its close measured its CPU, not our link (1.6 MB/s
on loopback where 100 MB/s went through). The handler's own work for a pull (finding and encoding updates)
is inside the interval. Idle periods make no sample: one is taken when sending stops (no response left) once
SAMPLE_BUSY_S of sending and MIN_SAMPLE_BYTES have accumulated, or at a response's end after BUSY_SAMPLE_S of
sending without a pause (a peer that never stops sending: the responses still in flight then count their time
before their bytes, and the next sample gets them). The estimate is an EWMA of the samples (weight ALPHA), held
up by the best recent sample decaying with a half-life of PEAK_HALF_LIFE_S, so one slow reader (which makes a
response slow without the link being so) cannot talk the estimate down quickly; a link never kept busy by
enough streams at once reads slower than it is.

`FairShare` keeps what each remote was served over a sliding window of `window_s` (two buckets, the older
one weighed by how much of it is still in the window): a remote may not take more than its max-min fair share
of the uplink, where the remotes sharing it are those served within the window (and the asker): each of the
others keeps what it took up to the level they all share, and what they leave is the asker's, so the share is
at least uplink / active remotes (the issue's bound) and never under `floor`; a remote alone may take it all.
Bytes served AGAIN (an update or a chunk the remote had from us already) are charged `reserve_charge` times
against its share (not counted as the others' use): a remote that pulls everything in a loop gets a fraction.

`adapted(limit, rate, per_stream, minimum)`: how many streams at `per_stream` B/s the measured rate feeds,
within [minimum, limit] (the configured value is the ceiling; None, no estimate yet: the limit itself).
"""

from __future__ import annotations

import math
from collections import OrderedDict

SAMPLE_BUSY_S = 0.5
"""Seconds of sending that make one rate sample (with MIN_SAMPLE_BYTES)."""
BUSY_SAMPLE_S = 5.0
"""Seconds of sending without a pause after which a response's end makes a sample anyway."""
MIN_SAMPLE_BYTES = 256 << 10
"""Bytes that make one rate sample (with SAMPLE_BUSY_S): small responses alone say little about the link."""
ALPHA = 0.3
"""Weight of the newest sample in the EWMA."""
PEAK_HALF_LIFE_S = 120.0
"""The best sample holds the estimate up, halving its excess over the EWMA every this many seconds."""
MAX_REMOTES = 4096
"""Remotes whose window of served bytes is kept (least recently served forgotten first)."""
ACTIVE_REFRESH_S = 0.5
"""The active remotes are recounted at most this often (and at once when one more is served)."""


class UplinkMeter:
    """This peer's upload rate from its own bulk responses (see the module docstring)."""

    def __init__(self) -> None:
        self.active = 0  # responses being sent now
        self.busy_since = 0.0
        self.bytes = 0  # since the last sample
        self.busy_s = 0.0  # since the last sample
        self.ewma: float | None = None
        self.peak = 0.0
        self.peak_at = 0.0
        self.samples = 0
        self.total_bytes = 0
        self.total_busy_s = 0.0

    def begin(self, now: float) -> None:
        """A bulk response starts sending."""
        if self.active == 0:
            self.busy_since = now
        self.active += 1

    def end(self, nbytes: int, now: float) -> None:
        """A bulk response that `begin` started ended (sent, or cut) after `nbytes` written."""
        if self.active <= 0:
            return
        self.active -= 1
        self.bytes += max(0, nbytes)
        self.total_bytes += max(0, nbytes)
        busy = max(0.0, now - self.busy_since)
        self.busy_s += busy
        self.total_busy_s += busy
        self.busy_since = now  # the others still sending go on from here
        if self.bytes >= MIN_SAMPLE_BYTES and (self.busy_s >= BUSY_SAMPLE_S
                                               or (self.active == 0 and self.busy_s >= SAMPLE_BUSY_S)):
            self._sample(self.bytes / self.busy_s, now)
            self.bytes, self.busy_s = 0, 0.0

    def _sample(self, rate: float, now: float) -> None:
        self.samples += 1
        self.ewma = rate if self.ewma is None else ALPHA * rate + (1 - ALPHA) * self.ewma
        if rate >= self._held_peak(now):
            self.peak, self.peak_at = rate, now

    def _held_peak(self, now: float) -> float:
        if self.ewma is None:
            return 0.0
        excess = max(0.0, self.peak - self.ewma)
        return self.ewma + excess * 0.5 ** (max(0.0, now - self.peak_at) / PEAK_HALF_LIFE_S)

    def rate_bps(self, now: float) -> float | None:
        """The estimated upload rate in bytes/s, or None before the first sample."""
        return None if self.ewma is None else max(self.ewma, self._held_peak(now))


class _Window:
    __slots__ = ("start", "charged", "charged_before", "sent", "sent_before", "last")

    def __init__(self, now: float) -> None:
        self.start, self.last = now, now
        self.charged = self.charged_before = self.sent = self.sent_before = 0.0


class FairShare:
    """Per-remote bytes over a sliding window and the share each may take (see the module docstring)."""

    def __init__(self, window_s: float, floor_bps: float, reserve_charge: float,
                 max_remotes: int = MAX_REMOTES) -> None:
        if not (window_s > 0 and floor_bps >= 0 and reserve_charge >= 1 and max_remotes >= 1):
            raise ValueError("window_s > 0, floor_bps >= 0, reserve_charge >= 1 and max_remotes >= 1 are required")
        self.window_s, self.floor_bps, self.reserve_charge = window_s, floor_bps, reserve_charge
        self.max_remotes = max_remotes
        self._remotes: OrderedDict[str, _Window] = OrderedDict()
        self._active: list[tuple[float, str]] = []  # (bytes/s sent over the window, remote), ascending
        self._active_set: frozenset[str] = frozenset()
        self._counted_at = -math.inf

    def _roll(self, w: _Window, now: float) -> None:
        elapsed = now - w.start
        if elapsed >= 2 * self.window_s:
            w.start, w.charged, w.charged_before, w.sent, w.sent_before = now, 0.0, 0.0, 0.0, 0.0
        elif elapsed >= self.window_s:
            w.start, w.charged_before, w.sent_before = w.start + self.window_s, w.charged, w.sent
            w.charged = w.sent = 0.0

    def charge(self, peer: str, nbytes: float, now: float, *, again: bool = False) -> None:
        """`nbytes` went to `peer`; `again`: of what went, `nbytes` it had from us already (call it on top of
        the plain charge: they count reserve_charge times in all)."""
        if nbytes <= 0:
            return
        w = self._remotes.pop(peer, None) or _Window(now)
        self._remotes[peer] = w
        while len(self._remotes) > self.max_remotes:
            self._remotes.popitem(last=False)
        self._roll(w, now)
        w.charged += nbytes * (self.reserve_charge - 1 if again else 1.0)
        w.sent += 0.0 if again else nbytes
        w.last = now
        if peer not in self._active_set:
            self._counted_at = -math.inf  # a remote newly active: recount at the next ask

    def _in_window(self, w: _Window, now: float, charged: bool) -> float:
        self._roll(w, now)
        current, before = (w.charged, w.charged_before) if charged else (w.sent, w.sent_before)
        return current + before * max(0.0, 1.0 - (now - w.start) / self.window_s)

    def used(self, peer: str, now: float) -> float:
        """Bytes charged to `peer` over the last `window_s` (the older bucket weighed by its part still in it;
        re-served bytes `reserve_charge` times)."""
        w = self._remotes.get(peer)
        return 0.0 if w is None else self._in_window(w, now, charged=True)

    def active(self, now: float) -> frozenset[str]:
        """Remotes served within the last `window_s` (recounted at most every ACTIVE_REFRESH_S)."""
        if now - self._counted_at >= ACTIVE_REFRESH_S:
            live = [(self._in_window(w, now, charged=False) / self.window_s, p) for p, w in self._remotes.items()
                    if now - w.last < self.window_s]
            self._active, self._active_set = sorted(live), frozenset(p for _, p in live)
            self._counted_at = now
        return self._active_set

    def share_bps(self, peer: str, uplink_bps: float, now: float) -> float:
        """What `peer` may take: its max-min fair share of `uplink_bps` among the active remotes (each of
        the others keeps what it took over the window up to the level they all share; what they leave is
        `peer`'s to take), so at least uplink / active remotes, and never under the floor."""
        self.active(now)
        others = [rate for rate, p in self._active if p != peer]  # ascending
        left, slots = uplink_bps, len(others) + 1
        for rate in others:
            if rate * slots > left:
                break
            left, slots = left - rate, slots - 1
        return max(left / slots, self.floor_bps)

    def over(self, peer: str, uplink_bps: float, now: float) -> tuple[float, float, int] | None:
        """(its share in B/s, what it used over the window in B/s, active remotes) if `peer` took its share
        of the window already, else None."""
        share = self.share_bps(peer, uplink_bps, now)
        used = self.used(peer, now)
        if used < share * self.window_s:
            return None
        return share, used / self.window_s, len(self._active_set | {peer})


def adapted(limit: int, rate_bps: float | None, per_stream_bps: float, minimum: int) -> int:
    """Streams the measured rate feeds at `per_stream_bps` each, within [min(minimum, limit), limit]."""
    if rate_bps is None or per_stream_bps <= 0:
        return limit
    return max(min(minimum, limit), min(limit, int(rate_bps // per_stream_bps)))
