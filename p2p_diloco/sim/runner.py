"""Run one simulated method (async p2p DiLoCo, sync DiLoCo or data-parallel) on an equal token budget."""

from __future__ import annotations

import dataclasses

from p2p_diloco.config import ConfigError, RunSpec, SimConfig
from p2p_diloco.sim.baselines import run_data_parallel, run_sync_diloco
from p2p_diloco.sim.result import Progress, SimResult
from p2p_diloco.sim.swarm import AsyncSwarm
from p2p_diloco.train.data.corpus import Corpus, load_corpus


def simulate(spec: RunSpec, sim: SimConfig, corpus: Corpus | None = None,
             progress: Progress | None = None) -> SimResult:
    spec.validate()
    sim.validate()
    if sim.method != "async" and (sim.crash or sim.join):
        raise ConfigError("--crash and --join script the async swarm; the baselines' failure behaviour is "
                          "measured by the chaos harness, not here")
    H = spec.inner.inner_steps
    if sim.total_steps < sim.peers * H:
        raise ConfigError(f"total_steps ({sim.total_steps}) must cover at least one round: "
                          f"peers x inner_steps = {sim.peers * H}")
    # Equal tokens for every method: sync DiLoCo trains whole rounds of peers x H steps, so the budget is
    # rounded down to that for all three (async would otherwise get up to one round more).
    sim = dataclasses.replace(sim, total_steps=sim.total_steps // (sim.peers * H) * (sim.peers * H))
    corpus = corpus if corpus is not None else load_corpus(spec.data)
    if sim.method == "async":
        return AsyncSwarm(spec, sim, corpus, progress=progress).run()
    if sim.method == "sync":
        return run_sync_diloco(spec, sim, corpus, progress=progress)
    return run_data_parallel(spec, sim, corpus, progress=progress)
