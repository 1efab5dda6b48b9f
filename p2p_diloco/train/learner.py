"""The learner unit: one replica, one local model, and the phases of the round loop
(ARCHITECTURE.md, "The round loop"; the loop itself is train/loop.py `rounds`).

    base, V_base <- snapshot(replica);  phi <- base
    H inner steps of AdamW on phi                      (compute; never waits on the network)
        between steps: if the replica merged remote updates, phi += theta - base; base <- theta
    delta <- base - phi; d <- Nesterov(delta); q <- compress(d + e)
    U <- sign(header{run, sender, seq, tau, samples, w, codec, digest}, q)
    merge(U) locally; publish(U)

The learner knows nothing about networks or clocks: the round loop (train/loop.py), paced by its caller (the
simulator's clock, or the peer's compute thread), decides when a phase begins and ends and where the update
goes. Remote updates reach the replica through the network's `Intake` (sync/intake.py) on another thread;
the replica's lock makes the merge and the snapshot atomic.

Devices: phi, its AdamW state and the batches live on `device` (a GPU if the peer has one); theta, the version
vector, the outer state and the codecs stay on the CPU in float32. That is the network-facing state: merged by
another thread, and bit-identical on every peer whatever device it trains on. Crossing points: `begin_phase` and
`_rebase` (CPU -> device) and `finish_phase` (device -> CPU).

Restart (train/state/manager.py): `state_dict` / `load_state_dict` carry everything a restarted unit needs (theta
and V, m and e, the inner AdamW state, the data position, its own last seq, the RNG); `persist_update`, if set,
makes each signed update durable before it is merged or published, and `adopt_own_updates` takes those back after a
restart. Sequence numbers come from `last_seq`, never from the replica alone: a restarted unit must not sign
different content under a seq it has used before (receivers would see equivocation).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from p2p_diloco.config import RunSpec
from p2p_diloco.sync.replica import Replica
from p2p_diloco.sync.robust import MergePolicy
from p2p_diloco.sync.types import MergeOutcome
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.train.data.corpus import Corpus, evaluate
from p2p_diloco.train.exchange import SwarmView
from p2p_diloco.train.fit import FitJudge, declared, proposal_position
from p2p_diloco.train.hardware.compute import Compute
from p2p_diloco.train.hardware.device import resolve_device
from p2p_diloco.train.hardware.unit import SoloUnit
from p2p_diloco.train.inner import InnerResult, inner_step, lr_at, make_inner_optimizer
from p2p_diloco.train.models.build import build_model, flat_params, load_flat_params
from p2p_diloco.train.outer import OuterState, outer_update, relay_payload, update_weight
from p2p_diloco.train.phase import Phase, make_sampler, swarm_rounds
from p2p_diloco.wire.codecs import get_codec
from p2p_diloco.wire.envelope import OuterUpdate, make_update
from p2p_diloco.wire.identity import Identity

logger = logging.getLogger(__name__)


class Learner:
    """One learner unit. Not thread-safe itself; only the replica is shared with the network thread."""

    def __init__(self, spec: RunSpec, identity: Identity, corpus: Corpus | Any, *, shard: int, num_shards: int,
                 replica_state: tuple[torch.Tensor, VersionVector] | None = None, device: str = "cpu",
                 compute: Compute | None = None, unit: SoloUnit | None = None, stream: str = "",
                 outer_state_dir: str = "", judge_seed: int | None = None, fit_share: float | None = None):
        self.spec = spec.validate()
        self.identity = identity
        self.peer_id = identity.peer_id
        self.device = resolve_device(device)
        torch.manual_seed(spec.seed)  # dropout and any other global-RNG use start from the run's seed
        self.model = build_model(spec.model, spec.seed)  # on the CPU: the same theta on every peer
        theta = flat_params(self.model)
        # The parameters stay float32 on the device (master weights); `compute` runs the forward and backward in
        # bf16/fp16 autocast where asked (train/hardware/compute.py).
        self.unit = unit or SoloUnit()  # a torchrun unit of several processes: train/hardware/unit.py
        self.unit.place(self.model, self.device)  # in place; an FSDP unit moves it block by block in `wrap`
        self.compute = compute or Compute(device=self.device)
        self.compute.prepare(self.model)
        if self.unit.world > 1:
            self.unit.agree(spec.spec_hash(), "the run's spec")
            self.unit.check_batch(spec.data.batch_size)
        # DDP over the unit's processes (the model itself when solo), compiled with --compile.
        self.train_model = self.compute.compiled(self.unit.wrap(self.model))
        self._params_changed = self._optimizer_changed = False  # to send to the unit's other processes
        self.numel = theta.numel()
        self.codec = get_codec(spec.outer.codec, spec.outer.codec_block)  # the peer's one codec: shared below
        self.sender_limit = MergePolicy.from_spec(spec).sender_limit  # our payload stays inside every peer's bound
        # Where a sponsor judges (sync/sponsorship.py `sample_at`): a secret of its key, or the simulator's seed.
        judge_seed = identity.secret(b"judge " + spec.run_id.encode()) if judge_seed is None else judge_seed
        self.replica = Replica.from_spec(spec, theta, codec=self.codec, self_id=self.peer_id, judge_seed=judge_seed)
        if replica_state is not None:
            self.replica.load(*replica_state)
        self.spec_hash = spec.spec_hash()
        self.optimizer = make_inner_optimizer(self.model, spec.inner)  # after the move: AdamW state on the device
        in_files = OuterState.in_files  # m and e in files under outer_state_dir, out of memory during inner steps
        self.outer_state = in_files(self.numel, outer_state_dir) if outer_state_dir else OuterState.zeros(self.numel)
        self.sampler = make_sampler(corpus, spec, self.peer_id, shard=shard, num_shards=num_shards, stream=stream)
        self.step = 0  # cumulative inner steps: the schedule's clock and the data position
        self.last_seq = 0  # the highest seq this identity has signed (in this run, across restarts)
        self.round_weight = 0.0  # one round's share of the swarm's samples in our last update: `may_stretch`
        # Each signed update before it is merged (served) or published: the checkpoint journal (None: no restarts).
        self.persist_update: Callable[[OuterUpdate], None] | None = None
        self.history: list[dict] = []
        self._eval_model: torch.nn.Module | None = None  # only for an evaluation in the middle of a phase
        # The phase's base point: one host vector for the learner's life, not one per phase. `finish_phase` turns
        # it into the update in place, so a unit holds theta, base, m and e on the host and nothing else
        # full-size (ARCHITECTURE.md "Memory").
        self._base = torch.empty(0)
        self.in_phase = False
        # A sponsor's fit checks, on our own model between phases (one process's: it must hold the model whole).
        self.fit = FitJudge.for_sponsor(self.model, corpus, spec, judge_seed, self.peer_id, self.unit.world, fit_share)

    # ---- the round loop, in three named parts so a caller can interleave the network ----------------

    def begin_phase(self) -> Phase:
        if self._base.numel() != self.numel:
            self._base = torch.empty(self.numel)
        base = self._base
        with self.replica.lock:  # theta and V as one; copied straight into phi and base, no snapshot between
            theta, vv = self.replica.theta, self.replica.version_vector
            base.copy_(theta)
        self.unit.set_params(self.model, lambda s: base[s])
        self._params_changed = True
        self.in_phase = True
        self.outer_state.release()  # file-backed m and e: out of memory until the phase ends
        # The lr clock's base once per phase, not per inner step: it walks every sender the vector holds.
        return Phase(base=base, version_vector=vv, started_at=time.time(), swarm_rounds=swarm_rounds(vv),
                     target_steps=self.spec.inner.inner_steps)

    def run_inner(self, phase: Phase, steps: int | None = None) -> InnerResult:
        """Run `steps` more inner steps (default: the rest of the phase). Between steps, take the updates the
        replica merged meanwhile (never waiting for any). The AdamW state carries over between phases (DiLoCo)."""
        cfg = self.spec.inner
        length = phase.target_steps or cfg.inner_steps  # a stretched phase rebases over its whole length
        todo = length - phase.steps_done if steps is None else steps
        t0 = time.perf_counter()
        self.model.train()
        for _ in range(todo):
            if phase.steps_done < cfg.rebase_window * length \
                    and self.replica.version_vector != phase.version_vector:
                self._rebase(phase)
            x, y = self.sampler.batch(self.step)  # CPU batches; the unit's rows of it go to the device
            lr = lr_at(self.lr_clock(phase), cfg, own_step=self.step)
            rows = self.unit.lead_step(self.model, self.optimizer, x, y, lr, params_changed=self._params_changed,
                                       optimizer_changed=self._optimizer_changed)
            self._params_changed = self._optimizer_changed = False
            xd, yd = (t.to(self.device) for t in rows)
            # The loss of this process's rows (all of the batch in a unit of one process).
            phase.losses.append(inner_step(self.train_model, self.optimizer, xd, yd, 0, cfg, compute=self.compute,
                                           lr=lr, no_sync=self.unit.no_sync(self.train_model)))
            self.unit.step_done()
            phase.samples += x.shape[0]  # the unit's whole batch, over all its processes
            phase.steps_done += 1
            self.step += 1
        # Free the gradients now, not at the next step's zero_grad: the end of a phase (pseudo-gradient, outer
        # step, codec, merge) and a checkpoint then have their 4 bytes per parameter.
        self.optimizer.zero_grad(set_to_none=True)
        phase.compute_s += time.perf_counter() - t0
        return phase.result()

    def lr_clock(self, phase: Phase) -> int:
        """The step the lr schedule is at: our own cumulative steps (schedule_clock "own"), or the swarm's
        progress as our replica knew it when the phase began (`swarm_rounds`, times H) plus this phase's steps.
        With equal units in lockstep the two are equal; a unit 4x slower than the others, or one that joined
        late, then decays its lr with the swarm instead of training at a high lr while the swarm has cooled
        down. A joiner still warms up over its own first steps (`lr_at`'s own_step)."""
        if self.spec.inner.schedule_clock == "own":
            return self.step
        return int(phase.swarm_rounds * self.spec.inner.inner_steps) + phase.steps_done

    def _rebase(self, phase: Phase) -> None:
        """phi += theta_now - base; base <- theta_now: apply the remote updates merged since the last rebase to
        the local model, one parameter at a time (the difference on the CPU, where theta lives)."""
        base = phase.base

        def moved(s: slice) -> torch.Tensor:
            step = theta[s] - base[s]
            base[s] = theta[s]
            return step

        with self.replica.lock:
            theta, vv = self.replica.theta, self.replica.version_vector
            self.unit.set_params(self.model, moved, add=True)
        self._params_changed = True
        phase.version_vector = vv
        phase.rebases += 1

    def may_stretch(self, phase: Phase, more: int) -> bool:
        """Whether the phase may go on for `more` steps: its update will weigh (steps / H) rounds' share, and
        receivers clamp a weight to `max_weight`, so a stretch that would pass it (a small swarm: with N peers
        one round's share is about 1/N) would under-count our work. Judged by our last update's share of one round
        (none before our first update, when no backlog can exist yet)."""
        rounds = (phase.steps_done + more) / self.spec.inner.inner_steps
        return rounds * self.round_weight <= self.spec.outer.max_weight

    def finish_phase(self, phase: Phase, result: InnerResult, swarm: SwarmView) -> OuterUpdate:
        """Pseudo-gradient -> outer update, signed, merged into our own replica; the caller publishes it.
        The phase's base becomes the pseudo-gradient, then the decoded update, in place: read `phase.base` before."""
        delta = phase.base  # the pseudo-gradient and all after it: CPU, float32
        for s, phi in self.unit.each_param(self.model):
            delta[s].sub_(phi)  # base - phi (train/outer.py `pseudo_gradient`), one parameter at a time
        self.in_phase = False
        stretch = max(1, result.steps // self.spec.inner.inner_steps)
        tau = self.replica.staleness(phase.version_vector)
        # A stretched phase (k*H steps, train/loop.py) signs k rounds' samples and share (train/outer.py).
        weight = update_weight(result.samples, swarm.samples_per_round, tau, swarm.num_peers, self.spec.outer)
        self.round_weight = weight if stretch == 1 else update_weight(
            result.samples // stretch, swarm.samples_per_round, tau, swarm.num_peers, self.spec.outer)
        position = declared(self.sampler, self.peer_id, self.step - result.steps, result.steps)
        fit = self.fit.for_round() if self.fit is not None else None  # a sponsor's fit checks (train/fit.py)
        extra, vouches, own, weight = relay_payload(self.replica.relay(delta, fit), weight, self.spec.outer)
        payload, decoded = outer_update(delta, self.outer_state, self.spec.outer, self.codec, stretch, consume=True,
                                        limit=self.sender_limit, extra=extra, own_share=own, replica=self.replica)
        if self.fit is not None:  # our step as it moves theta: the next round's reference
            self.fit.remember(position, decoded * (self.spec.outer.outer_lr * weight))
        own_merged = self.replica.version_vector.get(self.peer_id)
        update = make_update(
            run_id=self.spec.run_id, spec_hash=self.spec_hash, sender=self.peer_id, tau=tau, samples=result.samples,
            seq=max(self.last_seq, own_merged) + 1, weight=weight, codec=self.codec.name, numel=self.numel,
            payload=payload, identity=self.identity, vouches=vouches,
            data=proposal_position(self.spec, self.peer_id, position))  # what a sponsor's fit check redraws
        # Durable before anyone can see it. A crash before this line loses an update nobody saw, so its seq is
        # free to be signed again with other content; after it, a restart takes this very update back.
        if self.persist_update is not None:
            self.persist_update(update)
        self.last_seq = update.seq
        outcome, _ = self.replica.offer(update, decoded=decoded)  # what receivers decode: not decoded again
        # Our own next seq always merges, unless a restart left a gap in our own seqs that no journal entry
        # could fill, or a repair (net/gossip/repair.py) adopted a state without some of our updates that our store no
        # longer held (it waits for gossip to bring the missing ones); anything else is a bug. Read again: the
        # repair runs on the network thread and may have moved V since `own_merged` was read.
        own_gap = update.seq > min(own_merged, self.replica.version_vector.get(self.peer_id)) + 1
        if outcome is not MergeOutcome.MERGED and not (outcome is MergeOutcome.BUFFERED and own_gap):
            raise RuntimeError(f"own update not merged: {outcome}")
        self.history.append({"step": self.step, "seq": update.seq, "tau": tau, "weight": weight, "steps": result.steps,
                             "loss": result.mean_loss, "compute_s": result.compute_s, "rebases": phase.rebases})
        return update

    # ---- checkpoints (train/state/ writes and verifies them; this is what goes in) ---------------------------------

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, JSON-able meta): everything a restart needs. Call between phases (phi is not saved: the
        next phase starts from theta). theta and V come from one snapshot, so V names exactly what theta holds.
        The tensors are the learner's own (m, e, the AdamW state; theta's copy in the base buffer, free between
        phases): write them before the next phase begins."""
        theta, vv = self.theta_copy()
        tensors = {"theta": theta, "rng.cpu": torch.get_rng_state()}
        tensors.update({"outer.momentum": self.outer_state.momentum, "outer.error": self.outer_state.error})
        # An FSDP unit's AdamW state is sharded over its ranks: not saved, a restart starts a fresh one.
        inner = self.optimizer.state_dict()["state"] if self.unit.saves_optimizer_state else {}
        for index, state in inner.items():
            for name, value in state.items():
                if not torch.is_tensor(value):
                    raise TypeError(f"inner optimizer state {index}.{name} is not a tensor: {type(value).__name__}")
                tensors[f"inner.{index}.{name}"] = value.detach().to("cpu").contiguous()
        meta = {"version_vector": vv.to_dict(), "version_vector_holes": vv.holes_dict(),
                "last_seq": max(self.last_seq, vv.get(self.peer_id)),
                "data": self.sampler.position(self.step), "numel": self.numel}
        return tensors, meta

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore a `state_dict` (from a checkpoint of this model). Everything is checked before anything
        changes: ValueError/KeyError/TypeError if it does not fit, and the learner is as it was."""
        if meta.get("numel") != self.numel:
            raise ValueError(f"checkpoint has {meta.get('numel')} parameters, this model {self.numel}")
        for key in ("theta", "outer.momentum", "outer.error"):
            # m and e may be float32 (an older checkpoint) or bfloat16 (outer.STATE_DTYPE): they are rounded to it
            allowed = (torch.float32,) if key == "theta" else (torch.float32, torch.bfloat16)
            if tensors[key].shape != (self.numel,) or tensors[key].dtype not in allowed:
                raise ValueError(f"checkpoint tensor {key} is {tensors[key].dtype} {tuple(tensors[key].shape)}")
        if not bool(torch.isfinite(tensors["theta"]).all()):
            raise ValueError("checkpoint theta is not finite")
        # Holes (skipped or taken-back seqs) must survive a restart: read as merged, a skipped update that turns
        # up later would be a duplicate here and merged everywhere else. Older checkpoints have none.
        vv = VersionVector.from_dict(meta["version_vector"], holes=meta.get("version_vector_holes"))
        last_seq, step, rng = meta["last_seq"], self.sampler.resume_step(meta["data"]), tensors["rng.cpu"]
        if type(last_seq) is not int or last_seq < 0:
            raise ValueError(f"bad last_seq {last_seq!r}")
        inner: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            if key.startswith("inner."):
                _, index, name = key.split(".", 2)
                inner.setdefault(int(index), {})[name] = value
        param_groups = self.optimizer.state_dict()["param_groups"]  # hyper-parameters come from the RunSpec
        known = {i for group in param_groups for i in group["params"]}
        if not set(inner) <= known:
            raise ValueError(f"inner optimizer state for parameters {sorted(set(inner) - known)} this model lacks")
        self.outer_state.load_state_dict({"momentum": tensors["outer.momentum"], "error": tensors["outer.error"]})
        self.optimizer.load_state_dict({"state": inner, "param_groups": param_groups})  # moved to the device
        self._optimizer_changed = True
        self.replica.load(tensors["theta"], vv)  # copied into the live theta
        self.step = step
        self.last_seq = max(last_seq, vv.get(self.peer_id))
        torch.set_rng_state(rng)

    def adopt_own_updates(self, updates: Iterable[OuterUpdate]) -> int:
        """After loading a checkpoint or a snapshot: offer our own signed updates (from the journal) that the
        replica lacks, in seq order, and account for the rounds published after the loaded sender state.

        Returns that number of updates (rounds of the loop): for them m, e are lost (`OuterState.skip_rounds`,
        k outer rounds for an update of a phase stretched to k*H steps) and the data position moves past the
        batches they trained on (their samples: H batches each, k*H if stretched). Idempotent: a second call
        (after a state sync that followed the checkpoint) counts nothing twice, and the replica merges nothing
        twice.
        """
        rounds = steps = 0
        H, batch = self.spec.inner.inner_steps, self.spec.data.batch_size
        for update in sorted((u for u in updates if u.sender == self.peer_id), key=lambda u: u.seq):
            if update.seq > self.last_seq:
                rounds += 1
                steps += max(H, update.header.samples // batch)  # a stretched phase trained k*H batches
                self.last_seq = update.seq
            outcome, _ = self.replica.offer(update)  # MERGED, or DUPLICATE when V already has it
            if outcome not in (MergeOutcome.MERGED, MergeOutcome.DUPLICATE, MergeOutcome.BUFFERED):
                raise RuntimeError(f"own journaled update seq={update.seq} not accepted: {outcome}")
        if self.replica.version_vector.get(self.peer_id) < self.last_seq:
            logger.warning("own updates missing from the replica up to seq=%d (merged up to %d): waiting for "
                           "peers to send them", self.last_seq, self.replica.version_vector.get(self.peer_id))
        self.outer_state.skip_rounds(steps // H, self.spec.outer.momentum)  # a stretched update: k rounds
        self.step += steps
        return rounds

    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Eval loss of the replica (not of phi). Between phases on the local model itself (the next phase loads
        theta into it anyway), so a unit holds no second model; in the middle of a phase (the simulator's clock
        may ask then) on a model of its own, so phi is left as it was."""
        if self.in_phase:
            if self._eval_model is None:
                self._eval_model = build_model(self.spec.model, self.spec.seed).to(self.device)
            model = self._eval_model
            theta, _ = self.replica.snapshot()
            load_flat_params(model, theta)
        else:
            model = self.model
            theta, _ = self.theta_copy()
            self.unit.set_params(model, lambda s: theta[s])
            self._params_changed = True
            return self.unit.evaluate(model, batches)  # sharded: a forward every rank of the unit joins
        return evaluate(model, batches)

    def theta_copy(self) -> tuple[torch.Tensor, VersionVector]:
        """(theta, V) as one, copied into the base buffer, which is free between phases (no new full-size tensor):
        valid until the next phase or `theta_copy` (mid-phase: a snapshot of its own)."""
        if self.in_phase:
            return self.replica.snapshot()
        if self._base.numel() != self.numel:
            self._base = torch.empty(self.numel)
        with self.replica.lock:
            self._base.copy_(self.replica.theta)
            return self._base, self.replica.version_vector
