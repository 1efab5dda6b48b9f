"""What a peer process tells people and its JSON log, event by event: start, state sync, each round of the
loop (as its `Hooks`: evaluate, print and log, announce, checkpoint) and the final report.

The lines' format and the JSON log live in peer/output.py; this module decides when they are written and
what goes in them.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Sequence

import torch

from p2p_diloco.config import RunSpec
from p2p_diloco.net.discovery.status import number
from p2p_diloco.peer.announce import Record
from p2p_diloco.peer.isolation import IsolationDetector, Verdict
from p2p_diloco.peer.network import PeerNetwork
from p2p_diloco.peer.output import JsonLog, fmt_bytes, round_line, save_state
from p2p_diloco.peer.resume import PeerCheckpoints
from p2p_diloco.peer.sinks import Sink
from p2p_diloco.peer.startup import NodeUp
from p2p_diloco.train.learner import Learner
from p2p_diloco.train.loop import Hooks, RoundDone

logger = logging.getLogger(__name__)

EvalSet = list[tuple[torch.Tensor, torch.Tensor]]
"""The held-out batches every evaluation reads."""


def print_line(line: str) -> None:
    try:
        print(line, flush=True)
    except BrokenPipeError:  # e.g. `p2p-diloco join | head`: keep training, stop printing
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the rest of the process)


class PeerReport(Hooks):
    """The real peer's side of the round loop (train/loop.py), and its other reports.

    Keeps what the reports need across rounds: the round reached, the latest eval loss, the last round's
    record (`last`), and the compute time since training began (utilization)."""

    def __init__(self, spec: RunSpec, learner: Learner, network: PeerNetwork, *, eval_set: EvalSet, log: JsonLog,
                 out: Callable[[str], None], checkpoints: PeerCheckpoints | None, sinks: Sequence[Sink] = ()) -> None:
        """`sinks`: the optional TensorBoard / wandb writers (peer/sinks.py)."""
        self.spec, self.learner, self.network = spec, learner, network
        self.eval_set, self.log, self.out, self.checkpoints = eval_set, log, out, checkpoints
        self.sinks = list(sinks)
        self.round = 0
        self.eval_loss: float | None = None
        self.last: Record = {}
        self.compute_s = 0.0
        self.t_start = time.monotonic()
        self.tokens_per_step = spec.data.batch_size * spec.model.block_size
        self.isolation: IsolationDetector | None = None  # built at the first round (peer/isolation.py)

    def start(self, up: NodeUp) -> None:
        node, how, why = up.node, up.how, up.reach_why
        for maddr in node.visible_maddrs():
            self.out(f"listening on {maddr}")
        self.out(f"reachability: {node.reachability}" + (f" ({why})" if why else "") + (
            "; others reach this peer through the bootstrap's relay" if node.reachability == "private" else ""))
        self.log.write("reach", peer_id=node.peer_id, reach=node.reachability, why=why)
        verb = "published (first peer of the run)" if how == "published" else "matches the swarm's"
        spec, learner = self.spec, self.learner
        self.out(f"run '{spec.run_id}' spec {spec.spec_hash()[:12]} {verb}; "
                 f"{learner.numel:,} parameters, H={spec.inner.inner_steps}, codec={spec.outer.codec}, "
                 f"device={learner.device}")

    def sync(self, synced: Record | None) -> None:
        if synced is None:
            self.out("state sync: not needed (no live peer has merged updates yet); starting from the run's seed")
            return
        self.out(f"state sync: loaded replica with V total {synced['vv_total']} from donor {synced['donor']} "
                 f"({fmt_bytes(number(synced, 'bytes'))} in {synced['seconds']:.1f}s)")
        self.log.write("sync", **synced)

    # ---- the round loop's hooks ---------------------------------------------------------------------------

    def training_begins(self, at_round: int) -> None:
        """Rounds are counted from `at_round` (restored or adopted), utilization from now."""
        self.round, self.compute_s, self.t_start = at_round, 0.0, time.monotonic()

    def evaluate(self, at_round: int) -> float:
        self.eval_loss = self.learner.evaluate(self.eval_set)
        self.log.write("eval", round=at_round, eval_loss=self.eval_loss)
        return self.eval_loss

    def round_done(self, done: RoundDone) -> None:
        learner, network, update = self.learner, self.network, done.update
        self.round = done.round
        self.compute_s += done.result.compute_s
        counters = network.counters
        vv = learner.replica.version_vector
        utilization = self.compute_s / (time.monotonic() - self.t_start)
        self.last = {
            "round": done.round, "step": learner.step, "loss": done.result.mean_loss, "eval_loss": done.eval_loss,
            "peers": done.view.num_peers, "tau": update.header.tau, "weight": update.header.weight, "seq": update.seq,
            "stretch": done.stretch, "waited_s": done.waited_s,
            "vv_total": vv.total(), "bytes_sent": counters.get("bytes_sent", 0),
            "bytes_received": counters.get("bytes_received", 0), "merged": counters.get("merged", 0),
            "rejected": counters.get("rejected", 0), "samples_per_s": done.samples_per_s, "round_s": done.round_s,
            "utilization": utilization, "compute_s": self.compute_s, "tokens": learner.step * self.tokens_per_step}
        verdict = self._isolation(done.round, counters)
        self.last["alone"] = verdict.alone
        network.local = {"state": "training", "round": done.round, "step": learner.step,
                         "loss": done.result.mean_loss, "eval_loss": self.eval_loss,
                         "samples_per_s": done.samples_per_s, "tau": update.header.tau,
                         "utilization": round(utilization, 4), "last_update_at": time.time(),
                         **({"alone": verdict.status()} if verdict.alone else {})}
        network.request_announce()
        self.out(round_line(self.last))
        vv = learner.replica.version_vector  # per sender, while small: tests and plots follow who holds whom
        self.log.write("round", peer_id=learner.peer_id, **self.last, **({"vv": vv.to_dict()} if len(vv) <= 16 else {}))
        if verdict.event is not None:
            self.out(verdict.line())
            self.log.write("isolation", peer_id=learner.peer_id, round=done.round, **verdict.to_dict())
        for sink in self.sinks:
            sink.write(self.last)

    def _isolation(self, at_round: int, counters: dict[str, int]) -> Verdict:
        """Feed the isolation detector (peer/isolation.py) this round's view: the members' records, our vector,
        the counters and the refusals by reason (from our last announced record: replaced whole)."""
        network, replica = self.network, self.learner.replica
        if self.isolation is None:
            self.isolation = IsolationDetector(self.learner.peer_id)
        rejected = network.presence.last_record.get("rejected_by")
        rejected_by = rejected if isinstance(rejected, dict) else {}
        try:
            return self.isolation.observe(at_round, time.monotonic(), network.peers, replica.version_vector,
                                          counters, rejected_by, ignore=getattr(replica, "banned", ()))
        except Exception:  # a diagnosis must never stop training
            logger.exception("isolation check failed")
            return Verdict(False, None, 0, 0.0, 0)

    def checkpoint(self, at_round: int) -> None:
        if self.checkpoints is not None:  # the schedule asks only when there are checkpoints
            self.checkpoints.save(self.learner, round=at_round, why="periodic")

    def say(self, line: str) -> None:
        self.out(line)

    # ---- the end ------------------------------------------------------------------------------------------

    def final(self, at_round: int, out_dir: str) -> None:
        """The final eval, counters and state (written to `out_dir` if given)."""
        learner, counters = self.learner, self.network.counters
        sent = counters.get("bytes_sent", 0)
        eval_loss = learner.evaluate(self.eval_set)
        theta, vv = learner.theta_copy()  # after the eval, which may use the same buffer
        final = {"peer_id": learner.peer_id, "round": at_round, "step": learner.step,
                 "eval_loss": eval_loss, "vv_total": vv.total(), "vv_digest": vv.digest().hex()[:16],
                 "bytes_sent": sent, "bytes_received": counters.get("bytes_received", 0),
                 "merged": counters.get("merged", 0), "rejected": counters.get("rejected", 0),
                 "duplicates": counters.get("duplicate", 0), "seq": learner.last_seq,
                 "equivocations": learner.replica.stats.get("equivocation", 0),
                 "banned": sorted(learner.replica.banned),
                 "holes": vv.n_holes, "repairs": list(self.network.repairs),
                 "utilization": self.last.get("utilization", 0.0),  # while training (lingering is not idling)
                 # vetting's verdicts (sync/standing.py) by reason: an honest run has only "probation"
                 "vetting": {k: n for k, n in getattr(learner.replica.standing, "stats", {}).items() if n},
                 # in a run with sponsors (sync/sponsorship.py): at a sponsor, the updates' worth of each author's
                 # work it relayed; everywhere, what the sponsors judged each author's work worth
                 "relayed": dict(getattr(getattr(learner.replica.standing, "sponsorship", None), "relayed", {})),
                 "judged": dict(getattr(getattr(learner.replica.standing, "sponsorship", None), "earned", {})),
                 # a proposer's heralds sent to the sponsors, a sponsor's heard and refused (net/gossip/heralds.py)
                 "heralds": {k: counters.get(f"heralds_{k}", 0) for k in ("sent", "heard", "refused")},
                 # with --gossip.aggregate (net/gossip/tree.py): totals merged, fallbacks, audits, lies caught
                 "tree": {k: n for k, n in counters.items() if k.startswith(("tree_", "audit", "lies_", "evidence_"))
                          and n}}
        if out_dir:
            theta_path, vv_path = save_state(out_dir, theta, vv,
                                             {"peer_id": learner.peer_id, "spec_hash": self.spec.spec_hash(),
                                              "round": at_round, "step": learner.step,
                                              "reduced_weights": learner.replica.reduced_weights()})
            final.update(theta_path=str(theta_path), vv_path=str(vv_path))
            self.out(f"wrote {theta_path} and {vv_path}")
        self.out(f"final: rounds {at_round}  eval {eval_loss:.3f}  V {vv.total()}  "
                 f"sent {fmt_bytes(sent)}  merged {final['merged']}  rejected {final['rejected']}")
        self.log.write("final", **final)
