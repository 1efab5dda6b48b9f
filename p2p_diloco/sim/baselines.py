"""The two baselines, on the same model, data shards and token budget as the async swarm.

- Synchronous DiLoCo (Douillard et al. 2023): every peer runs H inner steps from the same theta, then all
  wait at a barrier for every update; the round lasts as long as the slowest peer.
- Data-parallel: gradients averaged every step (ring all-reduce of fp32 gradients); every step waits for the
  slowest worker. Mathematically one model trained on the N workers' batches at once.
"""

from __future__ import annotations

import random
from collections import deque

import torch

from p2p_diloco.config import RunSpec, SimConfig
from p2p_diloco.sim.result import TAIL_ROUNDS, EvalPoint, PeerReport, Progress, SimResult, divergence, eval_theta
from p2p_diloco.sync.intake import Intake
from p2p_diloco.train.data.corpus import Corpus, ShardSampler, eval_batches, evaluate
from p2p_diloco.train.exchange import SwarmView
from p2p_diloco.train.hardware.device import resolve_device
from p2p_diloco.train.inner import lr_at, make_inner_optimizer
from p2p_diloco.train.learner import Learner
from p2p_diloco.train.models.build import build_model, flat_params
from p2p_diloco.wire.envelope import encode_update
from p2p_diloco.wire.identity import Identity


def _eval_set(spec: RunSpec, sim: SimConfig, corpus: Corpus):
    return eval_batches(corpus, block_size=spec.model.block_size, batch_size=spec.data.batch_size,
                        num_batches=sim.eval_batches)


def run_sync_diloco(spec: RunSpec, sim: SimConfig, corpus: Corpus, progress: Progress | None = None) -> SimResult:
    n, H = sim.peers, spec.inner.inner_steps
    speeds = sim.speed_factors()
    device = resolve_device(sim.device)
    learners = []
    for i in range(n):  # each unit reads what the async swarm's unit i reads (`SimConfig.unit_data`)
        shard, shards, stream = sim.unit_data(i, i, n)
        learners.append(Learner(spec, Identity.generate(), corpus, shard=shard, num_shards=shards, stream=stream,
                                device=device))
    intakes = [Intake(spec, lr.numel, lr.replica) for lr in learners]  # each peer's network side
    eval_set = _eval_set(spec, sim, corpus)
    bytes_per_s = sim.bandwidth_mbps * 1e6 / 8
    bytes_sent = [0] * n
    compute_s = [0.0] * n
    tokens_per_step = spec.data.batch_size * spec.model.block_size
    rounds = sim.total_steps // (n * H)
    view = SwarmView(num_peers=n, samples_per_round=n * H * spec.data.batch_size)
    now, curve = 0.0, [EvalPoint(0.0, 0, learners[0].evaluate(eval_set))]
    eval_every = max(1, rounds // 20)
    tail_states: deque[torch.Tensor] = deque(maxlen=TAIL_ROUNDS - 1)  # the rounds before the last: tail_loss
    timing = random.Random(f"{spec.seed}/{sim.timing_seed}")  # the async swarm's timing noise, drawn alike
    for r in range(rounds):
        tail_states.append(learners[0].replica.snapshot()[0])
        phases = [lr.begin_phase() for lr in learners]
        encoded = []
        for i, (learner, phase) in enumerate(zip(learners, phases)):
            result = learner.run_inner(phase)
            encoded.append(encode_update(learner.finish_phase(phase, result, view)))
            compute_s[i] += H * sim.step_time_s / speeds[i]
        # The barrier: every peer receives every other update before the next round starts.
        for i, intake in enumerate(intakes):
            for j, data in enumerate(encoded):
                if i != j:
                    intake.receive(data)
            bytes_sent[i] += (n - 1) * len(encoded[i])
        now += _sync_round_s(sim, H, speeds, timing) + (n - 1) * len(encoded[0]) / bytes_per_s
        done = (r + 1) * n * H
        if progress:
            progress(done, sim.total_steps, None)
        if (r + 1) % eval_every == 0 or r + 1 == rounds:
            curve.append(EvalPoint(now, done * tokens_per_step, learners[0].evaluate(eval_set)))
    thetas = [lr.replica.snapshot()[0] for lr in learners]
    losses = [lr.evaluate(eval_set) for lr in learners]
    peers = [PeerReport(index=i, peer_id=lr.peer_id, alive=True, steps=lr.step, bytes_sent=bytes_sent[i],
                        tokens=lr.step * tokens_per_step, utilization=compute_s[i] / now if now else 0.0,
                        taus=[h["tau"] for h in lr.history], eval_loss=losses[i], rejected=dict(intakes[i].counts))
             for i, lr in enumerate(learners)]
    loss = sum(losses) / n
    # before round 1 there is the initial theta, as in the async round view (a run shorter than its tail)
    tail_states.extendleft([tail_states[0]] * (TAIL_ROUNDS - 1 - len(tail_states)))
    tail = eval_theta(spec, torch.stack([*tail_states, thetas[0]]).mean(0), eval_set, device)
    return SimResult(method="sync", eval_loss=loss, sim_time_s=now, round_loss=loss, tail_loss=tail,
                     tokens=rounds * n * H * tokens_per_step, divergence=divergence(thetas), curve=curve,
                     peers=peers, numel=learners[0].numel, theta=torch.stack(thetas).mean(0))


def _sync_round_s(sim: SimConfig, H: int, speeds: list[float], timing: random.Random) -> float:
    """One synchronous round on the clock: the slowest unit's phase, then the last update's arrival. Under the
    async swarm's timing noise (phase jitter, latency jitter) the barrier waits for the worst of each. (The start
    spread is not charged: the async swarm counts each unit's time from its own start too.)"""
    jitter = sim.phase_jitter
    phases = [H * sim.step_time_s / s * (1 + (timing.uniform(-jitter, jitter) if jitter else 0.0)) for s in speeds]
    latency = sim.latency_s + max((timing.uniform(0.0, sim.latency_jitter_s) if sim.latency_jitter_s else 0.0)
                                  for _ in speeds)
    return max(phases) + latency


def run_data_parallel(spec: RunSpec, sim: SimConfig, corpus: Corpus,
                      progress: Progress | None = None) -> SimResult:
    n = sim.peers
    speeds = sim.speed_factors()
    device = resolve_device(sim.device)
    torch.manual_seed(spec.seed)
    model = build_model(spec.model, spec.seed).to(device)  # float32, as the learners (see Learner)
    numel = model.num_params()
    optimizer = make_inner_optimizer(model, spec.inner)  # after the move: AdamW state on the device
    samplers = []
    for i in range(n):  # each worker reads what the async swarm's unit i reads (`SimConfig.unit_data`)
        shard, shards, stream = sim.unit_data(i, i, n)
        samplers.append(ShardSampler(corpus.train, shard=shard, num_shards=shards, block_size=spec.model.block_size,
                                     batch_size=spec.data.batch_size, seed=spec.seed, stream=stream))
    eval_set = _eval_set(spec, sim, corpus)
    # Ring all-reduce: each worker sends 2 (n-1)/n of the fp32 gradient per step, in 2 (n-1) hops.
    ring_bytes = 2 * (n - 1) / n * 4 * numel if n > 1 else 0.0
    allreduce_s = ring_bytes / (sim.bandwidth_mbps * 1e6 / 8) + 2 * (n - 1) * sim.latency_s
    step_s = max(sim.step_time_s / s for s in speeds) + allreduce_s
    steps = sim.total_steps // n
    tokens_per_step = spec.data.batch_size * spec.model.block_size
    curve = [EvalPoint(0.0, 0, evaluate(model, eval_set))]
    eval_every = max(1, steps // 20)
    model.train()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, spec.inner)
        optimizer.zero_grad(set_to_none=True)
        for sampler in samplers:  # the mean of the workers' gradients, as the all-reduce would give
            x, y = sampler.batch(step)
            _, loss = model(x.to(device), y.to(device))
            (loss / n).backward()
        if spec.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.inner.grad_clip)
        optimizer.step()
        if progress:
            progress((step + 1) * n, sim.total_steps, None)
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            curve.append(EvalPoint((step + 1) * step_s, (step + 1) * n * tokens_per_step, evaluate(model, eval_set)))
            model.train()
    now = steps * step_s
    loss = evaluate(model, eval_set)
    peers = [PeerReport(index=i, peer_id=f"worker-{i}", alive=True, steps=steps, bytes_sent=int(ring_bytes * steps),
                        tokens=steps * tokens_per_step,
                        utilization=steps * sim.step_time_s / speeds[i] / now if now else 0.0, taus=[],
                        eval_loss=loss) for i in range(n)]
    return SimResult(method="dp", eval_loss=loss, sim_time_s=now, tokens=steps * n * tokens_per_step,
                     divergence=0.0, curve=curve, peers=peers, numel=numel, theta=flat_params(model).cpu())
