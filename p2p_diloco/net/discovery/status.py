"""What a peer tells the swarm about itself, and how we read it.

A peer's DHT record (signed, expiring: see records.py) carries these fields besides those `announce_peer`
fills in (peer_id, run_id, updated_at, expiration_time):

    maddrs                  where to dial it
    reach                   public | private | unknown: whether others can dial it, as its own dial-back probe
                            found (peer/reach.py); the views show this, never a guess from `maddrs`
    state                   "syncing" (joining) | "training" | "done" (finished its rounds, lingering) |
                            "left" (shut down cleanly)
    version_vector_total    updates merged into its replica (sum of its version vector)
    vv_digest               first 16 hex chars of its version vector's digest: equal digests, equal replicas
    seq                     its own last published seq
    round, step             outer rounds and cumulative inner steps done
    loss, eval_loss         last inner-phase mean train loss; last eval loss (None before the first)
    samples_per_s           training throughput over its last round (wall clock)
    samples_per_update      samples in one of its updates (H * batch_size)
    tau                     staleness of its last update
    utilization             share of wall time spent computing since it began training (0-1)
    last_update_at          DHT time it published its last update
    bytes_sent, bytes_received, merged
                            its counters: bytes up and down (updates, pulls, snapshots), remote updates merged
    shard, corpus           data shard and corpus fingerprint (peers on another corpus are flagged)
    member_proof            in a run with a secret: HMAC proof of the secret, bound to the PeerID (admission/policy.py)
    operators, invite, revoked
                            in a run with operator keys: their digest, its invitation, the revocations it carries
                            for the others (admission/invites.py)
    rejected_by             {reason: count} of everything it refused: updates (intake outcomes but merged and
                            buffered) and network refusals (rate_limited, not_allowed, bad_chunk, slow_stream...);
                            the views' `rejected` figure is its sum without honest duplicates (view/figures.py)
    offenders               its worst remotes: {peer_id: {reason: count}} (honest duplicates do not rank)
    banned                  senders it banned (equivocation, invalid or non-finite updates)
    dht_rejected            {reason: count} of peer records its DHT node refused (forged, malformed, oversize...)
    vv                      its version vector {sender: seq}, while it names at most 16 senders

Records come from the network: every reader treats every field as untrusted (`number`, `text`, `counts`).
The optional fields (vv, offenders, dht_rejected, rejected_by) are dropped, in that order, when a record
would not fit the DHT's size limit (`fit_record`).

What the peer process writes for people (round lines, JSON log, final state) lives in peer/output.py; the
`status` table in view/table.py.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any

import msgpack


def shard_for(peer_id: str, num_shards: int) -> int:
    """The default data shard of a peer: int(sha256(peer_id)) mod num_shards (stable across restarts)."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest(), "big") % num_shards


def number(record: Mapping[str, Any], key: str, default: float = 0.0) -> float:
    """A finite number from an untrusted record, or `default`."""
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return default
    return float(value)


def text(record: Mapping[str, Any], key: str, limit: int = 64) -> str:
    value = record.get(key)
    return value[:limit] if isinstance(value, str) else ""


def counts(record: Mapping[str, Any], key: str, limit: int = 64) -> dict[str, int]:
    """A {name: count} field of an untrusted record: string keys and non-negative ints only, at most `limit`."""
    value = record.get(key)
    if not isinstance(value, dict):
        return {}
    out = {k[:64]: v for k, v in value.items()
           if isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0}
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:limit])


OPTIONAL_RECORD_FIELDS = ("vv", "offenders", "dht_rejected", "rejected_by")
"""Dropped in this order when a record would not fit: diagnostics, never what peers act on."""
_RECORD_OVERHEAD_BYTES = 512  # peer_id, run_id, expiration_time and updated_at, filled in when it is signed


def fit_record(record: dict, max_bytes: int) -> dict:
    """`record` without as many optional fields as it takes to fit `max_bytes` once signed fields are added."""
    fitted = dict(record)
    for name in OPTIONAL_RECORD_FIELDS:
        if len(msgpack.packb(fitted, use_bin_type=True)) + _RECORD_OVERHEAD_BYTES <= max_bytes:
            break
        fitted.pop(name, None)
    return fitted


def live(records: Mapping[str, dict]) -> dict[str, dict]:
    """Records of peers that have not announced that they left."""
    return {pid: r for pid, r in records.items() if text(r, "state") != "left"}


def is_quiet(records: Mapping[str, dict], self_id: str, digest: str) -> bool:
    """True when every other live peer has finished its rounds and holds the same replica as we do (equal
    version-vector digests): no update is in flight any more, so our replica is final."""
    return all(text(r, "state") == "done" and text(r, "vv_digest") == digest
               for pid, r in live(records).items() if pid != self_id)


MAX_WEIGHTED_PEERS = 1024  # records are cheap to forge; a flood must not shrink every update's weight to nothing


def swarm_samples_per_round(records: Mapping[str, dict], self_id: str, own_samples: float) -> tuple[int, float]:
    """(num_peers, samples_per_round) for `SwarmView`: live peers that train or are about to, plus us.

    Samples per update are a RunSpec constant (H x batch_size), so every peer's share is taken as ours; a
    remote record's own claim is never used (it could zero or inflate every weight in the swarm).
    """
    peers = [pid for pid, r in live(records).items()
             if pid != self_id and text(r, "state") in ("syncing", "training")]
    num_peers = min(len(peers), MAX_WEIGHTED_PEERS) + 1
    return num_peers, own_samples * num_peers


def short_id(peer_id: str) -> str:
    """The distinguishing tail of a PeerID (every Ed25519 PeerID starts with 12D3KooW)."""
    return peer_id[-8:] if len(peer_id) > 8 else peer_id
