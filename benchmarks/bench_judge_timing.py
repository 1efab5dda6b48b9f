"""Which sponsors' work does a proposal point along: the round before it, or its own? (the sponsors' judge, timing)

A sponsor judged a proposal by its cosine with the sum of the sponsors' latest updates (sync/sponsorship.py
`_worths`) as soon as it merged it; now at the end of its own phase, by the larger of that and the cosine with its
pseudo-gradient of the phase. This measures what those references are, on the in-process swarm (the real
learner, judge and merge): 3 sponsors and an honest volunteer joining halfway, every unit on the whole training
split, `test`, H=20, no crowd. For each of the volunteer's updates it records

    judged        the cosine the sponsors' judge read (sponsor 0)
    previous      the cosine of its pseudo-gradient with each sponsor's last pseudo-gradient published before it
    concurrent    ... with each sponsor's first one published after it (the round it was trained beside)
    dL            its own loss change at its base on the held-out set, L(base) - L(phi), against the sponsors'
                  concurrent updates' (is the work useful at all?)

and, for scale, the cosine of each sponsor's consecutive pseudo-gradients and of two sponsors' in one round.

    python benchmarks/bench_judge_timing.py --seeds 0,1,2 --out benchmarks/results/crowd/judge-timing.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
from pathlib import Path

import torch

from p2p_diloco.config import DefenceConfig, SimConfig, preset
from p2p_diloco.sim.crowd import CrowdAttack, CrowdSwarm
from p2p_diloco.sync.sponsorship import Sponsorship
from p2p_diloco.train import learner as learner_module
from p2p_diloco.train.data.corpus import evaluate, load_corpus
from p2p_diloco.train.models.build import build_model, load_flat_params


def _judged(sponsorship, sample, direction) -> float:  # type: ignore[no-untyped-def]
    """The cosine a sponsor's judge reads: the larger of the proposal's with the sponsors' latest updates and with
    its own phase's work, or, once it knows theta's recent moves, its new part's with its own phase's new work."""
    from p2p_diloco.sync.echoes import without
    from p2p_diloco.sync.worth import along, cosine

    if isinstance(direction, torch.Tensor):  # the code before sync/worth.py
        direction = along(direction)
    fresh = getattr(sponsorship, "_fresh", [])
    if fresh:
        new = without(sample.clone(), fresh)
        return cosine(new, float(new.norm()), direction)
    latest = along(torch.stack(list(sponsorship._latest.values())).sum(0))
    return max(cosine(sample, float(sample.norm()), latest), cosine(sample, float(sample.norm()), direction))


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def run(seed: int, steps_per_peer: int = 200, honest: int = 3) -> dict:
    base = preset("test")
    inner = dataclasses.replace(base.inner, inner_steps=20, decay_steps=steps_per_peer)
    spec = dataclasses.replace(base, seed=seed, inner=inner, defence=DefenceConfig())
    total = (honest + 1) * steps_per_peer
    sim = SimConfig(peers=honest, total_steps=total, eval_batches=16, eval_every_s=float(total),
                    join=(f"{steps_per_peer / 2:g}",), sponsors=honest, iid=True)
    swarm = CrowdSwarm(spec, sim, load_corpus(spec.data), CrowdAttack(0, "copy", 1.0, "proven", 0))
    phases: list[tuple[str, int, float, torch.Tensor]] = []  # (peer, seq, dL at its base, pseudo-gradient), in order
    judged: dict[tuple[str, str, int], float] = {}  # (sponsor, author, seq) -> the judge's cosine
    finish, judge = learner_module.Learner.finish_phase, Sponsorship._judge

    def finish_phase(self, phase, result, view):  # type: ignore[no-untyped-def]
        start, phi = phase.base.clone(), phase.base.clone()
        for s, param in self.unit.each_param(self.model):
            phi[s] = param.detach().reshape(-1)
        model = build_model(self.spec.model, self.spec.seed)
        load_flat_params(model, start)
        before = evaluate(model, swarm.eval_set)
        load_flat_params(model, phi)
        phases.append((self.peer_id, self.last_seq + 1, before - evaluate(model, swarm.eval_set), start - phi))
        return finish(self, phase, result, view)

    def judge_(self, author, seq, sample, unit, step, factor, date, direction=None, *args):  # type: ignore[no-untyped-def]
        if self.self_id in self._latest:  # the cosine the judge reads (sync/sponsorship.py `_worths`)
            judged[(self.self_id, author, seq)] = _judged(self, sample, direction)
        return judge(self, author, seq, sample, unit, step, factor, date, direction, *args)  # (also on older code)

    learner_module.Learner.finish_phase, Sponsorship._judge = finish_phase, judge_
    try:
        swarm.run()
    finally:
        learner_module.Learner.finish_phase, Sponsorship._judge = finish, judge
    sponsors = [p.learner.peer_id for p in swarm.peers[:honest]]
    volunteer = swarm.peers[honest].learner.peer_id
    rows = []
    for k, (peer, seq, dl, delta) in enumerate(phases):
        if peer != volunteer:
            continue
        before = {p: d for p, _, _, d in phases[:k] if p in sponsors}  # each sponsor's last before it
        after: dict[str, tuple[float, torch.Tensor]] = {}
        for p, _, dl2, d in phases[k + 1:]:
            if p in sponsors and p not in after:
                after[p] = (dl2, d)
        rows.append({"seq": seq, "judged": judged.get((sponsors[0], volunteer, seq)),
                     "previous": statistics.median(_cos(delta, d) for d in before.values()),
                     "concurrent": statistics.median(_cos(delta, d) for _, d in after.values()) if after else None,
                     "dL": dl, "dL_sponsors": statistics.median(x for x, _ in after.values()) if after else None})
    own = {p: [d for q, _, _, d in phases if q == p] for p in sponsors}
    consecutive = [_cos(a, b) for ds in own.values() for a, b in zip(ds[3:], ds[4:])]  # past the first rounds
    same_round = [_cos(own[sponsors[0]][i], own[p][i]) for p in sponsors[1:] for i in range(3, len(own[p]))
                  if i < len(own[sponsors[0]])]
    by_seq = swarm.relayed_by_seq(volunteer)  # the share each sponsor relayed as a member's, by seq
    member_from = [min((seq for seq, shares in sorted(by_seq.items()) if len(shares) > i and shares[i] > 0),
                       default=None) for i in range(honest)]
    return {"seed": seed, "volunteer": rows, "member_from": member_from,
            "sponsor_consecutive_median": statistics.median(consecutive),
            "sponsors_same_round_median": statistics.median(same_round)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", default="benchmarks/results/crowd/judge-timing.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("p2p_diloco").setLevel(logging.ERROR)
    results = []
    for seed in (int(s) for s in args.seeds.split(",")):
        result = run(seed)
        results.append(result)
        print(f"seed {seed}: sponsors' consecutive pseudo-gradients {result['sponsor_consecutive_median']:+.2f}, "
              f"two sponsors' in one round {result['sponsors_same_round_median']:+.2f}; the volunteer relayed as a "
              f"member's from its update {result['member_from']} (per sponsor)")
        for r in result["volunteer"][:4]:
            fmt = lambda x: "-" if x is None else f"{x:+.3f}"  # noqa: E731
            print(f"  volunteer update {r['seq']}: judged {fmt(r['judged'])}  previous round {fmt(r['previous'])}  "
                  f"concurrent round {fmt(r['concurrent'])}  dL {fmt(r['dL'])} (sponsors' {fmt(r['dL_sponsors'])})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
