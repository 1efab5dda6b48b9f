"""Which phases start on the whole last round: a diagnostic of the grace window (2026-11-28), kept with its log.

    python benchmarks/results/async_candidates/parity/grace/phase_bases.py MODE TIMING_SEED [START_SPREAD_S]

MODE: graceG (the grace window, G a share of a phase) or fixedW (every unit waits W seconds after each phase, as
parity/iid_fixed_wait.py). In the environment, FIRST_ONLY=1: the window only after the first round; V1=1: the
window's first version (units with no update yet never awaited). IID streams, the noise scenario. Prints the final
loss, how many phase bases hold the whole last round, and for the first 40 phase starts (our count, the others'
counts in its base).
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import torch

    torch.set_num_threads(1)
    from async_timing import METHODS, NOISE, spec_for
    from iid_fixed_wait import fixed_wait

    from p2p_diloco.config import SimConfig
    from p2p_diloco.sim import swarm
    from p2p_diloco.sim.runner import simulate
    from p2p_diloco.train import grace, loop

    mode, seed = sys.argv[1], int(sys.argv[2])
    rows = []
    begin_phase = swarm.Learner.begin_phase

    def begin(self):
        phase = begin_phase(self)
        vv = phase.version_vector
        rows.append((vv.get(self.peer_id), sorted(vv[s] for s in vv if s != self.peer_id)))
        return phase

    swarm.Learner.begin_phase = begin
    awaited = grace.awaited
    if os.environ.get("FIRST_ONLY"):
        loop.awaited = lambda vv, me, live=0: awaited(vv, me, live) if vv.get(me) == 1 else []
    if os.environ.get("V1"):  # the first version: units with no update yet are never awaited
        loop.awaited = lambda vv, me, live=0: awaited(vv, me, 0)
    window = 0.0
    if mode.startswith("fixed"):
        fixed_wait(float(mode[5:]))
    else:
        window = float(mode[5:])
    over = {**NOISE, "iid": True, **({"start_spread_s": float(sys.argv[3])} if len(sys.argv) > 3 else {})}
    sim = SimConfig(peers=4, total_steps=2000, method="async", timing_seed=seed, grace=window, **over)
    result = simulate(spec_for(METHODS["async-new"]), sim)
    complete = sum(1 for mine, others in rows if len(others) == 3 and all(o >= mine for o in others))
    flags = " ".join(f"{k}=1" for k in ("V1", "FIRST_ONLY") if os.environ.get(k))
    spread = f"start spread {over['start_spread_s']} s"
    print(flags, mode, f"seed {seed}", spread, f"loss {result.eval_loss:.4f}", f"phases {len(rows)}",
          f"bases with the whole last round {complete}",
          f"utilization {[round(p.utilization, 2) for p in result.peers]}", flush=True)
    print(rows[:40])


if __name__ == "__main__":
    main()
