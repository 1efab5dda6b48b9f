"""What the scale simulator tracks per unit and per update, and the face the swarm shows its strategies.

`FullDissemination`, `TreeAggregation` (scale_gossip.py) and `Uplinks` (scale_links.py) are strategies of the
swarm (`DecoupledSwarm`, scale_units.py) and call back into it; `SwarmHost` names what they use, so that they
depend on this module and not on the swarm's.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from p2p_diloco.sim.events import EventQueue
    from p2p_diloco.sim.scale_config import ScaleConfig

UP, REPAIR, RESTART = "up", "repair", "restart"
AUDIT_MAX_MERGES = 4_000_000
"""Runs expected to merge at most this many (unit, update) pairs keep a per-unit set to audit double merges."""


class Update:
    """One published outer update, as the simulator tracks it (no payload)."""

    __slots__ = ("sender", "seq", "published_at", "holders", "pending", "inflight", "stranded", "epoch")

    def __init__(self, sender: int, seq: int, published_at: float) -> None:
        self.sender, self.seq, self.published_at = sender, seq, published_at
        self.holders: list[int] | None = None  # full dissemination: units holding it (until all live do)
        self.pending: dict[int, int] = {}  # unit -> pulls of it in flight to that unit
        self.inflight = 0  # transfers and scheduled repairs of it; 0 ends a wave of the epidemic
        self.stranded = False  # no live holder: waits for one to restart
        self.epoch: int | None = None  # tree aggregation: the epoch whose sum carried it


class Unit:
    """A learner unit: its phase, its failure state, its replica's version vector and its byte counters."""

    __slots__ = ("index", "speed", "work_s", "state", "life", "seq", "vv", "total", "buffered", "n_buffered",
                 "base_total", "seg_start", "seg_work", "down_since", "down_until", "up_since", "live_pos",
                 "sent_payload", "sent_meta", "recv_payload", "recv_meta", "audit")

    def __init__(self, index: int, n: int, speed: float, work_s: float) -> None:
        self.index, self.speed, self.work_s = index, speed, work_s
        self.state, self.life, self.seq = UP, 0, 0
        self.vv = [0] * n
        self.total = 0  # sum(vv): updates merged
        self.buffered: dict[int, set[int]] = {}
        self.n_buffered = 0
        self.base_total = 0  # total at the start of the current phase
        self.seg_start, self.seg_work = 0.0, work_s  # current stretch of the phase: start time, work left
        self.down_since = self.down_until = self.up_since = 0.0
        self.live_pos = index
        self.sent_payload = self.sent_meta = self.recv_payload = self.recv_meta = 0
        self.audit: set[tuple[int, int]] | None = None


class Links(Protocol):
    """The swarm's uplinks (`Uplinks`, scale_links.py) as the dissemination strategies use them."""

    bytes_per_s: float

    def send(self, src: Unit, dst: Unit, payload: int, meta: int, ready_at: float, fn: Callable[..., Any],
             *args: Any) -> None: ...


class SwarmHost(Protocol):
    """The swarm as its dissemination and uplink strategies see it."""

    cfg: ScaleConfig
    n: int
    queue: EventQueue
    rng: random.Random
    units: list[Unit]
    live: list[Unit]
    log: list[list[Update]]
    stats: dict[str, int]
    stopped: bool

    @property
    def links(self) -> Links: ...

    def at(self, when: float, fn: Callable[..., Any], *args: Any) -> None: ...

    @staticmethod
    def has(u: Unit, sender: int, seq: int) -> bool: ...

    def deliver(self, u: Unit, sender: int, seq: int, at: float) -> bool: ...

    def count(self, src: Unit, dst: Unit, payload: int, meta: int) -> None: ...

    def vector_bytes(self) -> int: ...

    def pick_live(self, k: int, exclude: tuple[int, ...]) -> list[Unit]: ...

    def receive_many(self, u: Unit, items: list[Update]) -> None: ...

    def start_anti_entropy(self, u: Unit) -> None: ...
