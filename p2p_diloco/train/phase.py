"""One inner phase of a learner unit (train/learner.py): where it started, what it did, and the lr clock's and
the data's inputs to it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from p2p_diloco.config import RunSpec
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.train.data.corpus import Corpus, ShardSampler
from p2p_diloco.train.inner import InnerResult


def swarm_rounds(vv: VersionVector) -> float:
    """How many rounds a unit of the swarm has done, from a version vector: the mean of the senders' counts,
    weighted by those counts (sum c^2 / sum c). Equal counts give that count. A sender with few updates (a
    joiner, a fresh identity, a unit that left early) weighs by what it did: a newcomer with one update moves
    n established senders' clock by less than 1/n of a round (with a plain mean: by c/n), while a unit 4x
    slower still pulls it down by its share."""
    counts = [c for _, c in vv.items() if c > 0]
    total = sum(counts)
    return sum(c * c for c in counts) / total if total else 0.0


def make_sampler(corpus: Corpus | Any, spec: RunSpec, peer_id: str, *, shard: int, num_shards: int,
                 stream: str = ""):
    """The unit's data stream: a byte corpus is cut into `num_shards` shards (train/data/corpus.py); a token
    dataset is read window by window in this unit's own shuffle per epoch, keyed by the PeerID
    (train/data/tokens.py WalkSampler)."""
    if getattr(corpus, "tokenizer_fingerprint", None) is not None:
        from p2p_diloco.train.data.tokens import WalkSampler

        return WalkSampler(corpus.train, peer_id=peer_id, block_size=spec.model.block_size,
                           batch_size=spec.data.batch_size, seed=spec.seed, inner_steps=spec.inner.inner_steps)
    return ShardSampler(corpus.train, shard=shard, num_shards=num_shards, block_size=spec.model.block_size,
                        batch_size=spec.data.batch_size, seed=spec.seed, stream=stream)


@dataclass
class Phase:
    """One inner phase in progress.

    `base` is the replica state phi was last rebased onto and `version_vector` its vector: remote updates
    that reach the replica mid-phase are added to phi too between inner steps (`_rebase`), so the local model
    tracks the swarm instead of re-learning what others already published. The pseudo-gradient
    `base - phi` stays this unit's own progress, and its staleness is only what arrived since the last rebase.
    `base` is the learner's one base buffer, updated in place by rebases; `Learner.finish_phase` turns it into
    the pseudo-gradient and then the decoded update, so read it before the phase finishes.
    """

    base: torch.Tensor
    version_vector: VersionVector
    started_at: float
    steps_done: int = 0
    samples: int = 0
    losses: list[float] = field(default_factory=list)
    compute_s: float = 0.0
    rebases: int = 0
    swarm_rounds: float = 0.0  # `swarm_rounds` of the replica's vector when the phase began (the lr clock's base)
    target_steps: int = 0  # the phase's length: H, or k*H once the round loop stretched it (train/loop.py)

    def result(self) -> InnerResult:
        return InnerResult(steps=self.steps_done, samples=self.samples,
                           mean_loss=sum(self.losses) / max(1, len(self.losses)),
                           last_loss=self.losses[-1] if self.losses else float("nan"), compute_s=self.compute_s)
