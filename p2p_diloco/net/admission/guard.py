"""The enforcement side of `policy`: one `PeerGuard` per peer, consulted by every RPC we serve and every pull
we make, and the `Rejections` it counts (what `status` shows, by reason and by remote).

Serving (the hooks `rpc.serve` calls, in this order, before reading a request):
    access (allow list, run-secret membership) -> penalty -> open streams -> request rate -> bytes in/out
    -> for pulls and snapshots, the uplink's share and the remote's fair share of it (net/admission/uplink.py)
A refusal goes back to the caller as the RPC's error ("not allowed in this run: ...", "rate limited: ...",
"busy: ..."). Every byte sent is charged to the remote's bytes-out bucket and to the uplink's; the bulk
responses are timed (`sending`) to measure the uplink (`uplink_rate_bps`, net/admission/meter.py).

Calling: `may_pull_from` (not penalized, bytes-in bucket not in debt), `charge_in` for what we read, and
`penalize` when a remote sent us an invalid update.

Open runs (issue 16): the guard owns the contribution `ledger` (net/admission/ledger.py), which gossip and state
sync feed, and the `uplink` it shares. Remotes' buckets and penalties are kept in two LRU tables of
`max_tracked_peers` each, one for contributors and one for the others, so a crowd of fresh identities only
churns its own (a newcomer's penalty is worth little anyway: a fresh identity costs nothing).

Admission (`hello`): a joiner asks a few live peers whether it may take part; if every peer that answers
refuses it, `join` stops with their reason (`AccessDenied`). One hostile peer that refuses everyone cannot
keep a member out unless it is the only peer the joiner asks.

Threading: everything runs on the network loop; nothing here blocks.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from p2p_diloco.net.admission.ledger import Ledger
from p2p_diloco.net.admission.policy import (
    MEMBER_PROOF_FIELD,
    MembershipKey,
    RateLimitConfig,
    TokenBucket,
    request_kind,
)
from p2p_diloco.net.admission.uplink import Uplink
from p2p_diloco.net.transport import rpc
from p2p_diloco.net.transport.node import NodeError

logger = logging.getLogger(__name__)

REFUSED_PREFIX = "not allowed in this run: "
"""Every access refusal starts with this; a joiner recognises it in a `hello` answer."""
NOT_IN_ALLOW_LIST = "PeerID not in allow list"
MAX_REJECTION_PEERS = 256
"""Remotes whose rejection counts are kept (least recently counted forgotten first)."""
MAX_MEMBER_CACHE = 4096
MIN_MEMBER_REFRESH_S = 1.0
"""An unknown caller makes us re-read the peer records at most this often (a flood costs one DHT read/s)."""
HELLO_ASKED = 3
"""Live peers a joiner asks for admission."""
HELLO_OK = b"welcome"
# Counters of the RPC layer, renamed as rejection reasons.
_RPC_REASONS = {"rejected_oversize": "oversize_request", "rejected_malformed": "malformed_request",
                "timeouts": "timeout", "rejected_busy": "busy"}
_UPLINK_KINDS = ("pull", "snapshot")
"""Requests whose responses are bulk and go through the uplink's shares."""
_METERED = ("pull", "chunk")
"""Handlers whose responses the uplink meter measures (bulk; a manifest's time is mostly taking the snapshot)."""


class AccessDenied(NodeError):
    """This peer may not take part in the run (allow list or run secret); the message says why and what to do."""


class Rejections:
    """Rejections by reason in all, and by remote for the last `max_peers` remotes counted."""

    def __init__(self, max_peers: int = MAX_REJECTION_PEERS) -> None:
        self.max_peers = max_peers
        self.totals: Counter[str] = Counter()
        self._by_peer: OrderedDict[str, Counter[str]] = OrderedDict()

    def count(self, peer: str, reason: str, n: int = 1, *, in_totals: bool = True) -> None:
        """Count `n` rejections of `reason` against `peer`; `in_totals=False` for reasons already totalled
        elsewhere (the intake counts its own)."""
        if in_totals:
            self.totals[reason] += n
        counts = self._by_peer.pop(peer, None) or Counter()
        counts[reason] += n
        self._by_peer[peer] = counts
        while len(self._by_peer) > self.max_peers:
            self._by_peer.popitem(last=False)

    def of(self, peer: str) -> dict[str, int]:
        return dict(self._by_peer.get(peer, {}))

    def offenders(self, k: int, *, max_reasons: int = 8, ignore: Iterable[str] = ("duplicate",)) -> dict:
        """The `k` remotes with the most rejections (reasons in `ignore` do not rank, e.g. honest duplicates),
        each with its `max_reasons` most frequent reasons."""
        skip = set(ignore)
        ranked = sorted(((sum(n for r, n in c.items() if r not in skip), pid) for pid, c in self._by_peer.items()),
                        reverse=True)
        return {pid: dict(self._by_peer[pid].most_common(max_reasons)) for score, pid in ranked[:k] if score > 0}


@dataclass
class _Remote:
    """What we track of one remote."""

    buckets: dict[str, TokenBucket] = field(default_factory=dict)
    streams: int = 0
    penalized_until: float = 0.0


class PeerGuard:
    """Access, rate limits and rejection counts for one peer (see the module docstring)."""

    def __init__(self, run_id: str, *, self_id: str, limits: RateLimitConfig, allowed: Iterable[str] = (),
                 key: MembershipKey | None = None,
                 refresh_members: Callable[[], Awaitable[Any]] | None = None) -> None:
        """`allowed`: the allow list (empty: anyone); `key`: the run secret's (None: no secret);
        `refresh_members`: re-reads the peer records (and feeds them to `check_record`) when an unknown
        caller shows up."""
        self.run_id = run_id
        self.self_id = self_id
        self.limits = limits.validate()
        self.allowed = frozenset(allowed)
        self.key = key
        self.rejections = Rejections()
        self.ledger = Ledger()
        self.uplink = Uplink(self.limits, self.ledger)
        self._refresh_members = refresh_members
        self._remotes: OrderedDict[str, _Remote] = OrderedDict()  # remotes that never gave us anything
        self._trusted: OrderedDict[str, _Remote] = OrderedDict()  # contributors (ledger.is_contributor)
        self._verdicts: OrderedDict[str, str] = OrderedDict()  # peer -> "" (member) or why not, from its record
        self._refreshed_at = -1e18
        self._refresh_lock: asyncio.Lock | None = None

    @property
    def closed(self) -> bool:
        return bool(self.allowed) or self.key is not None

    # ---- membership ---------------------------------------------------------------------------------------

    def check_record(self, peer_id: str, record: Mapping[str, Any]) -> str | None:
        """Why the peer of a (signature-checked) record is not a member, or None if it is. Remembered for
        `admit`."""
        why = self._why_not(peer_id, record)
        self._verdicts.pop(peer_id, None)
        self._verdicts[peer_id] = why or ""
        while len(self._verdicts) > MAX_MEMBER_CACHE:
            self._verdicts.popitem(last=False)
        return why

    def _why_not(self, peer_id: str, record: Mapping[str, Any] | None) -> str | None:
        if self.allowed and peer_id not in self.allowed:
            return NOT_IN_ALLOW_LIST
        if self.key is None:
            return None
        if record is None:
            return "run secret required (no peer record of yours is on the DHT yet; announce, then retry)"
        proof = record.get(MEMBER_PROOF_FIELD)
        if proof is None:
            return "run secret required (your peer record carries no membership proof: join with --run-secret-file)"
        if not self.key.verify(peer_id, proof):
            return "wrong run secret (the membership proof in your peer record does not verify)"
        return None

    def is_member(self, peer_id: str) -> bool:
        """True if `peer_id` may take part, as far as we know now (no DHT read)."""
        if peer_id == self.self_id or not self.closed:
            return True
        if self.allowed and peer_id not in self.allowed:
            return False
        return self.key is None or self._verdicts.get(peer_id) == ""

    async def refusal(self, peer_id: str) -> str | None:
        """Why `peer_id` may not take part, or None; an unknown peer makes us re-read the records (rate-limited)."""
        if self.is_member(peer_id):
            return None
        if self.key is not None and (not self.allowed or peer_id in self.allowed) \
                and self._verdicts.get(peer_id) is None:
            await self._refresh()
            if self.is_member(peer_id):
                return None
        verdict = self._verdicts.get(peer_id)
        return verdict or self._why_not(peer_id, None)

    async def _refresh(self) -> None:
        if self._refresh_members is None:
            return
        if self._refresh_lock is None:
            self._refresh_lock = asyncio.Lock()
        async with self._refresh_lock:
            if time.monotonic() - self._refreshed_at < MIN_MEMBER_REFRESH_S:
                return
            self._refreshed_at = time.monotonic()
            try:
                await self._refresh_members()
            except Exception as e:  # the DHT being slow must not break the caller's refusal path
                logger.debug("membership refresh failed error=%r", e)

    # ---- the RPC layer's hooks (rpc.serve) ----------------------------------------------------------------

    async def admit(self, caller: str, handler: str, request_bytes: int) -> str | None:
        """Before reading a request: None to serve it (then `release` when done), else the refusal message."""
        why = await self.refusal(caller)
        if why:
            return self._refuse(caller, "not_allowed", REFUSED_PREFIX + why)
        now = time.monotonic()
        self.ledger.seen(caller, now)
        remote = self._remote(caller, now)
        if remote.penalized_until > now:
            return self._refuse(caller, "penalized", f"refused for {remote.penalized_until - now:.0f}s more: you "
                                "sent invalid updates")
        if remote.streams >= self.limits.max_streams_per_peer:
            return self._refuse(caller, "too_many_streams",
                                f"too many streams: {remote.streams} open, limit {self.limits.max_streams_per_peer}")
        kind = request_kind(handler)
        if not self._bucket(remote, kind, now).take(1.0, now):
            return self._refuse(caller, "rate_limited", f"rate limited: over {self.limits.rate_of(kind):g} {kind} "
                                "requests/s")
        bytes_in, bytes_out = self._bucket(remote, "bytes_in", now), self._bucket(remote, "bytes_out", now)
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
        remote = self._find(caller)
        if remote is not None and remote.streams > 0:
            remote.streams -= 1

    def charge_out(self, caller: str, nbytes: int) -> None:
        now = time.monotonic()
        self._bucket(self._remote(caller, now), "bytes_out", now).charge(nbytes, now)
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
        remote = self._remote(peer, now)
        if remote.penalized_until > now:
            return "penalized"
        if not self._bucket(remote, "bytes_in", now).ready(now):
            return "rate_limited"
        return None

    def charge_in(self, peer: str, nbytes: int) -> None:
        self._bucket(self._remote(peer), "bytes_in").charge(nbytes)

    def penalize(self, peer: str, reason: str) -> None:
        """`peer` sent us something invalid: ignore it for `penalty_s` (counted under `reason` elsewhere)."""
        if self.limits.penalty_s > 0 and peer != self.self_id:
            self._remote(peer).penalized_until = time.monotonic() + self.limits.penalty_s
            logger.info("peer penalized peer=%s reason=%s for_s=%g", peer, reason, self.limits.penalty_s)

    def is_penalized(self, peer: str) -> bool:
        remote = self._find(peer)
        return remote is not None and remote.penalized_until > time.monotonic()

    def count(self, peer: str, reason: str, n: int = 1, *, in_totals: bool = True) -> None:
        self.rejections.count(peer, reason, n, in_totals=in_totals)

    # ---- state ------------------------------------------------------------------------------------------

    def _remote(self, peer: str, now: float | None = None) -> _Remote:
        """`peer`'s state, in the table of its class now (contributor or not), most recently seen last."""
        table, other = (self._trusted, self._remotes) if self.ledger.is_contributor(peer) else \
            (self._remotes, self._trusted)
        remote = table.pop(peer, None) or other.pop(peer, None) or _Remote()
        table[peer] = remote
        while len(table) > self.limits.max_tracked_peers:
            table.popitem(last=False)
        return remote

    def _find(self, peer: str) -> _Remote | None:
        return self._trusted.get(peer) or self._remotes.get(peer)

    def _bucket(self, remote: _Remote, kind: str, now: float | None = None) -> TokenBucket:
        bucket = remote.buckets.get(kind)
        if bucket is None:
            limits = self.limits
            rate = {"bytes_in": limits.bytes_in_per_s, "bytes_out": limits.bytes_out_per_s}.get(kind) \
                or limits.rate_of(kind)
            bucket = remote.buckets[kind] = TokenBucket(rate, rate * limits.burst_s, now)
        return bucket


# ---------------------------------------------------------------------------------------------- admission


def hello_name(run_id: str) -> str:
    return f"p2p-diloco/{run_id}/hello"


async def serve_hello(p2p: Any, run_id: str, guard: PeerGuard, timeout_s: float) -> rpc.RpcStats:
    """Answer admission checks: the guard refuses non-members before the handler runs."""
    async def rpc_hello(request: bytes, caller: str) -> bytes:
        return HELLO_OK

    return await rpc.serve(p2p, hello_name(run_id), rpc_hello, max_request_bytes=64, timeout_s=timeout_s,
                           max_concurrent=16, guard=guard, min_bytes_per_s=guard.limits.min_stream_bytes_per_s)


async def ask_admission(p2p: Any, run_id: str, peers: Sequence[str], timeout_s: float) -> dict[str, str]:
    """Ask up to HELLO_ASKED of `peers` whether we may take part; {peer: "ok" | refusal | "no answer: ..."}.

    Raises AccessDenied when every peer that answered refused us with an access refusal.
    """
    asked = random.sample(list(peers), min(HELLO_ASKED, len(peers)))

    async def ask(peer: str) -> str:
        try:
            await rpc.call(p2p, peer, hello_name(run_id), b"", max_response_bytes=64, timeout_s=timeout_s)
            return "ok"
        except rpc.RpcRemoteError as e:
            return e.remote_message
        except Exception as e:  # RpcError, or an old peer without the handler: no verdict
            return f"no answer: {e}"

    answers = dict(zip(asked, await asyncio.gather(*(ask(p) for p in asked))))
    verdicts = [a for a in answers.values() if not a.startswith("no answer")]
    refusals = [a for a in verdicts if a.startswith(REFUSED_PREFIX)]
    if verdicts and len(refusals) == len(verdicts):
        raise AccessDenied(f"{refusals[0]} (refused by {len(refusals)} of {len(asked)} live peer(s) asked). "
                           "Ask the run's operator to add your PeerID (`p2p-diloco id`) to the allow list, or "
                           "for the run secret (--run-secret-file)")
    return answers
