"""Work under a banned crowd, in the in-process swarm: wall time, anti-entropy ticks and intake counts of a run
with K identities whose updates are banned, against the same run with sign-flippers (never banned by a check
of the update alone); `--profile` prints the top of a cProfile of the banned run; `--micro` times one banned
sender's update through `Intake.receive` with and without the header check.

    python benchmarks/bench_banned_crowd.py --crowd 9 --steps-per-peer 40 [--old-intake] [--old-sim]

`scale`/`sign_flip`: a crowd re-signing honest peer 0's updates (sim/crowd.py `CrowdSwarm`). `train_scale`: 9
hostile peers that train and publish x5 (banned by the norm bound at their first update), against
`train_flip` (sign-flippers, never banned). `--max-ticks` anti-entropy ticks end a run that is never quiet;
`--old-intake` verifies a banned sender's updates in full (as before the header check); `--old-sim` puts back
sim/swarm.py's anti-entropy as it was, pulling from banned donors too (`AsyncSwarm.skip_banned_donors`).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import faulthandler
import io
import logging
import pstats
import time

import torch

from p2p_diloco.config import SimConfig, preset
from p2p_diloco.sim.adversary import Adversary, HostileSwarm, Hostility
from p2p_diloco.sim.crowd import CrowdAttack, CrowdSwarm
from p2p_diloco.sim.swarm import AsyncSwarm
from p2p_diloco.sync import intake as intake_module
from p2p_diloco.train.data.corpus import load_corpus


def build(mode: str, factor: float, args: argparse.Namespace) -> HostileSwarm:
    """`scale`/`sign_flip`: a crowd of identities re-signing peer 0's updates (they train nothing);
    `train_scale`/`train_flip`: `crowd` hostile peers that train and publish their update tampered."""
    base = preset(args.preset)
    inner = dataclasses.replace(base.inner, inner_steps=args.inner_steps, decay_steps=args.steps_per_peer)
    spec = dataclasses.replace(base, inner=inner)
    corpus = load_corpus(spec.data)
    if mode.startswith("train_"):
        peers = args.peers + args.crowd
        total = peers * args.steps_per_peer
        sim = SimConfig(peers=peers, total_steps=total, eval_batches=4, eval_every_s=float(total), iid=False)
        hostility = Hostility.SCALE if mode == "train_scale" else Hostility.SIGN_FLIP
        return HostileSwarm(spec, sim, corpus, [Adversary(i, hostility, factor=factor)
                                                for i in range(args.peers, peers)])
    total = args.peers * args.steps_per_peer
    sim = SimConfig(peers=args.peers, total_steps=total, eval_batches=4, eval_every_s=float(total),
                    iid=False)  # a shard per unit, as measured in BENCHMARKS.md
    return CrowdSwarm(spec, sim, corpus, CrowdAttack(args.crowd, mode, factor))


def micro(n: int = 50) -> dict:
    """Microseconds per banned sender's update in `Intake.receive`: from its header, and verified in full."""
    spec = preset("test")
    from p2p_diloco.sync.intake import Intake
    from p2p_diloco.sync.replica import Replica
    from p2p_diloco.train.models.build import build_model, flat_params
    from p2p_diloco.wire.codecs import get_codec
    from p2p_diloco.wire.envelope import encode_update, make_update
    from p2p_diloco.wire.identity import Identity

    numel = flat_params(build_model(spec.model, spec.seed)).numel()
    codec, who = get_codec(spec.outer.codec, spec.outer.codec_block), Identity.generate()
    data = [encode_update(make_update(run_id=spec.run_id, spec_hash=spec.spec_hash(), seq=seq, tau=0, samples=8,
                                      weight=0.5, codec=codec.name, numel=numel, identity=who,
                                      payload=codec.compress(torch.randn(numel)))) for seq in range(1, n + 1)]
    out: dict = {"numel": numel, "envelope_bytes": len(data[0])}
    for name, header_check in (("header_check_us", True), ("full_verify_us", False)):
        replica = Replica.from_spec(spec, torch.zeros(numel), codec=codec)
        intake = Intake(spec, numel, replica)
        replica.ban(who.peer_id, "bench")
        saved = intake_module.claimed_sender
        if not header_check:
            intake_module.claimed_sender = lambda data, run_id, spec_hash: None
        t0 = time.perf_counter()
        assert all(intake.receive(d)[0] == "rejected_banned" for d in data)
        out[name] = round((time.perf_counter() - t0) / n * 1e6, 1)
        intake_module.claimed_sender = saved
    return out


def run(mode: str, factor: float, args: argparse.Namespace, profile: bool) -> dict:
    swarm = build(mode, factor, args)
    ticks = [0]
    tick = swarm._anti_entropy

    def counted() -> None:
        ticks[0] += 1
        if ticks[0] > args.max_ticks:
            raise RuntimeError(f"anti-entropy still running after {args.max_ticks} ticks: never quiet")
        tick()

    swarm._anti_entropy = counted  # type: ignore[method-assign]
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    try:
        result = swarm.run()
    except RuntimeError as e:
        return {"mode": mode, "wall_s": round(time.perf_counter() - t0, 1), "error": str(e)}
    finally:
        if prof is not None:
            prof.disable()
    wall_s = time.perf_counter() - t0
    counts: dict[str, int] = {}
    for peer in swarm.peers[:args.peers]:
        for k, v in peer.intake.counts.items():
            counts[k] = counts.get(k, 0) + v
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(args.top)
        print(out.getvalue())
    summary = swarm.honest_summary(result)
    return {"mode": mode, "factor": factor, "wall_s": round(wall_s, 1), "eval_loss": round(summary["eval_loss"], 4),
            "divergence": summary["divergence"], "anti_entropy_ticks": ticks[0],
            "intake_counts": dict(sorted(counts.items()))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="test")
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--crowd", type=int, default=9)
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--steps-per-peer", type=int, default=60)
    ap.add_argument("--modes", default="train_scale,train_flip", help="scale, sign_flip, train_scale, train_flip")
    ap.add_argument("--profile", action="store_true", help="cProfile the scale run")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--max-ticks", type=int, default=2000, help="anti-entropy ticks before calling it a stall")
    ap.add_argument("--old-sim", action="store_true", help="anti-entropy as it was: pulls from banned donors too")
    ap.add_argument("--micro", action="store_true", help="only time one banned update through the intake")
    ap.add_argument("--old-intake", action="store_true",
                    help="the intake before the header check: a banned sender's update verified in full")
    ap.add_argument("--dump-every-s", type=float, default=0.0, help="print every thread's stack this often")
    args = ap.parse_args()
    if args.micro:
        print(micro(), flush=True)
        return 0
    if args.old_intake:
        intake_module.claimed_sender = lambda data, run_id, spec_hash: None
    if args.old_sim:
        AsyncSwarm.skip_banned_donors = False
    if args.dump_every_s:
        faulthandler.dump_traceback_later(args.dump_every_s, repeat=True)
    torch.set_num_threads(1)
    logging.getLogger("p2p_diloco").setLevel(logging.ERROR)
    for mode in args.modes.split(","):
        factor = 5.0 if mode.endswith("scale") else 1.0
        print(run(mode, factor, args, args.profile and mode.endswith("scale")), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
