"""The outer step, applied by the sender: pseudo-gradient, Nesterov momentum, compression with error feedback,
and the update's weight.

DiLoCo (Douillard et al. 2023) averages the peers' pseudo-gradients and applies outer Nesterov to the
average. That step is linear in the pseudo-gradients, so the mean of per-sender Nesterov steps equals the
Nesterov step of the mean: each sender keeps its own momentum `m` and publishes `d = delta + mu * m`. The
receivers' merge is then a plain weighted sum, which commutes, so replicas that merged the same updates are
equal whatever the arrival order (ARCHITECTURE.md "The merge rule").

Compression error feedback (Seide et al. 2014; Karimireddy et al. 2019): what the codec loses this round is
added to the next round's update, so nothing is lost for good, only delayed.

Both are stored in bfloat16 (`STATE_DTYPE`), and all arithmetic on them is float32, a chunk at a time: a unit
then holds 4 bytes per parameter less (ARCHITECTURE.md "Memory"; BENCHMARKS.md "Big models"). The residual `e`
is already the codec's rounding error, so bfloat16's rounding of it (at most 2^-8 of it, not fed back) is two
orders below what error feedback recovers. `m` is rounded once per round and each rounding decays by mu per
round, so the error in `m` stays within 2^-8 / (1 - mu) of its largest |m| (0.6% at the default mu 0.3, 4% at
DiLoCo's 0.9; rounding errors are unbiased, so the typical one is far smaller) and does not grow over a run.
The simulated swarms' losses moved by at most 0.02% (BENCHMARKS.md "Big models").
"""

from __future__ import annotations

import logging
import math
import mmap
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from p2p_diloco.config import OuterConfig
from p2p_diloco.sync.relayed import Relayed
from p2p_diloco.train.phase import swarm_rounds
from p2p_diloco.wire.codecs import Codec

logger = logging.getLogger(__name__)


def pseudo_gradient(theta0: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """delta = theta at phase start - local params at phase end (a descent direction, like a gradient)."""
    return theta0 - phi


STATE_DTYPE = torch.bfloat16
"""How `m` and `e` are stored (module docstring). The arithmetic on them is float32."""


@dataclass
class OuterState:
    """Sender-side state carried across rounds (checkpointed with the replica)."""

    momentum: torch.Tensor
    error: torch.Tensor
    maps: tuple[mmap.mmap, ...] = ()  # the file mappings behind m and e (`in_files`), else none
    clipped: int = 0  # coordinates the last `outer_update` clipped to its `limit`
    swarm_from: torch.Tensor | None = None  # momentum_source "swarm": theta at our last update, before it merged
    swarm_from_rounds: float = 0.0  # and the swarm's rounds then (`swarm_rounds`)

    @classmethod
    def zeros(cls, numel: int, dtype: torch.dtype = STATE_DTYPE) -> OuterState:
        return cls(momentum=torch.zeros(numel, dtype=dtype), error=torch.zeros(numel, dtype=dtype))

    @classmethod
    def in_files(cls, numel: int, folder: str | Path) -> OuterState:
        """m and e (zeros) in two files under `folder`, mapped into memory. They are used once a round, at the end
        of a phase; `release` then drops their pages from this process (the kernel keeps them in the page cache,
        or writes them out when memory runs short), so during the inner steps a unit holds 8 bytes per parameter
        less. The files are unlinked at once: nothing is left behind, whatever way the process ends."""
        Path(folder).mkdir(parents=True, exist_ok=True)
        tensors, maps = [], []
        for name, dtype in (("momentum", STATE_DTYPE), ("error", STATE_DTYPE)):
            size = dtype.itemsize * numel
            with tempfile.TemporaryFile(dir=folder, prefix=f"outer-{name}-") as f:  # unlinked on creation
                f.truncate(size)  # sparse: reads as zeros
                mapped = mmap.mmap(f.fileno(), size) if numel else None
            if mapped is None:
                tensors.append(torch.zeros(0, dtype=dtype))
                continue
            maps.append(mapped)
            tensors.append(torch.frombuffer(mapped, dtype=dtype))  # writes go to the file's pages
        return cls(momentum=tensors[0], error=tensors[1], maps=tuple(maps))

    def release(self, part: slice | None = None) -> None:
        """Drop the pages of file-backed m and e (all, or those of values `part`) from this process's memory:
        their values stay in the files and come back on the next use. Nothing for m and e in memory."""
        for mapped, tensor in zip(self.maps, (self.momentum, self.error)):
            if part is None:
                mapped.madvise(mmap.MADV_DONTNEED)  # a shared file mapping: the values are in the page cache
            else:
                size = tensor.element_size()
                start, stop, _ = part.indices(len(mapped) // size)
                first = size * start // mmap.PAGESIZE * mmap.PAGESIZE  # madvise wants a page-aligned start
                mapped.madvise(mmap.MADV_DONTNEED, first, size * stop - first)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of `m` and `e` (`STATE_DTYPE`, on the CPU) for a checkpoint."""
        return {"momentum": self.momentum.detach().clone(), "error": self.error.detach().clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore `m` and `e` in place; the shapes must match (the same model)."""
        for name in ("momentum", "error"):
            mine, theirs = getattr(self, name), state[name]
            if theirs.shape != mine.shape:
                raise ValueError(f"outer state {name}: shape {tuple(theirs.shape)}, expected {tuple(mine.shape)}")
            mine.copy_(theirs)  # float32 from an older checkpoint rounds to STATE_DTYPE

    def follow_swarm(self, replica: Any, outer_lr: float) -> None:
        """momentum_source "swarm": m <- the swarm's outer step per round since our last update, (theta then -
        theta now) / outer_lr over the swarm rounds between (at least 1), read off our replica before our own
        update merges: in lockstep exactly the swarm's last round. The first update has none (m stays zero).
        One more float32 vector per unit (theta then)."""
        with replica.lock:
            theta, rounds = replica.theta, swarm_rounds(replica.version_vector)
            if self.swarm_from is None:
                self.swarm_from = theta.clone()
            else:
                elapsed = max(1.0, rounds - self.swarm_from_rounds)
                for c in chunks(theta.numel()):
                    self.momentum[c].copy_((self.swarm_from[c] - theta[c]).div_(outer_lr * elapsed))
                self.swarm_from.copy_(theta)
        self.swarm_from_rounds = rounds

    def skip_rounds(self, k: int, mu: float) -> None:
        """Account for `k` rounds whose updates were published but whose `m`, `e` were lost (a restart from a
        checkpoint older than the last published update; see train/state/manager.py).

        After k more rounds, m = mu^k m_ckpt + sum_j mu^(k-j) delta_j: the deltas are lost, the decayed part is
        exact, so keep only it (keeping m_ckpt whole would re-apply the momentum already spent in those rounds).
        e_ckpt was added into the first lost update, so it is spent: re-adding it would apply it twice; the
        lost rounds' own residual is unknown and small (the codec's error), so e starts again from zero.
        """
        if k <= 0:
            return
        self.momentum.mul_(mu ** k)
        self.error.zero_()


CHUNK = 1 << 22
"""Values per chunk of the outer step's element-wise work (16 MB of float32): its temporaries stay this size
whatever the model's, so the end of a phase needs no full-size scratch vector (ARCHITECTURE.md "Memory")."""


def chunks(n: int, size: int = CHUNK) -> Iterator[slice]:
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


def relay_payload(relayed: Relayed, weight: float, cfg: OuterConfig) -> tuple[torch.Tensor | None, bytes, float, float]:
    """A sponsor's relayed work (`Replica.relay`, sync/sponsorship.py) for `outer_update`: (extra, vouches, own
    share, the weight to sign). The sponsor signs `weight` plus the graduates' work it carries (capped at
    `max_weight`); receivers merge the payload at `outer_lr` times that, so the relayed step (theta's units) is
    divided by it, the proposals' part and the sponsor's own output are scaled by 1 / (1 + t), and its own output
    by `weight` / the signed weight as well: theta moves by its own step, the proposals' and the graduates'."""
    step, vouches, share, carried = relayed
    if step is None or not weight > 0:
        return None, vouches if weight > 0 else b"", 1.0, weight
    own = min(weight, cfg.max_weight)
    signed = min(cfg.max_weight, own + carried / cfg.outer_lr)
    scale = cfg.outer_lr * signed
    displaced = 1.0 / (1.0 + share)
    return step.mul_(displaced / scale), vouches, displaced * own / signed, signed


def outer_update(delta: torch.Tensor, state: OuterState, cfg: OuterConfig, codec: Codec,
                 rounds: int = 1, *, consume: bool = False, limit: float = math.inf,
                 extra: torch.Tensor | None = None, own_share: float = 1.0,
                 replica: Any = None) -> tuple[bytes, torch.Tensor]:
    """Apply momentum and compression to a pseudo-gradient; returns (payload, decompressed payload).

    The sender merges the decompressed payload into its own replica, exactly what receivers get. With `consume`
    the work is done in `delta`'s own buffer, which ends holding the decompressed payload (returned): no
    full-size temporary but one parameter-sized chunk at a time. The arithmetic is the same either way.

    `rounds` = k > 1: a phase stretched to k*H steps (train/loop.py) stands for k rounds. The momentum runs k
    outer rounds on delta/k each, and the payload is the mean of their k Nesterov outputs, signed with k rounds'
    weight (`update_weight` of all its samples): theta moves as k updates of equal deltas would have moved it,
    `m` ends as after k rounds, and the payload stays inside the bound on one round's honest update
    (sync/robust.py). The carried error `e` is kept in one round's units (the payload weighs k times more).

    `extra`, `own_share`: a sponsor's relayed proposals (`relay_payload`): the momentum's output is scaled by
    `own_share` and `extra` added after it, outside the momentum, so it moves theta once.

    `replica` (the sender's) gives the swarm's clock for the outer schedule (`OuterConfig.step_at`), and what
    momentum_source swarm follows.

    `limit` (the run's `MergePolicy.sender_limit`): what goes into the codec is clipped to it, so every peer's
    norm bound passes our update; the excess is dropped, not carried in `e` (a clip that recurs would grow `e`
    without end). `state.clipped` counts the coordinates clipped. Honest runs with the early step stay far inside
    it (0.15-0.2 of the bound on the `test` preset); after the ramp (mu 0.9) some updates clip a few hundred
    coordinates, since the bound stays the early step's (sync/robust.py `honest_coord_bound` says why).
    """
    d = delta if consume else delta.clone()
    if cfg.momentum_source == "swarm" and replica is not None:  # `replica`: the sender's, before its update merges
        state.follow_swarm(replica, cfg.outer_lr)
    # The schedule's step at the swarm's clock as our replica shows it: receivers merge at outer_lr, so the
    # sender scales what enters its momentum by lr / outer_lr (SGD's lr inside the buffer) and uses the mu of now.
    lr, mu = cfg.step_at(swarm_rounds(replica.version_vector) if replica is not None else 0.0)
    if lr != cfg.outer_lr:
        d.mul_(lr / cfg.outer_lr)
    m, e = state.momentum, state.error
    if rounds > 1 and cfg.momentum_source == "own":  # a stretched phase (rare): one more full-size vector for the sum
        part, total = d.div_(rounds), torch.zeros_like(d)
        for c in chunks(d.numel()):
            mc = m[c].float()  # float32 through the k rounds, stored once
            for _ in range(rounds):
                mc.mul_(mu).add_(part[c])
                total[c].add_(part[c] + mu * mc if cfg.nesterov else mc)
            m[c].copy_(mc)
        d.copy_(total.div_(rounds))
        del total
    elif cfg.momentum_source == "swarm":
        # m holds the swarm's last outer step per round (`OuterState.follow_swarm`), nearly the same for every sender
        # (each reads its own replica): heavy-ball d = delta + mu m, or Nesterov's look-ahead d = (1 + mu) delta +
        # mu^2 m, so that in lockstep the swarm's step D_r = (1 + mu) g_r + mu^2 D_{r-1} (long-run g / (1 - mu)).
        # A stretched phase: the mean of its k rounds' outputs, delta / k each, against the same m.
        if rounds > 1:
            d.div_(rounds)
        for c in chunks(d.numel()):
            if cfg.nesterov:
                d[c].mul_(1 + mu).add_(m[c].float(), alpha=mu * mu)
            else:
                d[c].add_(m[c].float(), alpha=mu)
            state.release(c)
    else:
        for c in chunks(d.numel()):
            mc = m[c].float().mul_(mu).add_(d[c])
            m[c].copy_(mc)
            if cfg.nesterov:
                d[c].add_(mc * mu)  # a chunk-sized product: the same rounding as the whole-vector step
            else:
                d[c].copy_(mc)
            state.release(c)  # file-backed m and e: only a chunk of them in memory at a time
    if extra is not None:
        for c in chunks(d.numel()):
            d[c].mul_(own_share).add_(extra[c])
    if cfg.error_feedback:
        for c in chunks(d.numel()):
            d[c].add_(e[c].float() if rounds == 1 else e[c].float() / rounds)
            state.release(c)
    state.clipped = 0
    if math.isfinite(limit):
        for c in chunks(d.numel()):
            state.clipped += int((d[c].abs() > limit).sum())
            d[c].clamp_(-limit, limit)
        if state.clipped:  # a few hundred coordinates are routine after the ramp (mu 0.9); a large share is not
            logger.log(logging.WARNING if state.clipped > d.numel() // 100 else logging.INFO,
                       "own update clipped to the run's norm bound coordinates=%d limit=%.3g (the excess is "
                       "dropped: every peer would refuse it)", state.clipped, limit)
    payload = codec.compress(d)
    if cfg.error_feedback:
        # e <- d - decoded, and d <- decoded, a chunk at a time: d's buffer ends as the decoded payload.
        for c in chunks(d.numel()):
            decoded = codec.decompress_range(payload, d.numel(), c)
            torch.sub(d[c], decoded, out=e[c])
            d[c].copy_(decoded)
            state.release(c)
        if rounds > 1:
            e.mul_(rounds)
    else:
        d.copy_(codec.decompress(payload, d.numel()))
    return payload, d


def update_weight(samples: int, swarm_samples_per_round: float, tau: int, num_peers: int, cfg: OuterConfig) -> float:
    """The weight `w` a sender signs into its update.

    `samples / swarm_samples_per_round` is the share of one swarm round this update represents: with N equal
    peers it is 1/N, so one update from each peer moves theta by one DiLoCo outer step. A slower peer's update
    carries the same per-sample weight; it simply arrives less often. A stretched phase's update (k*H steps)
    carries k rounds' share, and its payload is the mean of the k rounds' outer steps (`outer_update`).

    Staleness damping: in a healthy async round each of the other N-1 peers publishes about once while this
    phase runs, so tau ~ N-1 is normal. Only the excess is damped: w *= (1 + excess / N) ** -power.
    """
    base = samples / max(1e-9, swarm_samples_per_round)
    excess = max(0, tau - (num_peers - 1))
    damp = (1.0 + excess / max(1, num_peers)) ** (-cfg.staleness_power)
    return float(min(cfg.max_weight, base * damp))
