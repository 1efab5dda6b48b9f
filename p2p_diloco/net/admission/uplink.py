"""This peer's uplink, shared by reciprocity (issue 16): what we serve (pull responses, snapshot manifests and
chunks) goes first to the remotes that gave us something, and all the others together get ONE share.

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
Every refusal is counted by the guard under `uplink_newcomers` or `uplink_choked` and said to the remote
("busy: ...", which the RPC layer sends back); the gossip's pull handler asks again before each update of a
response and ends it early (a short batch) when the share is spent.
"""

from __future__ import annotations

import time

from p2p_diloco.config.admission import RateLimitConfig
from p2p_diloco.net.admission.ledger import Ledger
from p2p_diloco.net.admission.policy import TokenBucket

UNCHOKE_REFRESH_S = 1.0
"""The unchoked contributors are recomputed at most this often."""
NEWCOMERS_BUSY = ("uplink_newcomers", "busy: the newcomers' share of this peer's uplink is in use (remotes that "
                  "gave it nothing share one); retry in a few seconds")
CONTRIBUTORS_BUSY = ("uplink_choked", "busy: this peer's uplink is over budget and serves the peers that gave it "
                     "most first; retry in a few seconds")


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

    def refusal(self, peer: str, now: float | None = None) -> tuple[str, str] | None:
        """(reason, message) if `peer` may not be served now, else None."""
        if not self.enabled:
            return None
        now = time.monotonic() if now is None else now
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
        if not self.enabled or nbytes <= 0:
            return
        now = time.monotonic() if now is None else now
        bucket = self.contributors if self.ledger.is_contributor(peer) else self.newcomers
        bucket.charge(nbytes, now)
        bucket.tokens = max(bucket.tokens, -bucket.capacity)  # a bounded debt: the unchoked may overdraw

    def unchoked(self, now: float | None = None) -> frozenset[str]:
        """The `unchoked_contributors` best-scored contributors (recomputed at most once per UNCHOKE_REFRESH_S)."""
        now = time.monotonic() if now is None else now
        if now - self._unchoked_at >= UNCHOKE_REFRESH_S:
            self._unchoked = frozenset(self.ledger.top(self.limits.unchoked_contributors))
            self._unchoked_at = now
        return self._unchoked
