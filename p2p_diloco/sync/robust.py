"""Robust merging: the norm bound, coordinate-wise clipping and CenteredClip (ARCHITECTURE.md "Invariants").

The rule that decides everything here (ARCHITECTURE.md "The merge rule"): replicas that merged the same set of updates
must be equal. A test that depends on what *this* receiver saw recently (e.g. "k times the median norm of the
last updates I merged") is evaluated differently by receivers that saw different updates; where they decide
differently one bans a sender the other keeps merging, and the replicas drift apart for good. So the hard
test, the one that bans, depends only on the update itself and the RunSpec:

**Norm bound (reject and ban).** AdamW moves a coordinate by at most about `lr` per step: with
`beta1**2 < beta2`, Cauchy-Schwarz on Adam's two running averages gives `|m_hat| / sqrt(v_hat) <=
sqrt((1-beta1)**2 / ((1-beta2) (1 - beta1**2/beta2)))` (1.165 for 0.9/0.95), and 1 at the first step. So an
inner phase moves a coordinate by at most `H * lr * adam_step_bound`, and the sender's outer momentum
(Nesterov `d = delta + mu*m`, or heavy ball `d = m`) by at most `1 / (1 - mu)` times that (mu of the outer
schedule's early step: `honest_coord_bound` says why not its late one's). `honest_coord_bound` is that number;
an update whose decoded payload has a coordinate above `norm_bound` times it is rejected and its sender banned
(a rejected seq is a gap the sender can never fill, see `Replica`). Every honest peer computes the same verdict
from the same bytes. The bound is an L-infinity norm: the one norm for which a per-coordinate optimizer gives a
bound that does not depend on the model's size. It leaves out two small terms, which `norm_bound` > 1 would
absorb: decoupled weight decay (`lr * wd * |phi|` per step) and the carried compression error (at most half a
quantization step: 1/254 of a block's peak for int8, 1/14 for int4). On the `test` preset the largest honest
coordinate is 0.15-0.2 of the bound with the early step (benchmarks/bench_poison.py).
Considered and not taken: a bound relative to the sender's own previous norms (identical everywhere except
across holes, but an attacker can grow it geometrically, and it trips on honest warm-up) and one relative
to the recent norms of all senders (receiver-dependent, see above).

An honest sender must never trip it: it clips its own payload to `MergePolicy.sender_limit` before
compressing it (train/outer.py `outer_update(limit=)`), so the worst an unusually large honest update suffers
is a clip (the learner logs it). Without it an honest unit whose model an attack had driven far (weight decay's
term grows with |phi|) refused its own update and stopped (BENCHMARKS' "broke down" rows of the crowd bench).

**Aggregation (how each payload is shaped before the weighted sum), `defence.aggregation`:**
- `sum`: as signed (DiLoCo's merge).
- `coord_clip`: each coordinate clipped to `coord_clip * honest_coord_bound`; depends only on the update
  and the spec, so replicas stay exactly equal; an attacker keeps its slot but its update is bounded per
  coordinate (the bound is loose: a scaled-up update still becomes a full-magnitude sign update).
- `centered_clip`: CenteredClip (Karimireddy, He and Jaggi 2021, "Learning from History for Byzantine Robust
  Optimization"; used in Gorbunov et al. 2022, BTARD): each update `x` is replaced by `c + clip(x - c, tau)`,
  where `c` is the CenteredClip aggregate of the last `clip_window` payloads this replica merged and `tau`
  is `clip_radius` times their median distance to `c`. It compares updates *across* senders, which is what
  a sign-flipped update needs, and so it is receiver-dependent: the window is what this replica merged
  recently, in its arrival order. Where no clipping happens (`|x - c| <= tau`) the update is merged exactly
  as sent, so replicas differ only by the clipped updates' `c` and `tau`: divergence is bounded per clipped
  update and is left to the repair (ARCHITECTURE.md "The network"). benchmarks/bench_poison.py measures it. Memory:
  `clip_window` copies of the parameters; compute: `CLIP_ITERS` passes over the window per merge. A replica's
  first merge has nothing to be compared with: keep the norm bound on with it (the default).
"""

from __future__ import annotations

import math
from collections import deque

import torch
from torch import Tensor

from p2p_diloco.config import DefenceConfig, RunSpec
from p2p_diloco.sync.decoded import Decoded

CLIP_ITERS = 3
"""CenteredClip iterations per merge, each starting from the previous centre (the paper finds 1-3 enough)."""
SENDER_MARGIN = 0.999
"""An honest sender clips to this fraction of a bound: decoding must not round it over (int8 codes decode
to at most their block's peak; fp16 rounds by 2**-11 relative)."""


def adam_step_bound(beta1: float, beta2: float) -> float:
    """Upper bound on |m_hat| / sqrt(v_hat), i.e. on one AdamW step of a coordinate in units of lr (weight
    decay aside). ValueError if beta1**2 >= beta2: then no bound exists."""
    if not beta1 * beta1 < beta2:
        raise ValueError(f"Adam's step has no bound when beta1**2 >= beta2 (beta1={beta1}, beta2={beta2}); "
                         "set defence.norm_bound to 0 or change the betas")
    # sum_k (1-b1) b1^k g_k <= sqrt(sum_k (1-b1)^2 (b1^2/b2)^k / (1-b2)) * sqrt(sum_k (1-b2) b2^k g_k^2)
    asymptotic = math.sqrt((1 - beta1) ** 2 / ((1 - beta2) * (1 - beta1 * beta1 / beta2)))
    return max(1.0, asymptotic)  # bias correction makes the first step exactly 1


def honest_coord_bound(spec: RunSpec) -> float:
    """The most an honest update (decoded payload) can move one coordinate: H * lr * adam / (1 - mu).

    With the outer schedule's ramp (`OuterConfig.step_at`) it stays the early step's (outer_lr, momentum), not its
    worst end's: a bound that followed the ramp to DiLoCo's lr 0.7, mu 0.9 would be 3.5x looser, and one attacker
    sending every coordinate just under it took an honest run's loss from 1.98 to 36.8 (4.7 under this bound;
    BENCHMARKS.md "The outer step's ramp"). An honest sender under the late step clips instead (`sender_limit`)."""
    inner, outer = spec.inner, spec.outer
    per_phase = inner.inner_steps * inner.lr * adam_step_bound(inner.beta1, inner.beta2)
    return per_phase / (1.0 - outer.momentum)


def peak(x: Tensor) -> float:
    """max |x_i| without allocating a full-size temporary."""
    return float(torch.linalg.vector_norm(x, ord=math.inf)) if x.numel() else 0.0


def centered_clip(points: Tensor, center: Tensor, tau: float, iters: int = CLIP_ITERS) -> Tensor:
    """CenteredClip: `v <- v + mean_i (x_i - v) * min(1, tau / |x_i - v|)`, `iters` times from `center`.

    `points` is (n, d). With tau = inf it is the mean after one step; each point moves the result by at most
    tau / n, whatever its value: the robustness argument of the paper.
    """
    v = center.clone()
    for _ in range(iters):
        diff = points - v
        dist = torch.linalg.vector_norm(diff, dim=1)
        scale = torch.clamp(tau / dist.clamp_min(1e-30), max=1.0)
        v += (diff * scale[:, None]).mean(0)
    return v


class CenteredClipWindow:
    """The receiver-side state of `centered_clip` aggregation: recent payloads, their centre and radius."""

    def __init__(self, window: int, radius: float) -> None:
        self.radius = radius
        self.points: deque[Tensor] = deque(maxlen=window)
        self.min_fill = max(2, window // 2)
        self.center: Tensor | None = None
        self.tau = math.inf

    def shape(self, x: Tensor) -> Tensor:
        """`x` itself if it is within `tau` of the centre (bit-exact), else pulled onto that sphere. While the
        window fills, the centre is 0 and tau is `radius` times the median norm merged so far (plain norm
        clipping), so that a replica's first merges are not free for all; its very first one is unclipped."""
        if not self.points:
            return x
        if self.center is None or len(self.points) < self.min_fill:
            tau = self.radius * float(torch.stack([p.norm() for p in self.points]).median())
            norm = float(torch.linalg.vector_norm(x))
            return x if norm <= tau else x * (tau / norm)
        diff = x - self.center
        dist = float(torch.linalg.vector_norm(diff))
        if dist <= self.tau:
            return x
        return self.center + diff * (self.tau / dist)

    def observe(self, x: Tensor) -> None:
        """Add a merged payload (as received: clipping inside the centre's iteration handles outliers)."""
        self.points.append(x.detach().clone())
        if len(self.points) < self.min_fill:
            return
        stacked = torch.stack(list(self.points))
        start = self.center if self.center is not None else stacked.median(dim=0).values
        tau = self._median_distance(stacked, start)
        self.center = centered_clip(stacked, start, tau)
        self.tau = self.radius * self._median_distance(stacked, self.center)

    @staticmethod
    def _median_distance(stacked: Tensor, center: Tensor) -> float:
        return float(torch.linalg.vector_norm(stacked - center, dim=1).median())


class MergePolicy:
    """The RunSpec's rules between decoding a payload and the axpy; one instance per replica.

    `screen` (stateless, any thread) says why a payload is refused; `shape` and `observe` run under the
    replica's lock (centered_clip keeps state); `sender_limit` is what an honest learner clips its own
    payload to before compressing it (train/outer.py), so that its update passes every peer's `screen`.
    """

    def __init__(self, defence: DefenceConfig, coord_bound: float) -> None:
        defence.validate()
        if not (coord_bound > 0 and math.isfinite(coord_bound)):
            raise ValueError(f"coord_bound must be a positive number, got {coord_bound}")
        self.defence = defence
        self.coord_bound = coord_bound
        self.reject_above = defence.norm_bound * coord_bound if defence.norm_bound > 0 else math.inf
        self.clip_at = defence.coord_clip * coord_bound if defence.aggregation == "coord_clip" else math.inf
        self.window = (CenteredClipWindow(defence.clip_window, defence.clip_radius)
                       if defence.aggregation == "centered_clip" else None)

    @classmethod
    def from_spec(cls, spec: RunSpec) -> MergePolicy:
        bound = honest_coord_bound(spec) if spec.defence.norm_bound > 0 or \
            spec.defence.aggregation == "coord_clip" else 1.0
        return cls(spec.defence, bound)

    @classmethod
    def passthrough(cls) -> MergePolicy:
        """No screening, plain sum: the replica's rule when no RunSpec is bound to it (unit tests)."""
        return cls(DefenceConfig(norm_bound=0.0), 1.0)

    @property
    def deterministic(self) -> bool:
        """True if every replica shapes a given payload identically (all modes but centered_clip)."""
        return self.window is None

    @property
    def step_ceiling(self) -> float:
        """Largest |coordinate| of a payload as merged (after `screen` and `shape`); inf without a bound.
        CenteredClip moves a payload toward a mean of payloads inside the same box, so it stays inside."""
        return min(self.reject_above, self.clip_at)

    @property
    def shapes_whole(self) -> bool:
        """True if `shape` reads a payload as one vector (a clip): it is then decoded whole (4 B/parameter);
        the plain sum reads it a chunk at a time (sync/decoded.py)."""
        return math.isfinite(self.clip_at) or self.window is not None

    def screen(self, delta: Tensor | Decoded) -> str | None:
        """'norm_bound' if a coordinate of the decoded payload is above the bound; None if it passes."""
        if math.isfinite(self.reject_above) and Decoded.of(delta).peak() > self.reject_above:
            return "norm_bound"
        return None

    def shape(self, delta: Decoded | Tensor) -> Decoded | Tensor:
        """The payload as merged: `delta` itself, or a new tensor (a clip); never modifies it."""
        if math.isfinite(self.clip_at):
            return Decoded.of(delta).whole().clamp(-self.clip_at, self.clip_at)
        if self.window is not None:
            whole = Decoded.of(delta).whole()
            shaped = self.window.shape(whole)
            return delta if shaped is whole else shaped
        return delta

    def observe(self, delta: Decoded | Tensor) -> None:
        """Called under the replica's lock after `delta` was merged."""
        if self.window is not None:
            self.window.observe(Decoded.of(delta).whole())

    @property
    def sender_limit(self) -> float:
        """The largest |coordinate| an honest sender gives its payload before compression (inf: no bound): every
        peer's `screen` then passes the decoded payload, and under coord_clip it is what every peer would clip to
        anyway. train/outer.py `outer_update(limit=)` applies it."""
        return min(self.reject_above, self.clip_at) * SENDER_MARGIN
