"""Who may take part in a closed run: the allow list, the run secret and invitations (net/admission/policy.py and
net/admission/invites.py say how each gate works), judged per PeerID from its signed peer record.

A verdict is remembered per peer (at most MAX_MEMBER_CACHE). An unknown caller makes us re-read the peer records
(at most once per MIN_MEMBER_REFRESH_S, so a flood of strangers costs one DHT read a second) before we refuse it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping

from p2p_diloco.net.admission.invites import Invitations
from p2p_diloco.net.admission.policy import MEMBER_PROOF_FIELD, RECORD_NOT_SEEN, MembershipKey

logger = logging.getLogger(__name__)

REFUSED_PREFIX = "not allowed in this run: "
"""Every access refusal starts with this; a joiner recognises it in a `hello` answer."""
NOT_IN_ALLOW_LIST = "PeerID not in allow list"
MAX_MEMBER_CACHE = 4096
MIN_MEMBER_REFRESH_S = 1.0
"""An unknown caller makes us re-read the peer records at most this often (a flood costs one DHT read/s)."""

PeerRecord = Mapping[str, object]
"""A decoded, signature-checked peer record (net/discovery/records.py)."""


class Membership:
    """The access gates of one peer (see the module docstring). Runs on the network loop."""

    def __init__(self, self_id: str, *, allowed: Iterable[str] = (), key: MembershipKey | None = None,
                 invites: Invitations | None = None,
                 refresh_members: Callable[[], Awaitable[object]] | None = None) -> None:
        """`allowed`: the allow list (empty: anyone); `key`: the run secret's (None: no secret); `invites`: the
        operator keys' gate (None: no operators); `refresh_members`: re-reads the peer records (and feeds them
        to `check_record`)."""
        self.self_id = self_id
        self.allowed = frozenset(allowed)
        self.key = key
        self.invites = invites
        self._refresh_members = refresh_members
        self._verdicts: OrderedDict[str, str] = OrderedDict()  # peer -> "" (member) or why not, from its record
        self._refreshed_at = -1e18
        self._refresh_lock: asyncio.Lock | None = None

    @property
    def closed(self) -> bool:
        return bool(self.allowed) or self._by_record

    @property
    def _by_record(self) -> bool:
        """Whether membership is read from peer records (a run secret's proof, an invitation)."""
        return self.key is not None or self.invites is not None

    def check_record(self, peer_id: str, record: PeerRecord) -> str | None:
        """Why the peer of a (signature-checked) record is not a member, or None if it is. Remembered for
        `refusal`. Any record, a member's or not, may carry revocations: they are kept first."""
        if self.invites is not None:
            for revoked in self.invites.learn(record):
                why = self.invites.revoked_why(revoked)
                if why and revoked in self._verdicts:  # cut off now, not at its record's next read
                    self._remember(revoked, why)
        why = self._why_not(peer_id, record)
        self._remember(peer_id, why or "")
        return why

    def record_fields(self) -> dict[str, object]:
        """What our own record carries for the invitation gate (nothing in a run without operator keys)."""
        return self.invites.record_fields() if self.invites is not None else {}

    def _remember(self, peer_id: str, why: str) -> None:
        self._verdicts.pop(peer_id, None)
        self._verdicts[peer_id] = why
        while len(self._verdicts) > MAX_MEMBER_CACHE:
            self._verdicts.popitem(last=False)

    def is_member(self, peer_id: str) -> bool:
        """True if `peer_id` may take part, as far as we know now (no DHT read)."""
        if peer_id == self.self_id or not self.closed:
            return True
        if self.allowed and peer_id not in self.allowed:
            return False
        return not self._by_record or self._verdicts.get(peer_id) == ""

    async def refusal(self, peer_id: str) -> str | None:
        """Why `peer_id` may not take part, or None; an unknown peer makes us re-read the records (rate-limited)."""
        if self.is_member(peer_id):
            return None
        if self._by_record and (not self.allowed or peer_id in self.allowed) \
                and self._verdicts.get(peer_id) is None:
            await self._refresh()
            if self.is_member(peer_id):
                return None
        verdict = self._verdicts.get(peer_id)
        return verdict or self._why_not(peer_id, None)

    def _why_not(self, peer_id: str, record: PeerRecord | None) -> str | None:
        if self.allowed and peer_id not in self.allowed:
            return NOT_IN_ALLOW_LIST
        if self.key is None:
            return self.invites.why_not(peer_id, record) if self.invites is not None else None
        if record is None:
            return f"run secret required ({RECORD_NOT_SEEN})"
        proof = record.get(MEMBER_PROOF_FIELD)
        if proof is None:
            return "run secret required (your peer record carries no membership proof: join with --run-secret-file)"
        if not self.key.verify(peer_id, proof):
            return "wrong run secret (the membership proof in your peer record does not verify)"
        return self.invites.why_not(peer_id, record) if self.invites is not None else None

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
