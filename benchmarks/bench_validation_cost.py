"""What judging costs a sponsor (issue 25: "validation costs at most 5% of a unit's compute at H=50 for N = 4, 16
and 64"), against the compute of one round of the same model on this machine.

In a run with founders (sync/sponsorship.py) only the sponsors judge, once per update they merge: take the
proposal's step at the 4,096 sampled coordinates, compare it with this round's window and the sponsors' work
(dot products on those samples), and, if it is relayed, add it into one parameter-sized float32 buffer (one pass
over the payload, the axpy a merge at weight would have done; non-sponsors skip even that: a proposal merges at
0). No forward pass. Per round a sponsor sees every other unit's update once: N - 1 of them, S - 1 of them
sponsors'. Timed here: all of that for one round, every proposal useful (each one relayed: the worst case), plus
`relay(theta, current)` at the end (which removes theta's last 2 moves from what it relays); against H = 50 inner
steps of one unit (`inner_step`, the spec's batch). A sponsor judges a phase's proposals when the phase ends
(`Sponsorship.judge`, inside `relay`), on its compute thread, where before it judged each as it merged, on the
network's side: the second number in each cell is that part, which the sponsor's round now waits for.

    python benchmarks/bench_validation_cost.py --presets test,tiny,small --peers 4,16,64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from p2p_diloco.config import preset
from p2p_diloco.sync.decoded import Decoded
from p2p_diloco.sync.sponsorship import Sponsorship
from p2p_diloco.sync.standing import Standing
from p2p_diloco.train.data.corpus import ShardSampler, load_corpus
from p2p_diloco.train.inner import inner_step, make_inner_optimizer
from p2p_diloco.train.models.build import build_model, flat_params

SPONSORS = 3
H = 50


def round_compute_s(spec, steps: int) -> tuple[float, int]:  # noqa: ANN001
    model = build_model(spec.model, spec.seed)
    corpus = load_corpus(spec.data)
    sampler = ShardSampler(corpus.train, shard=0, num_shards=1, block_size=spec.model.block_size,
                           batch_size=spec.data.batch_size, seed=0)
    optimizer = make_inner_optimizer(model, spec.inner)
    inner_step(model, optimizer, *sampler.batch(0), 0, spec.inner)  # warm-up
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        inner_step(model, optimizer, *sampler.batch(i + 1), i + 1, spec.inner)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * H, flat_params(model).numel()


def judging_round_s(numel: int, peers: int, repeats: int) -> tuple[float, float]:
    """One round at sponsor "s0": the other sponsors' updates and N - S proposals, then relay() (with theta: the
    removal of its last moves from what it relays, sync/sponsorship.py `_fresh`); (all of it, relay() alone)."""
    g = torch.Generator().manual_seed(0)
    direction = torch.randn(numel, generator=g)
    # Distinct (none is a near copy), and the proposals' new parts under the echo test's bar (ECHO_OF) with the
    # sponsors': at 1:1 their cosine is 0.5, every proposal an echo worth nothing, and nothing to relay or time.
    steps = [direction + (1.0 if i < SPONSORS else 1.5) * torch.randn(numel, generator=g) for i in range(peers)]
    standing = Standing(probation=1.0, min_agreement=-1.0, max_norm_ratio=0.0, self_id="s0",
                        sponsors=tuple(f"s{i}" for i in range(SPONSORS)))
    sponsorship: Sponsorship = standing.sponsorship
    theta = torch.zeros(numel)  # moved each round, so the relay's removal of the last moves has two to remove
    times, at_end = [], []
    for r in range(repeats + 1):
        at = sponsorship.sample_at(numel)  # this round's coordinates and the next's (sync/judged_at.py)
        sponsorship.merged("s0", r + 1, steps[0][at] * 1e-3, steps[0], 1e-3, at)  # its own, untimed
        relayed = sum(sponsorship.relayed.values())
        move = torch.randn(numel, generator=g)  # theta's move this round: not what the proposals' new work is along
        t0 = time.perf_counter()
        for i in range(1, peers):
            author = f"s{i}" if i < SPONSORS else f"v{i}"
            step = steps[i]
            sample = Decoded.of(step).take(at) * 1e-3  # what Standing.sponsored_merge takes
            sponsorship.merged(author, r + 1, sample, step, 1e-3, at)
        theta.sub_(move, alpha=1e-3)
        t1 = time.perf_counter()
        sponsorship.relay(theta, current=steps[0])  # its pseudo-gradient of the phase: what it judges them by too
        if r:  # the first round fills the records
            times.append(time.perf_counter() - t0)
            at_end.append(time.perf_counter() - t1)
            judged = [sponsorship.judged[(f"v{i}", r + 1)][0] for i in range(SPONSORS, peers)]
            assert sum(sponsorship.relayed.values()) > relayed and all(v > 0 for v in judged), \
                "the proposals were not relayed: the timing would miss their pass over the payload"
    return statistics.median(times), statistics.median(at_end)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="test,tiny,small")
    ap.add_argument("--peers", default="4,16,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--step-samples", type=int, default=5)
    args = ap.parse_args()
    peers = [int(n) for n in args.peers.split(",")]
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch threads {torch.get_num_threads()}, "
          f"{SPONSORS} sponsors, H={H}")
    print("| preset | parameters | one round (H=50) | " + " | ".join(f"judging, N={n}" for n in peers) + " |")
    print("|---|---:|---:|" + "---:|" * len(peers))
    for name in args.presets.split(","):
        spec = preset(name)
        round_s, numel = round_compute_s(spec, args.step_samples)
        cells = []
        for n in peers:
            judge_s, end_s = judging_round_s(numel, n, args.repeats)
            cells.append(f"{judge_s * 1e3:.1f} ms ({judge_s / round_s:.2%}); at the end {end_s / round_s:.2%}")
        print(f"| {name} | {numel / 1e6:.2f}M | {round_s:.2f} s | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
