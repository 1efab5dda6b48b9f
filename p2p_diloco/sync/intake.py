"""Intake: the checks every incoming update meets, in order, before it reaches the replica.

size -> envelope format -> run id and spec hash -> signature -> payload digest (all in `decode_update`)
-> codec and tensor layout against the RunSpec -> (sender, seq) against the version vector, finiteness
(in `Replica.offer`). Nothing is decompressed before the signature and digest have been checked, and the
payload's exact size is known from the RunSpec before any tensor is built.

Every rejection is counted by reason; the counters are what `status` shows.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

from p2p_diloco.config import RunSpec
from p2p_diloco.sync.replica import MergeOutcome, Replica
from p2p_diloco.wire.codecs import Codec, get_codec
from p2p_diloco.wire.envelope import OuterUpdate, WireError, decode_update

logger = logging.getLogger(__name__)

HEADER_ALLOWANCE_BYTES = 4096  # msgpack framing + header + signature; generous, still a hard bound


def max_update_bytes(spec: RunSpec, numel: int) -> int:
    """The largest envelope an honest peer of this run can send."""
    return get_codec(spec.outer.codec, spec.outer.codec_block).payload_bytes(numel) + HEADER_ALLOWANCE_BYTES


class Intake:
    """Decode, validate and offer incoming updates to one replica, counting every outcome."""

    def __init__(self, spec: RunSpec, numel: int, replica: Replica, *, log_interval_s: float = 30.0):
        self.spec = spec
        self.spec_hash = spec.spec_hash()
        self.numel = numel
        self.replica = replica
        self.codec: Codec = get_codec(spec.outer.codec, spec.outer.codec_block)
        self.max_bytes = max_update_bytes(spec, numel)
        self.counts: Counter[str] = Counter()
        self._counts_lock = threading.Lock()  # the network side receives from worker threads
        self._last_log: dict[tuple[str, str], float] = {}
        self._log_interval_s = log_interval_s

    def receive(self, data: bytes, *, source: str = "?") -> tuple[str, OuterUpdate | None]:
        """Check and merge one encoded update; returns (outcome or rejection reason, the update if decoded)."""
        try:
            update = decode_update(data, max_bytes=self.max_bytes, run_id=self.spec.run_id,
                                   spec_hash=self.spec_hash)
        except WireError as err:
            return self._reject(err.reason, source, str(err)), None
        reason = self.check_layout(update)
        if reason:
            return self._reject(reason, update.sender, f"codec={update.header.codec} numel={update.header.numel}"), None
        outcome, merged = self.replica.offer(update)
        # "merged" counts every merge this offer caused, buffered successors it released included.
        with self._counts_lock:
            self.counts["merged"] += len(merged)
            if outcome is not MergeOutcome.MERGED:
                self.counts[outcome.value] += 1
        if outcome not in (MergeOutcome.MERGED, MergeOutcome.BUFFERED, MergeOutcome.DUPLICATE):
            self._log(outcome.value, update.sender, f"seq={update.seq}")
        return outcome.value, update

    def check_layout(self, update: OuterUpdate) -> str | None:
        """The codec and tensor layout must be the RunSpec's, so the payload size is known exactly."""
        h = update.header
        if h.codec != self.spec.outer.codec or h.numel != self.numel:
            return "bad_layout"
        if len(update.payload) != self.codec.payload_bytes(self.numel):
            return "bad_layout"
        return None

    def _reject(self, reason: str, sender: str, detail: str) -> str:
        with self._counts_lock:
            self.counts[reason] += 1
        self._log(reason, sender, detail)
        return reason

    def _log(self, reason: str, sender: str, detail: str) -> None:
        # Once per (sender, reason) per interval: a hostile peer must not be able to flood our logs.
        now = time.monotonic()
        key = (sender, reason)
        if len(self._last_log) > 4096:  # bounded: forged sender names must not grow this forever
            self._last_log.clear()
        if now - self._last_log.get(key, -1e18) >= self._log_interval_s:
            self._last_log[key] = now
            logger.warning("update rejected reason=%s sender=%s %s", reason, sender[:16], detail)
