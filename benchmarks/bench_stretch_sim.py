"""Issue 12's capped-uplink case in the simulator, with and without stretched phases.

One peer's uplink is capped (per-peer bandwidth: a MemoryNetwork subclass here; SimConfig has one bandwidth for
all), the others are fast. Each peer's exchange answers `backlog()` with the ground truth (own seq minus the
max over the other live peers of their replica's entry for it: the rule SwarmExchange applies to the vectors
gossip last saw). The swarm subclass gives a stretched phase its simulated time (PhaseStretched -> the phase's
end moves H steps later) and charges the token budget for it.

    .venv/bin/python benchmarks/bench_stretch_sim.py --max-stretch 1   # off
    .venv/bin/python benchmarks/bench_stretch_sim.py --max-stretch 4   # on
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from p2p_diloco.config import SimConfig, preset
from p2p_diloco.sim.memory import MemoryExchange, MemoryNetwork
from p2p_diloco.sim.swarm import AsyncSwarm, TokenBudget
from p2p_diloco.train.data.corpus import load_corpus
from p2p_diloco.train.loop import PhaseStretched, RoundDone, Schedule, rounds


class CappedNetwork(MemoryNetwork):
    rates: dict[str, float] = {}

    def send(self, src, dst, data):
        saved = self.bytes_per_s
        self.bytes_per_s = self.rates.get(src, saved)
        try:
            super().send(src, dst, data)
        finally:
            self.bytes_per_s = saved


class Budget(TokenBudget):
    def admit_stretch(self) -> bool:
        H = self.swarm.spec.inner.inner_steps
        if self.swarm.steps_started + H > self.swarm.sim.total_steps:
            return False
        self.swarm.steps_started += H
        return True


class StretchSwarm(AsyncSwarm):
    def __init__(self, spec, sim, corpus, *, max_stretch, capped_mbps):
        super().__init__(spec, sim, corpus)
        self.net.__class__ = CappedNetwork
        self.max_stretch, self.capped_mbps = max_stretch, capped_mbps
        self.published_at: dict[tuple[str, int], float] = {}
        self.stretches: dict[int, list[int]] = {}

    def _add_peer(self, speed, state=None):
        peer = super()._add_peer(speed, state)
        peer.exchange = MemoryExchange(self.net, peer.learner.peer_id, self._view,
                                       backlog=lambda p=peer: self._backlog(p))
        peer.ticks = rounds(peer.learner, peer.exchange, Schedule(max_stretch=self.max_stretch), Budget(self))
        if peer.index == 0:
            CappedNetwork.rates = {peer.learner.peer_id: self.capped_mbps * 1e6 / 8}
        return peer

    def _backlog(self, peer) -> int:
        me = peer.learner.peer_id
        held = [p.learner.replica.version_vector.get(me) for p in self._alive() if p is not peer]
        return max(0, peer.learner.last_seq - max(held)) if held else 0

    def _advance(self, peer):
        due = min(peer.phase.target_steps, int((self.queue.now - peer.phase_started) / peer.step_s + 1e-9))
        while peer.phase.steps_done < due:
            next(peer.ticks)

    def _end_phase(self, peer, incarnation):
        if not peer.alive or incarnation != peer.incarnation:
            return
        while True:
            tick = next(peer.ticks)
            if isinstance(tick, PhaseStretched):
                end = peer.phase_started + peer.phase.target_steps * peer.step_s
                self.queue.push(end, self._end_phase, peer, incarnation)
                return
            if isinstance(tick, RoundDone):
                break
        update, result = tick.update, tick.result
        self.stretches.setdefault(peer.index, []).append(tick.stretch)
        peer.taus.append(update.header.tau)
        peer.compute_s += result.steps * peer.step_s
        self.steps_published += result.steps
        peer.store.add(update)
        peer.held_since[(update.sender, update.seq)] = self.queue.now
        self.published_at[(update.sender, update.seq)] = self.queue.now
        self._start_phase(peer)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-stretch", type=int, default=4)
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=1600)
    ap.add_argument("--step-s", type=float, default=0.05)
    ap.add_argument("--capped-mbps", type=float, default=20.0)
    ap.add_argument("--mbps", type=float, default=1000.0)
    ap.add_argument("--H", type=int, default=5)
    ap.add_argument("--preset", default="test")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = preset(args.preset)
    spec = dataclasses.replace(base, inner=dataclasses.replace(base.inner, inner_steps=args.H),
                               outer=dataclasses.replace(base.outer, codec="fp32"))
    sim = SimConfig(peers=args.peers, total_steps=args.steps, step_time_s=args.step_s, bandwidth_mbps=args.mbps,
                    latency_s=0.02, anti_entropy_s=2.0, eval_batches=4)
    corpus = load_corpus(spec.data, block_size=spec.model.block_size)
    swarm = StretchSwarm(spec, sim, corpus, max_stretch=args.max_stretch, capped_mbps=args.capped_mbps)
    t0 = time.time()
    # a probe in the middle of the run: what the others hold of the capped peer's updates
    probes = []

    def probe():
        capped = swarm.peers[0]
        me = capped.learner.peer_id
        held = [p.learner.replica.version_vector.get(me) for p in swarm.peers[1:]]
        probes.append((round(swarm.queue.now, 1), capped.learner.last_seq, held))
        if any(p.busy for p in swarm.peers):
            swarm.queue.push(swarm.queue.now + 5.0, probe)

    swarm.queue.push(5.0, probe)
    result = swarm.run()
    capped = swarm.peers[0]
    me = capped.learner.peer_id
    delays = [p.held_since[key] - at for key, at in swarm.published_at.items() if key[0] == me
              for p in swarm.peers[1:] if key in p.held_since]
    others_delay = [p.held_since[key] - at for key, at in swarm.published_at.items() if key[0] != me
                    for p in swarm.peers if p.learner.peer_id != key[0] and key in p.held_since]
    out = {
        "max_stretch": args.max_stretch, "peers": args.peers, "H": args.H, "step_s": args.step_s,
        "update_MB": capped.learner.numel * 4 / 1e6, "capped_mbps": args.capped_mbps,
        "eval_loss": result.eval_loss, "sim_time_s": round(result.sim_time_s, 1),
        "divergence": result.divergence,
        "capped_updates": capped.learner.last_seq, "capped_steps": capped.learner.step,
        "capped_stretches": {k: swarm.stretches.get(0, []).count(k) for k in sorted(set(swarm.stretches.get(0, [])))},
        "others_stretched": sum(s > 1 for i, ss in swarm.stretches.items() if i for s in ss),
        "capped_delivery_s_mean": round(statistics.mean(delays), 2) if delays else None,
        "capped_delivery_s_max": round(max(delays), 2) if delays else None,
        "others_delivery_s_mean": round(statistics.mean(others_delay), 3) if others_delay else None,
        "utilization": [round(p.utilization, 3) for p in result.peers],
        "probes_(t,capped_seq,held_by_others)": probes[:: max(1, len(probes) // 6)],
        "wall_s": round(time.time() - t0, 1),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
