"""The enforcement side of `policy`: one `PeerGuard` per peer, consulted by every RPC we serve and every pull
we make. It composes the gates, each with one job: `Membership` (net/admission/membership.py: allow list and
run secret), `Remotes` (net/admission/remotes.py: per-remote buckets, open streams, penalties), the
contribution `Ledger` and the `Uplink` it shares, and the `Rejections` it counts (net/admission/rejections.py:
what `status` shows, by reason and by remote). The `hello` admission check is in net/admission/hello.py.

Serving (the hooks `rpc.serve` calls, in this order, before reading a request):
    access (allow list, run-secret membership) -> penalty -> open streams -> request rate -> bytes in/out
    -> for pulls and snapshots, the uplink's share and the remote's fair share of it (net/admission/uplink.py)
A refusal goes back to the caller as the RPC's error ("not allowed in this run: ...", "rate limited: ...",
"busy: ..."). Every byte sent is charged to the remote's bytes-out bucket and to the uplink's; the bulk
responses are timed (`sending`) to measure the uplink (`uplink_rate_bps`, net/admission/meter.py).

Calling: `may_pull_from` (not penalized, bytes-in bucket not in debt), `charge_in` for what we read, and
`penalize` when a remote sent us an invalid update.

Open runs (ARCHITECTURE.md "The network"): the guard owns the contribution `ledger` (net/admission/ledger.py),
which gossip and state sync feed, and the `uplink` it shares.

Threading: everything runs on the network loop; nothing here blocks.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable

from p2p_diloco.net.admission.invites import Invitations
from p2p_diloco.net.admission.ledger import Ledger
from p2p_diloco.net.admission.membership import REFUSED_PREFIX, Membership, PeerRecord
from p2p_diloco.net.admission.policy import MembershipKey, RateLimitConfig, request_kind
from p2p_diloco.net.admission.rejections import Rejections
from p2p_diloco.net.admission.remotes import Remotes
from p2p_diloco.net.admission.uplink import Uplink

# Counters of the RPC layer, renamed as rejection reasons.
_RPC_REASONS = {"rejected_oversize": "oversize_request", "rejected_malformed": "malformed_request",
                "timeouts": "timeout", "rejected_busy": "busy"}
_UPLINK_KINDS = ("pull", "snapshot")
"""Requests whose responses are bulk and go through the uplink's shares."""
_METERED = ("pull", "chunk")
"""Handlers whose responses the uplink meter measures (bulk; a manifest's time is mostly taking the snapshot)."""


class PeerGuard:
    """Access, rate limits and rejection counts for one peer (see the module docstring)."""

    def __init__(self, run_id: str, *, self_id: str, limits: RateLimitConfig, allowed: Iterable[str] = (),
                 key: MembershipKey | None = None, invites: Invitations | None = None,
                 refresh_members: Callable[[], Awaitable[object]] | None = None) -> None:
        """`allowed`: the allow list (empty: anyone); `key`: the run secret's (None: no secret); `invites`: the
        operator keys' gate (None: none); `refresh_members`: re-reads the peer records (and feeds them to
        `check_record`) when an unknown caller shows up."""
        self.run_id = run_id
        self.self_id = self_id
        self.limits = limits.validate()
        self.membership = Membership(self_id, allowed=allowed, key=key, invites=invites,
                                     refresh_members=refresh_members)
        self.rejections = Rejections()
        self.ledger = Ledger()
        self.uplink = Uplink(self.limits, self.ledger)
        self.remotes = Remotes(self_id, self.limits, self.ledger)

    # ---- membership (net/admission/membership.py) ---------------------------------------------------------

    @property
    def allowed(self) -> frozenset[str]:
        return self.membership.allowed

    @property
    def key(self) -> MembershipKey | None:
        return self.membership.key

    @property
    def closed(self) -> bool:
        return self.membership.closed

    def check_record(self, peer_id: str, record: PeerRecord) -> str | None:
        """Why the peer of a (signature-checked) record is not a member, or None if it is. Remembered for
        `admit`."""
        return self.membership.check_record(peer_id, record)

    def is_member(self, peer_id: str) -> bool:
        """True if `peer_id` may take part, as far as we know now (no DHT read)."""
        return self.membership.is_member(peer_id)

    async def refusal(self, peer_id: str) -> str | None:
        """Why `peer_id` may not take part, or None; an unknown peer makes us re-read the records (rate-limited)."""
        return await self.membership.refusal(peer_id)

    # ---- the RPC layer's hooks (rpc.serve) ----------------------------------------------------------------

    async def admit(self, caller: str, handler: str, request_bytes: int) -> str | None:
        """Before reading a request: None to serve it (then `release` when done), else the refusal message."""
        why = await self.refusal(caller)
        if why:
            return self._refuse(caller, "not_allowed", REFUSED_PREFIX + why)
        now = time.monotonic()
        self.ledger.seen(caller, now)
        remote = self.remotes.get(caller, now)
        if remote.penalized_until > now:
            return self._refuse(caller, "penalized", f"refused for {remote.penalized_until - now:.0f}s more: you "
                                "sent invalid updates")
        if remote.streams >= self.limits.max_streams_per_peer:
            return self._refuse(caller, "too_many_streams",
                                f"too many streams: {remote.streams} open, limit {self.limits.max_streams_per_peer}")
        kind = request_kind(handler)
        if not self.remotes.bucket(remote, kind, now).take(1.0, now):
            return self._refuse(caller, "rate_limited", f"rate limited: over {self.limits.rate_of(kind):g} {kind} "
                                "requests/s")
        bytes_in = self.remotes.bucket(remote, "bytes_in", now)
        bytes_out = self.remotes.bucket(remote, "bytes_out", now)
        if not (bytes_in.ready(now) and bytes_out.ready(now)):
            return self._refuse(caller, "rate_limited", "rate limited: over the bytes/s allowed per peer")
        if kind in _UPLINK_KINDS:
            why = self.uplink_refusal(caller, now)
            if why:
                return why
        bytes_in.charge(request_bytes, now)
        remote.streams += 1
        return None

    def is_contributor(self, caller: str) -> bool:
        """The ledger's word (net/admission/ledger.py): `caller` gave us verified data (the RPC layer keeps half
        of each handler's slots for such callers)."""
        return self.ledger.is_contributor(caller)

    def release(self, caller: str) -> None:
        self.remotes.release(caller)

    def charge_out(self, caller: str, nbytes: int) -> None:
        now = time.monotonic()
        self.remotes.bucket(self.remotes.get(caller, now), "bytes_out", now).charge(nbytes, now)
        self.uplink.charge(caller, nbytes, now)

    def sending(self, caller: str, handler: str) -> Callable[[int], None] | None:
        """A bulk response (a pull's or a snapshot chunk's) starts sending: the uplink meter counts it until
        the returned `end(bytes_written)` (the RPC layer calls it at the caller's close); None for others."""
        if handler.rsplit("/", 1)[-1] not in _METERED:
            return None
        meter = self.uplink.meter
        meter.begin(time.monotonic())
        return lambda nbytes: meter.end(nbytes, time.monotonic())

    @property
    def uplink_rate_bps(self) -> float | None:
        """This peer's measured upload rate in bytes/s (net/admission/meter.py), None before it is known."""
        return self.uplink.rate_bps()

    @property
    def uplink_budget_bps(self) -> float | None:
        """What this peer may upload: min(uplink_bytes_per_s, measured), None if neither is known."""
        return self.uplink.budget_bps() or None

    def uplink_refusal(self, caller: str, now: float | None = None) -> str | None:
        """Why `caller` may not be served bulk data now (the uplink's share it draws from is spent; counted),
        or None. Asked before a pull or snapshot request, and by the pull handler before each update."""
        refused = self.uplink.refusal(caller, now)
        return self._refuse(caller, *refused) if refused else None

    def on_reject(self, caller: str, counter: str) -> None:
        """The RPC layer refused or cut a stream on its own (oversize, malformed, timeout, slow, busy)."""
        self.rejections.count(caller, _RPC_REASONS.get(counter, counter))

    def _refuse(self, caller: str, reason: str, message: str) -> str:
        self.rejections.count(caller, reason)
        return message

    # ---- our side: pulling from remotes -------------------------------------------------------------------

    def may_pull_from(self, peer: str) -> str | None:
        """Why not to pull from `peer` now (not a member, penalized, its bytes-in bucket in debt), or None."""
        if not self.is_member(peer):
            return "not_allowed"
        now = time.monotonic()
        remote = self.remotes.get(peer, now)
        if remote.penalized_until > now:
            return "penalized"
        if not self.remotes.bucket(remote, "bytes_in", now).ready(now):
            return "rate_limited"
        return None

    def charge_in(self, peer: str, nbytes: int) -> None:
        self.remotes.bucket(self.remotes.get(peer), "bytes_in").charge(nbytes)

    def penalize(self, peer: str, reason: str) -> None:
        """`peer` sent us something invalid: ignore it for `penalty_s` (counted under `reason` elsewhere)."""
        self.remotes.penalize(peer, reason)

    def is_penalized(self, peer: str) -> bool:
        return self.remotes.is_penalized(peer)

    def count(self, peer: str, reason: str, n: int = 1, *, in_totals: bool = True) -> None:
        self.rejections.count(peer, reason, n, in_totals=in_totals)
