"""This peer's uplink, shared by reciprocity (ARCHITECTURE.md "Who counts"): what we serve (pull responses,
snapshot manifests and chunks) goes first to the remotes that gave us something, and all the others together get
ONE share.

The budget, `uplink_bytes_per_s` (0: none, nothing here refuses), is split in two byte buckets (each holds
`burst_s` seconds of its rate, and a debt of at most that much):
  contributors  (1 - newcomer_share) of it, for remotes the ledger counts as contributors (they gave us
                verified updates or a snapshot, and no invalid data since). When it is spent, only the
                `unchoked_contributors` best-scored contributors are still served (tit-for-tat, as BitTorrent
                unchokes its best uploaders; the set is recomputed at most once a second); the others are told
                "busy" and retry.
  newcomers     newcomer_share of it, for every other remote TOGETHER (an optimistic share: a new honest
                volunteer gets its first state and updates, and K fresh identities get one share, not K). A
                newcomer that was served something again (it had it from us already) is served only from the
                upper half of this bucket, so a remote pulling everything in a loop does not starve the first
                pulls of others.
Re-serving also costs the remote's score in the ledger (net/admission/ledger.py), which orders the unchoked.

Bandwidth awareness (net/admission/meter.py): the uplink's rate is MEASURED from our own bulk
responses (`meter`, `rate_bps`), and the budget the two buckets split is min(uplink_bytes_per_s, measured)
once there is a measurement (`measure_uplink`), so on a 20 Mbit/s home link the newcomers share a quarter of
2.5 MB/s, not of 128 MB/s. On top of both buckets, with `fair_share`, no single remote (contributor, unchoked
or not) takes more than its max-min fair share of that budget over `fair_share_window_s` (`FairShare`: at least
budget / remotes served in the window, at least `fair_share_floor_bytes_per_s`), bytes served to it again
counting `reserve_charge` times (`served_again`).

Every refusal is counted by the guard under `uplink_newcomers`, `uplink_choked` or `uplink_fair_share` and said to
the remote ("busy: ...", which the RPC layer sends back); the gossip's pull handler asks again before each
update of a response and ends it early (a short batch) when the share is spent.
"""

from __future__ import annotations

import time

from p2p_diloco.config.admission import RateLimitConfig
from p2p_diloco.net.admission.ledger import Ledger
from p2p_diloco.net.admission.meter import FairShare, UplinkMeter
from p2p_diloco.net.admission.policy import TokenBucket

UNCHOKE_REFRESH_S = 1.0
"""The unchoked contributors are recomputed at most this often."""
NEWCOMERS_BUSY = ("uplink_newcomers", "busy: the newcomers' share of this peer's uplink is in use (remotes that "
                  "gave it nothing share one); retry in a few seconds")
CONTRIBUTORS_BUSY = ("uplink_choked", "busy: this peer's uplink is over budget and serves the peers that gave it "
                     "most first; retry in a few seconds")
FAIR_SHARE_REASON = "uplink_fair_share"


class Uplink:
    """The two shared byte buckets and the unchoked set (see the module docstring)."""

    def __init__(self, limits: RateLimitConfig, ledger: Ledger) -> None:
        self.limits, self.ledger = limits, ledger
        budget = limits.uplink_bytes_per_s
        self.enabled = budget > 0
        share = limits.newcomer_share
        self.contributors = TokenBucket((1 - share) * budget, (1 - share) * budget * limits.burst_s)
        self.newcomers = TokenBucket(share * budget, share * budget * limits.burst_s)
        self._unchoked: frozenset[str] = frozenset()
        self._unchoked_at = -1e18
        self.meter = UplinkMeter()
        self.fair = FairShare(limits.fair_share_window_s, limits.fair_share_floor_bytes_per_s, limits.reserve_charge)
        self._budget = budget

    def rate_bps(self, now: float | None = None) -> float | None:
        """The measured upload rate (bytes/s; None before the first measurement, or with measure_uplink off)."""
        if not self.limits.measure_uplink:
            return None
        return self.meter.rate_bps(time.monotonic() if now is None else now)

    def budget_bps(self, now: float | None = None) -> float:
        """What the buckets and the fair share split: min(uplink_bytes_per_s, measured), whichever is known
        (0: neither)."""
        known = [r for r in (self.rate_bps(now), self.limits.uplink_bytes_per_s or None) if r]
        return min(known) if known else 0.0

    def _rescale(self, now: float) -> None:
        """The buckets follow the measured budget (their saved tokens are kept, within the new capacity)."""
        budget = self.budget_bps(now)
        if not self.enabled or abs(budget - self._budget) <= 0.05 * self._budget:
            return
        self._budget = budget
        share = self.limits.newcomer_share
        for bucket, part in ((self.contributors, 1 - share), (self.newcomers, share)):
            bucket.ready(now)  # refill at the old rate up to now
            bucket.rate, bucket.capacity = part * budget, max(part * budget * self.limits.burst_s, 1.0)
            bucket.tokens = min(bucket.tokens, bucket.capacity)

    def refusal(self, peer: str, now: float | None = None) -> tuple[str, str] | None:
        """(reason, message) if `peer` may not be served now, else None."""
        now = time.monotonic() if now is None else now
        if self.limits.fair_share:
            budget = self.budget_bps(now)
            over = self.fair.over(peer, budget, now) if budget > 0 else None
            if over is not None:
                share, used, n = over
                return FAIR_SHARE_REASON, (f"busy: you took your fair share of this peer's uplink ({used / 1e3:.0f} "
                                           f"kB/s of {share / 1e3:.0f} kB/s: {budget / 1e3:.0f} kB/s among {n} "
                                           "remotes; updates served again count more); retry in a few seconds")
        if not self.enabled:
            return None
        self._rescale(now)
        if self.ledger.is_contributor(peer):
            if self.contributors.ready(now) or peer in self.unchoked(now):
                return None
            return CONTRIBUTORS_BUSY
        bucket = self.newcomers
        if not bucket.ready(now):
            return NEWCOMERS_BUSY
        account = self.ledger.account(peer)
        if account is not None and account.reserved_bytes and bucket.tokens < bucket.capacity / 2:
            return NEWCOMERS_BUSY
        return None

    def charge(self, peer: str, nbytes: int, now: float | None = None) -> None:
        """`nbytes` went out to `peer` (any handler's response frames)."""
        if nbytes <= 0:
            return
        now = time.monotonic() if now is None else now
        self.fair.charge(peer, nbytes, now)
        if not self.enabled:
            return
        bucket = self.contributors if self.ledger.is_contributor(peer) else self.newcomers
        bucket.charge(nbytes, now)
        bucket.tokens = max(bucket.tokens, -bucket.capacity)  # a bounded debt: the unchoked may overdraw

    def served_again(self, peer: str, nbytes: int, now: float | None = None) -> None:
        """Of what went to `peer`, `nbytes` it had from us already: charged to its fair share again."""
        self.fair.charge(peer, nbytes, time.monotonic() if now is None else now, again=True)

    def unchoked(self, now: float | None = None) -> frozenset[str]:
        """The `unchoked_contributors` best-scored contributors (recomputed at most once per UNCHOKE_REFRESH_S)."""
        now = time.monotonic() if now is None else now
        if now - self._unchoked_at >= UNCHOKE_REFRESH_S:
            self._unchoked = frozenset(self.ledger.top(self.limits.unchoked_contributors))
            self._unchoked_at = now
        return self._unchoked
