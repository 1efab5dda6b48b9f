"""What every peer of a run does with hostile input: the `defence` section of the RunSpec.

Shared and content-hashed with the rest of the spec (config/spec.py), so every replica screens, weights and
clips alike (ARCHITECTURE.md "Invariants"); the rules themselves live in sync/robust.py and sync/standing.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from p2p_diloco.config.admission import looks_like_peer_id
from p2p_diloco.config.errors import require

AGGREGATIONS = ("sum", "coord_clip", "centered_clip")


@dataclass(frozen=True)
class DefenceConfig:
    """What every peer does with hostile input (sync/robust.py, sync/replica.py): shared, so all decide alike."""

    norm_bound: float = 1.0
    """Reject and ban an update with a coordinate above this multiple of the spec's bound on honest updates
    (inner_steps * lr * Adam's step bound / (1 - momentum)); 0 disables."""
    aggregation: str = "sum"
    """How each merged payload is shaped: sum (as signed), coord_clip (each coordinate clipped, identical on
    every peer) or centered_clip (CenteredClip around this replica's recent updates; replicas may differ)."""
    coord_clip: float = 0.25
    """coord_clip: clip each coordinate to this fraction of the spec's bound on honest updates."""
    clip_window: int = 8
    """centered_clip: how many recently merged payloads the centre is computed from."""
    clip_radius: float = 4.0
    """centered_clip: clip radius as a multiple of the median distance of the window's payloads to the centre
    (benchmarks/bench_poison.py: 1.0-2.5 also clip honest updates, and cost 2-9% loss on a clean run)."""
    gap_timeout_s: float = 120.0
    """Seconds a gap in one sender's seqs may stay unfilled before the replica skips it (records a hole,
    merges the later seqs, and still merges the missing one if it turns up)."""
    max_hole_span: int = 16
    """Largest gap (in seqs) that is skipped; a larger one waits, as it needs a state sync, not a skip."""
    allowed_senders: tuple[str, ...] = ()
    """PeerIDs allowed to contribute updates, comma-separated (a closed swarm); empty allows every peer."""
    operators: tuple[str, ...] = ()
    """Operator keys (PeerIDs) of a run that admits by invitation (`p2p-diloco invite`; join's --operators, or the
    signer of its --invite, fills it): in the spec, and its hash, so every peer of the run trusts the same keys."""
    sponsors: tuple[str, ...] = ()
    """Founder keys (PeerIDs) who decide what everyone else's work weighs (sync/sponsorship.py): their updates
    merge at their signed weight (after probation); anyone else's merges at 0 everywhere, and each sponsor relays
    the ones it judges useful inside its own next update, at most one sponsor update's worth for all of them
    together, and an author whose last 2 were useful as a member's (graduation). Empty (the default): probation
    and vetting decide."""
    probation: float = 0.25
    """An author's k-th update merges at probation * 2**(k-1) of its signed weight, capped at 1 (sync/standing.py):
    a fresh identity's first updates count for a fraction while they are vetted; 1 disables."""
    min_agreement: float = -1.0
    """Vetting: an update whose cosine with this replica's reference direction (recent updates in good standing)
    is below this merges with weight 0 (3 in a row distrust its author); -1 disables (the default: a joiner's
    honest first update measured -0.63 against two replicas' references and not a third's, whose replicas then
    differed; late in a run honest updates measured -0.2). A sign-flipped copy early in a run ~-0.9; such copies
    are caught as negated copies whatever this is."""
    max_norm_ratio: float = 0.0
    """Vetting: the same for an update longer than this multiple of the reference's recent norms; 0 disables (the
    default: with H=2 honest updates after a pause or a join measured 3.2-3.9x; a crowd's scaled copies are caught
    as copies, and the norm bound refuses what is far too long)."""
    copy_cosine: float = 0.9999
    """Two payloads of different authors whose |cosine| is at least this are copies (one of them re-signed,
    scaled or negated): the one of an author in good standing wins, the other merges at 0 (taken back if it
    came first); neither in good standing, both merge at 0 (sync/standing.py); 0 disables. A re-signed copy
    decodes to exactly the same direction; honest first updates from one init came within 0.99 at H=2."""
    full_agreement: float = 0.0
    """An author's updates merge at 0 while the average cosine of its updates with the reference is below this;
    0 disables (the default: late in a run honest authors averaged down to -0.17, so any positive threshold
    refuses honest work there; early on, 0.1 keeps noise out)."""

    def reads_payloads(self) -> bool:
        """Vetting that reads an update's payload (the copy rule, the reference's tests) decides its merge weight,
        which then follows from no signed header alone: a group sum cannot carry it (sync/sum_merge.py), so a run
        without sponsors aggregates only with all of these off."""
        return (not self.sponsors and (self.copy_cosine > 0 or self.min_agreement > -1 or self.max_norm_ratio > 0
                                       or self.full_agreement > 0))

    def validate(self) -> None:
        require(self.norm_bound >= 0 and math.isfinite(self.norm_bound),
                f"defence.norm_bound must be a number >= 0, got {self.norm_bound}")
        require(self.aggregation in AGGREGATIONS,
                f"defence.aggregation must be one of {', '.join(AGGREGATIONS)}, got {self.aggregation!r}")
        require(self.coord_clip > 0 and math.isfinite(self.coord_clip),
                f"defence.coord_clip must be a positive number, got {self.coord_clip}")
        require(self.clip_window >= 2, f"defence.clip_window must be >= 2, got {self.clip_window}")
        require(self.clip_radius > 0 and math.isfinite(self.clip_radius),
                f"defence.clip_radius must be a positive number, got {self.clip_radius}")
        require(self.gap_timeout_s > 0, f"defence.gap_timeout_s must be > 0, got {self.gap_timeout_s}")
        require(self.max_hole_span >= 1, f"defence.max_hole_span must be >= 1, got {self.max_hole_span}")
        require(all(isinstance(s, str) and s for s in self.allowed_senders),
                "defence.allowed_senders must be PeerID strings")
        require(all(isinstance(s, str) and s for s in self.operators) and len(self.operators) <= 16,
                "defence.operators must be at most 16 PeerID strings")
        require(len(self.sponsors) <= 64 and len(set(self.sponsors)) == len(self.sponsors),
                f"defence.sponsors must be at most 64 distinct PeerIDs, got {len(self.sponsors)}")
        for pid in self.sponsors:  # a typo would make a founder a stranger whose every update merges at 0
            require(looks_like_peer_id(pid),
                    f"defence.sponsors: '{str(pid)[:60]}' is not an Ed25519 PeerID (12D3KooW..., 52 characters); "
                    "`p2p-diloco id --identity FILE` prints a key's")
        require(0 < self.probation <= 1, f"defence.probation must be in (0, 1], got {self.probation}")
        require(-1 <= self.min_agreement < 1, f"defence.min_agreement must be in [-1, 1), got {self.min_agreement}")
        require(self.copy_cosine == 0 or 0.5 <= self.copy_cosine < 1,
                f"defence.copy_cosine must be 0 (off) or in [0.5, 1), got {self.copy_cosine}")
        require(0 <= self.full_agreement < 1, f"defence.full_agreement must be in [0, 1), got {self.full_agreement}")
        require(self.max_norm_ratio == 0 or self.max_norm_ratio >= 1,
                f"defence.max_norm_ratio must be 0 (off) or >= 1, got {self.max_norm_ratio}")
