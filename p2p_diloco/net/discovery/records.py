"""Discovery on the hivemind DHT: the run's spec, and one signed, expiring record per live peer.

Keys (ARCHITECTURE.md "The network"):
    p2p-diloco/<run_id>/spec    regular value: msgpack {"spec": dict, "spec_hash": str}, stored with a far expiry
                                by the first peer and re-stored by every peer that holds the same spec
    p2p-diloco/<run_id>/peers   one subkey per peer, the subkey being its PeerID string; the value is
                                [record_bytes, signature]: record_bytes is msgpack of the record dict, signed
                                with the peer's Ed25519 key under PEER_RECORD_DOMAIN

A peer record says who signed it (`peer_id`, equal to the subkey), for which run (`run_id`) and until when
(`expiration_time`, equal to the DHT expiration). Signing the expiration stops anyone from re-storing an old
record with a later expiry to keep a departed peer "alive"; signing the run id stops replays across runs.

`PeerRecordValidator` enforces this inside the DHT, on store and on read, so a peer cannot write another peer's
record. hivemind hashes keys before validators see them (`DHTRecord.key` is `DHTID.generate(key).to_bytes()`, a
SHA-1 of the msgpack-encoded key, and `DHTRecord.subkey` is the msgpack-encoded subkey), so the validator cannot
match a prefix: it is built for a set of run ids and precomputes their key ids. A stock `hivemind-dht` node has
no such validator and stores anything; our nodes still reject forged records when they *read* them, and
`list_peers` verifies every record again, so a forged record for another peer never reaches a caller.

Rejected records are counted by reason (`record_forged`, `record_malformed`, `record_oversize`,
`record_wrong_run`, `record_replayed`, `record_expiration`): by the validator inside the DHT process (read them
with `validator_counts`) and by `list_peers` for what it drops.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from typing import Any

import msgpack
from hivemind.dht import DHT
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time

from p2p_diloco.net.transport.dht_process import await_mp
from p2p_diloco.net.transport.node import SwarmNode
from p2p_diloco.wire.identity import Identity, sign_blob, verify_blob

logger = logging.getLogger(__name__)

PEER_RECORD_DOMAIN = b"p2p-diloco/peer-record/v1"
MAX_PEER_RECORD_BYTES = 8192
"""Upper bound on one encoded peer record (a dozen multiaddrs and a few numbers fit in ~1 KiB)."""
MAX_PEER_RECORD_TTL_S = 3600.0
"""Records that claim to live longer than this are rejected: a departed peer must vanish within the hour."""
MAX_SPEC_BYTES = 256 * 1024
"""Upper bound on the encoded run spec."""
DEFAULT_RECORD_TTL_S = 60.0
DEFAULT_SPEC_TTL_S = 7 * 24 * 3600.0
_SIGNATURE_BYTES = 64


def spec_key(run_id: str) -> str:
    return f"p2p-diloco/{run_id}/spec"


def peers_key(run_id: str) -> str:
    return f"p2p-diloco/{run_id}/peers"


def _key_id(key: str) -> bytes:
    """What hivemind's validators see as `DHTRecord.key` for `key`."""
    return DHTID.generate(source=key).to_bytes()


def _unpack(data: Any, max_bytes: int) -> Any:
    """msgpack-decode untrusted bytes (size checked first); raises ValueError on anything wrong."""
    if not isinstance(data, bytes) or len(data) > max_bytes:
        raise ValueError(f"not bytes of at most {max_bytes}")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises a zoo of exception types on garbage
        raise ValueError(f"bad msgpack: {e}") from None


# ---------------------------------------------------------------------------------------------- run spec


async def publish_run_spec(node: SwarmNode, run_id: str, spec_dict: dict, spec_hash: str, timeout_s: float,
                           ttl_s: float = DEFAULT_SPEC_TTL_S) -> bool:
    """Store the run spec (or re-store it, pushing its expiry `ttl_s` ahead). False if no DHT node took it."""
    blob = msgpack.packb({"spec": spec_dict, "spec_hash": spec_hash}, use_bin_type=True)
    if len(blob) > MAX_SPEC_BYTES:
        raise ValueError(f"run spec is {len(blob)} bytes encoded; the limit is {MAX_SPEC_BYTES}")
    ok = await node.dht_store(spec_key(run_id), blob, get_dht_time() + ttl_s, timeout_s=timeout_s)
    logger.debug("run spec published run_id=%s spec_hash=%s ok=%s", run_id, spec_hash, ok)
    return ok


async def fetch_run_spec(node: SwarmNode, run_id: str, timeout_s: float) -> tuple[dict, str] | None:
    """The run's (spec_dict, spec_hash) from the DHT, or None if nobody published one (or it is malformed)."""
    found = await node.dht_get(spec_key(run_id), latest=True, timeout_s=timeout_s)
    if found is None:
        return None
    spec = _decode_spec(found.value)
    if spec is None:
        logger.warning("ignoring a malformed run spec on the DHT run_id=%s", run_id)
    return spec


def _decode_spec(value: Any) -> tuple[dict, str] | None:
    try:
        obj = _unpack(value, MAX_SPEC_BYTES)
    except ValueError:
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("spec"), dict) and isinstance(obj.get("spec_hash"), str)):
        return None
    return obj["spec"], obj["spec_hash"]


# ---------------------------------------------------------------------------------------------- peer records


def encode_peer_record(run_id: str, record: dict, identity: Identity, expiration_time: float) -> list[bytes]:
    """The DHT value for `identity`'s record: [record_bytes, signature]."""
    fields = dict(record)
    if fields.setdefault("peer_id", identity.peer_id) != identity.peer_id:
        raise ValueError(f"record peer_id {fields['peer_id']} is not the signer {identity.peer_id}")
    fields["run_id"] = run_id
    fields["expiration_time"] = float(expiration_time)
    fields.setdefault("updated_at", get_dht_time())
    record_bytes = msgpack.packb(fields, use_bin_type=True)
    if len(record_bytes) > MAX_PEER_RECORD_BYTES:
        raise ValueError(f"peer record is {len(record_bytes)} bytes encoded; the limit is {MAX_PEER_RECORD_BYTES}")
    return [record_bytes, sign_blob(identity, PEER_RECORD_DOMAIN, record_bytes)]


def decode_peer_record(run_id: str, subkey: Any, value: Any, expiration_time: float) -> tuple[dict | None, str]:
    """(record, "") if `value` is a valid record of peer `subkey` for `run_id`, else (None, why not)."""
    record, _, why = check_peer_record(run_id, subkey, value, expiration_time)
    return record, why


def check_peer_record(run_id: str, subkey: Any, value: Any, expiration_time: float) -> tuple[dict | None, str, str]:
    """Like `decode_peer_record`, with the reason counted for a rejection: (record | None, reason, why)."""
    if not isinstance(subkey, str):
        return None, "record_malformed", "subkey is not a peer id string"
    if not (isinstance(value, (list, tuple)) and len(value) == 2):
        return None, "record_malformed", "value is not [record, signature]"
    record_bytes, signature = value
    if not (isinstance(signature, bytes) and len(signature) == _SIGNATURE_BYTES):
        return None, "record_malformed", "malformed signature"
    if isinstance(record_bytes, bytes) and len(record_bytes) > MAX_PEER_RECORD_BYTES:
        return None, "record_oversize", f"record is {len(record_bytes)} bytes, limit {MAX_PEER_RECORD_BYTES}"
    try:
        record = _unpack(record_bytes, MAX_PEER_RECORD_BYTES)
    except ValueError as e:
        return None, "record_malformed", f"malformed record: {e}"
    if not isinstance(record, dict):
        return None, "record_malformed", "record is not a map"
    if record.get("peer_id") != subkey:
        return None, "record_forged", "record peer_id differs from its subkey"
    if record.get("run_id") != run_id:
        return None, "record_wrong_run", "record is for another run"
    if record.get("expiration_time") != expiration_time:
        return None, "record_replayed", "signed expiration differs from the DHT expiration"
    if expiration_time > get_dht_time() + MAX_PEER_RECORD_TTL_S:
        return None, "record_expiration", "expiration too far in the future"
    if not verify_blob(subkey, PEER_RECORD_DOMAIN, record_bytes, signature):
        return None, "record_forged", "bad signature (not signed by the subkey's peer)"
    return record, "", ""


async def announce_peer(node: SwarmNode, run_id: str, record: dict, identity: Identity,
                        ttl_s: float = DEFAULT_RECORD_TTL_S, timeout_s: float = 10.0) -> bool:
    """Publish this peer's signed record for `ttl_s` seconds (refresh every ttl_s/3). False if no DHT node took it.

    `record` holds {maddrs, version_vector_total, seq, samples_per_s, loss, ...}; peer_id, run_id, updated_at and
    expiration_time are filled in here.
    """
    if identity.peer_id != node.peer_id:
        raise ValueError(f"identity {identity.peer_id} is not this node's ({node.peer_id})")
    if not 0 < ttl_s <= MAX_PEER_RECORD_TTL_S:
        raise ValueError(f"ttl_s must be in (0, {MAX_PEER_RECORD_TTL_S}], got {ttl_s}")
    expiration_time = get_dht_time() + ttl_s
    value = encode_peer_record(run_id, record, identity, expiration_time)
    return await node.dht_store(peers_key(run_id), value, expiration_time, subkey=identity.peer_id,
                                timeout_s=timeout_s)


async def list_peers(node: SwarmNode, run_id: str, timeout_s: float,
                     rejected: Counter | None = None) -> dict[str, dict]:
    """Live peers of the run: {peer_id: record}, only records that verify against their subkey's PeerID.
    The reasons of the records dropped are counted into `rejected` if given."""
    found = await node.dht_get(peers_key(run_id), latest=True, timeout_s=timeout_s)
    if found is None or not isinstance(found.value, dict):
        if found is not None and rejected is not None:
            rejected["record_malformed"] += 1  # a plain value where the per-peer subkeys should be
        return {}
    peers: dict[str, dict] = {}
    for subkey, item in found.value.items():
        record, reason, why = check_peer_record(run_id, subkey, item.value, item.expiration_time)
        if record is None:
            logger.info("dropping peer record run_id=%s subkey=%.60r reason=%s", run_id, subkey, why)
            if rejected is not None:
                rejected[reason] += 1
            continue
        peers[subkey] = record
    return peers


async def _validator_counts_coro(_dht: DHT, dht_node: DHTNode) -> dict[str, int]:
    """Runs inside the DHT process: the rejection counts of our validator(s) there."""
    counts: Counter = Counter()
    composite = dht_node.protocol.record_validator
    for validator in getattr(composite, "_validators", [composite]):  # hivemind's CompositeValidator
        if isinstance(validator, PeerRecordValidator):
            counts.update(validator.counts)
    return dict(counts)


async def validator_counts(node: SwarmNode, timeout_s: float = 10.0) -> dict[str, int]:
    """Records the DHT validator of this node refused (on store and on read), by reason."""
    return await await_mp(node.dht.run_coroutine(_validator_counts_coro, return_future=True), timeout_s)


# ---------------------------------------------------------------------------------------------- DHT validator


class PeerRecordValidator(RecordValidatorBase):
    """Rejects, on store and on read, peer records of the given runs not signed by their subkey's peer,
    and malformed run specs. Records under other keys pass untouched.

    Pass it to `SwarmNode.start(..., record_validators=[PeerRecordValidator([run_id])])`.
    """

    def __init__(self, run_ids: Iterable[str]):
        self._peer_keys: dict[bytes, str] = {_key_id(peers_key(r)): r for r in run_ids}
        self._spec_keys: dict[bytes, str] = {_key_id(spec_key(r)): r for r in run_ids}
        self.counts: Counter = Counter()  # rejections by reason (inside the DHT process: see validator_counts)

    @property
    def run_ids(self) -> set[str]:
        return set(self._peer_keys.values())

    def validate(self, record: DHTRecord) -> bool:
        run_id = self._peer_keys.get(record.key)
        if run_id is not None:
            return self._validate_peer_record(run_id, record)
        if record.key in self._spec_keys:
            return self._validate_spec(record)
        return True

    def _validate_peer_record(self, run_id: str, record: DHTRecord) -> bool:
        try:
            subkey = _unpack(record.subkey, 256)  # a regular value (subkey None) is never a valid peer record
            value = _unpack(record.value, MAX_PEER_RECORD_BYTES + 128)
        except ValueError as e:
            oversize = len(record.value) > MAX_PEER_RECORD_BYTES + 128
            self.counts["record_oversize" if oversize else "record_malformed"] += 1
            logger.debug("dht rejected peer record run_id=%s reason=%s", run_id, e)
            return False
        _, reason, why = check_peer_record(run_id, subkey, value, record.expiration_time)
        if why:
            self.counts[reason] += 1
            logger.debug("dht rejected peer record run_id=%s subkey=%.60r reason=%s", run_id, subkey, why)
        return not why

    def _validate_spec(self, record: DHTRecord) -> bool:
        try:
            ok = _unpack(record.subkey, 8) is None and _decode_spec(_unpack(record.value, MAX_SPEC_BYTES + 16))
        except ValueError:
            ok = False
        if not ok:
            self.counts["spec_malformed"] += 1
            logger.debug("dht rejected a malformed run spec record")
        return bool(ok)

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, PeerRecordValidator):
            return False
        self._peer_keys.update(other._peer_keys)
        self._spec_keys.update(other._spec_keys)
        self.counts.update(getattr(other, "counts", {}))
        return True


async def read_run(node: SwarmNode, run_id: str, timeout_s: float) -> tuple[str | None, dict[str, dict]]:
    """(the run's spec hash or None, every peer record of the run): what `status` and the status pages show."""
    spec = await fetch_run_spec(node, run_id, timeout_s=timeout_s)
    records = await list_peers(node, run_id, timeout_s=timeout_s)
    return (spec[1] if spec else None), records
