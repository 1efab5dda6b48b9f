"""Closed runs and rate limits: who may take part, and how much of a peer's time one remote may take.

The rules are enforced by net/admission/ (policy.py, guard.py); the settings are here, light, for the CLI.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from p2p_diloco.config.errors import ConfigError

MAX_SECRET_BYTES = 4096
MAX_OPERATORS = 16
_BASE58 = frozenset("123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz")


def looks_like_peer_id(pid: object) -> bool:
    """The shape of an Ed25519 PeerID (12D3KooW..., 52 base58 characters): caught at the flag, not at the key."""
    return isinstance(pid, str) and len(pid) == 52 and pid.startswith("12D3KooW") and set(pid) <= _BASE58


@dataclass(frozen=True)
class AccessConfig:
    """Closed runs: who may take part (`--allow-peers`, shared in the RunSpec) and the run secret (this peer's)."""

    allow_peers: str = ""
    """File of PeerIDs allowed in this run, one per line (# comments); loaded into the RunSpec's
    defence.allowed_senders, so every peer of the run must use the same list (empty: anyone may join)."""
    run_secret: str = ""
    """A secret every member of the run knows (visible in `ps`: prefer --run-secret-file); empty: none."""
    run_secret_file: str = ""
    """File holding the run secret (its first line); members prove they know it, non-members are refused."""
    operators: str = ""
    """Operator keys of a run that admits by invitation: their PeerIDs, comma-separated (`p2p-diloco keygen
    --identity operator.key` prints one). Every peer of the run gives the same (a peer with others is refused);
    the operators' own PeerIDs and the peers they invite (`p2p-diloco invite`) take part. Empty with --invite:
    the invitation's signer."""
    invite: str = ""
    """Invitation file (`p2p-diloco invite`) admitting this peer's --identity to a run with operator keys."""

    def validate(self) -> AccessConfig:
        if self.run_secret and self.run_secret_file:
            raise ConfigError("give the run secret once: --run-secret or --run-secret-file, not both")
        if self.operators and self.allow_peers:
            raise ConfigError("give --allow-peers or --operators, not both: a run with operator keys admits the "
                              "peers they invite (invite the listed peers too: `p2p-diloco invite`)")
        self.operator_ids()
        if self.invite and not Path(self.invite).expanduser().is_file():  # before the node starts, not after
            raise ConfigError(f"--invite {self.invite}: no such file (the operator makes it: `p2p-diloco invite`)")
        return self

    def operator_ids(self) -> tuple[str, ...]:
        """The operator PeerIDs of --operators, sorted and unique; ConfigError names one that is no PeerID
        (net/admission/invites.py also decodes each key)."""
        ids = sorted({entry.strip() for entry in self.operators.split(",") if entry.strip()})
        for pid in ids:
            if not looks_like_peer_id(pid):
                raise ConfigError(f"--operators: '{pid[:60]}' is not an Ed25519 PeerID (12D3KooW..., 52 "
                                  "characters); `p2p-diloco id --identity operator.key` prints an operator key's")
        if len(ids) > MAX_OPERATORS:
            raise ConfigError(f"--operators names {len(ids)} keys; at most {MAX_OPERATORS}")
        return tuple(ids)

    def secret(self) -> bytes | None:
        """The run secret as bytes, or None for a run without one; ConfigError if the file is unusable."""
        self.validate()
        if self.run_secret_file:
            path = Path(self.run_secret_file).expanduser()
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f"cannot read the run secret file {path}: {e}") from None
            lines = text.splitlines()
            secret = lines[0].strip() if lines else ""
            if not secret:
                raise ConfigError(f"the run secret file {path} is empty; put the secret on its first line")
        else:
            secret = self.run_secret
        if not secret:
            return None
        if len(secret.encode()) > MAX_SECRET_BYTES:
            raise ConfigError(f"the run secret is longer than {MAX_SECRET_BYTES} bytes")
        return secret.encode()


@dataclass(frozen=True)
class RateLimitConfig:
    """Per-remote limits on requests and bytes, and pull slots and uplink shared by what remotes gave, so neither
    one remote nor a crowd of fresh identities can take a peer's time from the others."""

    announces_per_s: float = 30.0
    """Announces accepted per remote per second (sustained); more are refused as rate limited. An honest peer
    sends one per update it publishes or pulls, so a few per second even with H=2 on a small model."""
    pulls_per_s: float = 20.0
    """Pull requests served per remote per second (sustained; a catching-up peer pulls back to back)."""
    snapshot_requests_per_s: float = 100.0
    """State-sync manifest and chunk requests served per remote per second (sustained)."""
    evidence_per_s: float = 2.0
    """Equivocation evidence messages accepted per remote per second (each costs two signature checks)."""
    hellos_per_s: float = 1.0
    """Admission checks (`hello`) answered per remote per second."""
    bytes_out_per_s: float = 256e6
    """Bytes served to one remote per second (sustained; one response may overdraw, then it waits)."""
    bytes_in_per_s: float = 256e6
    """Bytes accepted from one remote per second (its requests, and the pull responses we read from it)."""
    burst_s: float = 10.0
    """Each bucket holds this many seconds of its rate: short bursts pass, floods do not."""
    max_streams_per_peer: int = 16
    """Streams one remote may have open on this peer at once (all handlers together)."""
    min_stream_bytes_per_s: float = 16384.0
    """After a grace of one timeout, a stream must average at least this many bytes per second, or it is cut."""
    penalty_s: float = 30.0
    """A remote that sent an invalid update (bad signature, garbage, wrong run or shape, non-finite...) is
    neither pulled from nor listened to for this many seconds (0: never)."""
    max_tracked_peers: int = 1024
    """Remotes whose buckets and counters are kept, for contributors (remotes that gave us verified updates) and
    for the others each (least recently seen forgotten first: a crowd of fresh identities never evicts a
    contributor's)."""
    uplink_bytes_per_s: float = 128e6
    """This peer's uplink budget for serving pulls and snapshots, all remotes together (0: none). Contributors
    share (1 - newcomer_share) of it, the best-scored unchoked_contributors served even beyond it; all other
    remotes share the rest (net/admission/uplink.py)."""
    newcomer_share: float = 0.25
    """Part of uplink_bytes_per_s that ALL remotes which never gave us anything share together, so a crowd of
    fresh identities gets one share, not one each (a refused one is told "busy" and retries)."""
    unchoked_contributors: int = 4
    """Contributors with the best scores (bytes given minus cost), served even when the contributors' part of the
    uplink is spent (tit-for-tat)."""
    probation_pulls: int = 1
    """Pull slots (of gossip.max_concurrent_pulls) shared by remotes that never gave us anything (at least 1, so a
    new honest volunteer is still pulled from); contributors may use every slot."""
    measure_uplink: bool = True
    """Measure this peer's upload rate from its own pull and snapshot responses (net/admission/meter.py) and
    share min(uplink_bytes_per_s, measured) out; the gossip's fanout and serves follow it too."""
    fair_share: bool = True
    """No single remote takes more than its max-min fair share of the uplink over fair_share_window_s: at least
    uplink / remotes served within the window, at least fair_share_floor_bytes_per_s, more when the others take
    less (refused as "busy", counted as uplink_fair_share)."""
    fair_share_window_s: float = 10.0
    """The window over which a remote's fair share of the uplink is counted, in seconds."""
    fair_share_floor_bytes_per_s: float = 128e3
    """A remote may always take this much, however many share the uplink (keep it over min_stream_bytes_per_s)."""
    reserve_charge: float = 3.0
    """Bytes served again to a remote that had them from us already count this many times against its fair
    share (a remote pulling everything in a loop gets a third of its share)."""
    probation_timeout_s: float = 3.0
    """A pull from a remote that never gave us anything must bring each part of its answer within this many
    seconds (at most gossip.rpc_timeout_s), so a remote that stalls holds its slot briefly."""

    def validate(self) -> RateLimitConfig:
        rates = (self.announces_per_s, self.pulls_per_s, self.snapshot_requests_per_s, self.evidence_per_s,
                 self.hellos_per_s, self.bytes_out_per_s, self.bytes_in_per_s)
        if not all(r > 0 for r in rates) or self.burst_s <= 0:
            raise ConfigError("rate limits (the ..._per_s options) and burst_s must be > 0")
        if self.max_streams_per_peer < 1 or self.max_tracked_peers < 1:
            raise ConfigError("max_streams_per_peer and max_tracked_peers must be >= 1")
        if self.min_stream_bytes_per_s < 0 or self.penalty_s < 0 or self.uplink_bytes_per_s < 0:
            raise ConfigError("min_stream_bytes_per_s, penalty_s and uplink_bytes_per_s must be >= 0")
        if not 0 < self.newcomer_share < 1 or self.unchoked_contributors < 0:
            raise ConfigError("newcomer_share must be in (0, 1) and unchoked_contributors >= 0")
        if not (self.fair_share_window_s > 0 and self.fair_share_floor_bytes_per_s >= 0 and self.reserve_charge >= 1):
            raise ConfigError("fair_share_window_s must be > 0, fair_share_floor_bytes_per_s >= 0, reserve_charge >= 1")
        if self.probation_pulls < 1 or not self.probation_timeout_s > 0:
            raise ConfigError("probation_pulls must be >= 1 and probation_timeout_s > 0")
        return self

    def rate_of(self, kind: str) -> float:
        """Requests per second allowed for a kind of request (see `request_kind`)."""
        return {"announce": self.announces_per_s, "pull": self.pulls_per_s, "evidence": self.evidence_per_s,
                "snapshot": self.snapshot_requests_per_s, "hello": self.hellos_per_s}.get(kind, self.pulls_per_s)


@dataclass(frozen=True)
class AdmissionConfig:
    """Who may take part in the run and the per-remote limits (TOML tables [admission.access], [admission.rate])."""

    access: AccessConfig = field(default_factory=AccessConfig)
    """Closed runs: the allow list, the run secret, operator keys and this peer's invitation."""
    rate: RateLimitConfig = field(default_factory=RateLimitConfig)
    """Rate limits per remote peer."""

    def validate(self) -> AdmissionConfig:
        self.access.validate()
        self.rate.validate()
        return self
