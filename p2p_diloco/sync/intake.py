"""Intake: the checks every incoming update meets, in order, before it reaches the replica's theta.

    1. size limit                             decode_update ("oversize")
    2. envelope format version                decode_update ("malformed", "format_version", "bad_header")
    3. run id and spec hash                   decode_update ("wrong_run", "wrong_spec")
   3b. a sender we banned                     wire `claimed_sender`, before the signature ("rejected_banned")
    4. sender's PeerID and signature          decode_update ("bad_header" for a PeerID that is no Ed25519 key,
                                              "bad_signature")
    5. payload digest                         decode_update ("bad_digest"); then the sender against the
                                              RunSpec's allowed_senders ("not_allowed")
    6. (sender, seq) against the vector       Replica ("rejected_banned", "duplicate", "equivocation",
                                              gap: "buffered" or "rejected_buffer_full")
    7. codec and tensor layout vs the RunSpec `check_layout`, called by the replica ("bad_layout")
    8. decompression with bounded output      the codec, numel from the RunSpec ("rejected_invalid")
    9. all values finite                      Replica ("rejected_nonfinite")
   10. norm bound                             MergePolicy.screen ("norm_bound")
   11. merge                                  Replica (theta must stay finite: "rejected_nonfinite")

A banned sender's update costs its header: the sender its header names is read without checking the signature
or hashing the payload, and refused if banned (a flood of a banned crowd's updates, which honest relays that
have not banned it yet keep serving, must not cost a digest and a signature each). The name is unauthenticated:
a forger who names a banned sender only gets its own message dropped, as any rejection would.
Nothing is decompressed before the signature and digest have been checked, and the payload's exact size is
known from the RunSpec before any tensor is built (the allow list is checked once the signature has made
the sender field mean something). A message failing two checks is rejected by the earlier one
(tests/sync/test_intake.py asserts the whole order). Signed rejections from steps 7-11 ban the sender (see
`Replica`, rule 4); the replica runs them before it buffers an update too, so nothing a peer keeps and serves
has failed a check of the update alone. Our codecs refuse non-finite values while decoding (step 8 reports
"rejected_invalid"); step 9 catches what a decoder lets through and an overflowing weight.

Every outcome is counted by reason in `counts` (what `status` shows: everything but merged, buffered and
duplicate is a rejection) and logged once per (sender, reason) per interval. Events that are not outcomes of
one message (gaps skipped, evidence kept or accepted) are counted in `events`.

The replica comes with the spec's merge policy and gap rules (`Replica.from_spec`) and its clock, which the
intake reads too (`Replica.set_clock`: the simulator's, in the simulator). The intake registers a ban listener
that keeps the proof of an equivocation (`evidence`, raw envelopes re-verifiable with
`sync.evidence.check_evidence`) and purges the banned sender from the attached `UpdateStore` (`attach_store`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict, deque

from p2p_diloco.config import RunSpec
from p2p_diloco.sync.evidence import evidence_pair, verified_pair
from p2p_diloco.sync.replica import Replica
from p2p_diloco.sync.store import UpdateStore
from p2p_diloco.sync.types import Conflict, MergeOutcome, UpdateLike
from p2p_diloco.wire.codecs import Codec, get_codec
from p2p_diloco.wire.envelope import OuterUpdate, WireError, claimed_sender, decode_update
from p2p_diloco.wire.herald import decode_herald

logger = logging.getLogger(__name__)

HEADER_ALLOWANCE_BYTES = 4096  # msgpack framing + header + signature; generous, still a hard bound
MAX_EVIDENCE = 16
"""Proofs kept (the most recent senders'); each is two envelopes."""
MAX_UNTAKEN = 256
"""Copies found before the store holds them (`take_back_copies` retries each once, at the next receive)."""
_NOT_REJECTIONS = (MergeOutcome.MERGED, MergeOutcome.BUFFERED, MergeOutcome.DUPLICATE)


def max_update_bytes(spec: RunSpec, numel: int, codec: Codec | None = None) -> int:
    """The largest envelope an honest peer of this run can send (`codec`: the run's, if built already)."""
    codec = codec or get_codec(spec.outer.codec, spec.outer.codec_block)
    return codec.payload_bytes(numel) + HEADER_ALLOWANCE_BYTES


class Intake:
    """Decode, validate and offer incoming updates to one replica, counting every outcome."""

    def __init__(self, spec: RunSpec, numel: int, replica: Replica, *, log_interval_s: float = 30.0) -> None:
        self.spec = spec
        self.spec_hash = spec.spec_hash()
        self.numel = numel
        self.replica = replica
        self.codec: Codec = replica.codec  # the peer's one codec, the spec's (`Replica.from_spec`)
        self.max_bytes = max_update_bytes(spec, numel, self.codec)
        replica.add_ban_listener(self._on_ban)
        self.allowed = frozenset(spec.defence.allowed_senders)
        self.counts: Counter[str] = Counter()
        self.events: Counter[str] = Counter()
        self.evidence: OrderedDict[str, tuple[bytes, bytes]] = OrderedDict()  # sender -> proof
        self.store: UpdateStore | None = None
        self._lock = threading.Lock()  # counts, events, evidence: the network side receives from worker threads
        self._last_log: dict[tuple[str, str], float] = {}
        self._untaken: deque[tuple[str, int]] = deque(maxlen=MAX_UNTAKEN)  # copies found, not in the store yet
        self._log_interval_s = log_interval_s

    def attach_store(self, store: UpdateStore) -> None:
        """Use `store` for the earlier message of an equivocation, and purge banned senders from it."""
        self.store = store
        for sender in list(self.replica.banned):
            store.ban(sender)

    def receive(self, data: bytes, *, source: str = "?") -> tuple[str, OuterUpdate | None]:
        """Check and merge one encoded update; returns (outcome or rejection reason, the update if decoded)."""
        if len(data) <= self.max_bytes and self.replica.banned:
            claimed = claimed_sender(data, self.spec.run_id, self.spec_hash)  # unauthenticated: see above
            if claimed is not None and claimed in self.replica.banned:
                with self._lock:
                    self.counts[MergeOutcome.REJECTED_BANNED.value] += 1
                return MergeOutcome.REJECTED_BANNED.value, None
        try:
            update = decode_update(data, max_bytes=self.max_bytes, run_id=self.spec.run_id,
                                   spec_hash=self.spec_hash)
        except WireError as err:
            return self._reject(err.reason, source, str(err)), None
        if self.allowed and update.sender not in self.allowed:
            return self._reject("not_allowed", update.sender, f"seq={update.seq}"), None
        now_s = self.replica.clock()  # dates gaps (the simulator's clock in the simulator)
        outcome, merged = self.replica.offer(update, check=self.check_layout, now_s=now_s)
        # "merged" counts every merge this offer caused, buffered successors it released included.
        with self._lock:
            self.counts["merged"] += len(merged)
            if outcome is not MergeOutcome.MERGED:
                self.counts[outcome.value] += 1
        if outcome not in _NOT_REJECTIONS:
            self._log(outcome.value, update.sender, f"seq={update.seq}")
        self.expire_gaps(now_s)
        self.take_back_copies()
        return outcome.value, update

    def herald(self, data: bytes, source: str = "?") -> str:
        """A proposal's herald (wire/herald.py), sent ahead of its payload to the run's sponsors: at a sponsor it
        dates the proposal for the copy rule (sync/heralds.py). Returns "heard", "ignored" (not a sponsor, a
        sponsor's own, or a banned sender's) or the rejection reason."""
        standing = self.replica.standing
        if standing is None or not standing.sponsorship.judging:
            return "ignored"
        try:
            header, update_id = decode_herald(data, run_id=self.spec.run_id, spec_hash=self.spec_hash)
        except WireError as err:
            return self._reject(err.reason, source, f"herald: {err}")
        if header.sender in self.replica.banned or (self.allowed and header.sender not in self.allowed) \
                or standing.sponsorship.is_sponsor(header.sender):
            return "ignored"
        with self.replica.lock:
            standing.sponsorship.heard(header.sender, header.seq, update_id, self.replica.clock())
        return "heard"

    def take_back_copies(self) -> None:
        """Take back the weight of merged updates vetting found to be copies only when their original came
        (`Standing.copies_found`): the copy came first and merged on probation; every replica that holds both
        ends with it at weight 0 whatever the order. The copy is looked up in the store (it was kept to be
        served); one no longer held keeps its weight here (counted: `copies_not_held`)."""
        standing = self.replica.standing
        if standing is None:
            return
        with self.replica.lock:
            found = [(sender, seq) for sender, seq, _ in standing.copies_found()]
        with self._lock:  # a copy merged on a worker thread reaches the store a moment later: retried
            todo, self._untaken = [*self._untaken, *found], deque(maxlen=MAX_UNTAKEN)
        for sender, seq in todo:
            update = self.store.get(sender, seq) if self.store is not None else None
            done = update is not None and self.replica.unmerge(update, keep_slot=True)
            with self._lock:
                if done:
                    self.events["copies_taken_back"] += 1
                elif update is None and (sender, seq) in found:
                    self._untaken.append((sender, seq))  # once more, at the next receive
                else:
                    self.events["copies_not_held"] += 1

    def expire_gaps(self, now_s: float | None = None) -> list[UpdateLike]:
        """Skip gaps that waited longer than the RunSpec's gap_timeout_s (`Replica.expire_gaps`); called on
        every receive, and worth calling from a timer (the gossip loop) so a quiet swarm skips too."""
        merged, skipped = self.replica.expire_gaps(now_s)  # None: the replica's clock
        if merged or skipped:
            with self._lock:
                self.counts["merged"] += len(merged)
                self.events["holes_skipped"] += skipped
        return merged

    def accept_evidence(self, first: bytes, second: bytes) -> str:
        """Verify a proof of equivocation received from another peer (`check_evidence`), then ban its sender
        and keep the proof to pass on. Returns the sender; WireError (counted in `events`) if it is no proof."""
        try:
            sender, pair = verified_pair(first, second, run_id=self.spec.run_id, spec_hash=self.spec_hash,
                                         max_bytes=self.max_bytes)
        except WireError:
            with self._lock:
                self.events["evidence_rejected"] += 1
            raise
        with self._lock:
            self._keep(sender, pair)
            self.events["evidence_accepted"] += 1
        if not self.replica.ban(sender, "equivocation evidence from another peer"):
            self._take_back(sender)  # banned before (e.g. a later bad update): its split slot is repaired now
        return sender

    def check_layout(self, update: UpdateLike) -> str | None:
        """The codec and tensor layout must be the RunSpec's, so the payload size is known exactly."""
        if not isinstance(update, OuterUpdate):  # `receive` offers decoded envelopes only
            return "bad_layout"
        h = update.header
        if h.codec != self.spec.outer.codec or h.numel != self.numel:
            return "bad_layout"
        if len(update.payload) != self.codec.payload_bytes(self.numel):
            return "bad_layout"
        return None

    def _on_ban(self, sender: str) -> None:
        """Ban listener (runs once the call that banned has released the replica's lock, so the take-back may
        call `unmerge`): keep the proof if this ban was an equivocation we can prove, take back what rule 7
        says, then purge the sender from the store (after the take-back, which looks its updates up there)."""
        conflict = self.replica.bans.pop_conflict(sender)
        if conflict is not None:
            self._prove(sender, conflict)
        self._take_back(sender)
        if self.store is not None:
            self.store.ban(sender)

    def _take_back(self, sender: str) -> None:
        """Equivocation repair (Replica rule 7): un-merge whichever version of the proven slot we merged, and
        every later seq of the sender we merged and still hold (called before the store forgets them)."""
        with self._lock:
            pair = self.evidence.get(sender)
        if pair is None:
            return
        versions: list[OuterUpdate] = []
        for envelope in pair:
            try:
                versions.append(decode_update(envelope, max_bytes=self.max_bytes, run_id=self.spec.run_id,
                                              spec_hash=self.spec_hash))
            except WireError:  # verified when it was kept; nothing to take back if it no longer decodes
                continue
        if not versions:
            return
        slot, vv = versions[0].seq, self.replica.version_vector
        # Only seqs whose id the replica still knows can be taken back: the newest max_ids_per_sender.
        lowest = max(slot, vv.get(sender) - self.replica.max_ids_per_sender)
        later = [self.store.get(sender, seq) for seq in range(vv.get(sender), lowest, -1) if vv.has(sender, seq)] \
            if self.store is not None else []
        missing = sum(1 for u in later if u is None)
        # Newest first: V shrinks from the top.
        todo: list[UpdateLike] = [*(u for u in later if u is not None), *versions]
        for update in todo:
            if self.replica.unmerge(update):
                with self._lock:
                    self.events["taken_back"] += 1
        if missing:
            logger.warning("equivocation repair incomplete sender=%s: %d later merged update(s) no longer held",
                           sender[:16], missing)

    def _prove(self, sender: str, conflict: Conflict) -> None:
        first = conflict.first
        if first is None and self.store is not None:
            first = self.store.get(sender, conflict.seq)  # the merged one is normally still retained
        second = conflict.second
        pair = None
        if isinstance(first, OuterUpdate) and isinstance(second, OuterUpdate) and first.update_id == conflict.first_id:
            pair = evidence_pair(first, second)
        with self._lock:
            if pair is not None:
                self._keep(sender, pair)
                self.events["evidence_kept"] += 1
            else:
                self.events["evidence_incomplete"] += 1  # banned here; not provable to others
        if pair is None:
            logger.warning("equivocation without a provable pair sender=%s seq=%d (earlier update no longer "
                           "held)", sender[:16], conflict.seq)

    def _keep(self, sender: str, pair: tuple[bytes, bytes]) -> None:
        """Under self._lock."""
        if sender not in self.evidence:
            self.evidence[sender] = pair
            while len(self.evidence) > MAX_EVIDENCE:
                self.evidence.popitem(last=False)

    def _reject(self, reason: str, sender: str, detail: str) -> str:
        with self._lock:
            self.counts[reason] += 1
        self._log(reason, sender, detail)
        return reason

    def _log(self, reason: str, sender: str, detail: str) -> None:
        # Once per (sender, reason) per interval: a hostile peer must not be able to flood our logs.
        now = time.monotonic()
        key = (sender, reason)
        with self._lock:
            if len(self._last_log) > 4096:  # bounded: forged sender names must not grow this forever
                self._last_log.clear()
            due = now - self._last_log.get(key, -1e18) >= self._log_interval_s
            if due:
                self._last_log[key] = now
        if due:
            logger.warning("update rejected reason=%s sender=%s %s", reason, sender[:16], detail)
