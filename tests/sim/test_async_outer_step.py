"""The async outer step's behaviour, kept by regression: with no delay (every unit in lockstep, updates
delivered at once) the async swarm is synchronous DiLoCo, step for step, whatever the outer optimizer.

The lr clock is pinned to each unit's own steps here: the default swarm clock reads the version vector a
phase starts from, and in the simulator a unit that ends its phase starts the next one before the others'
updates of the same instant are delivered, so its clock lags by up to (N-1)/N rounds (tests/train/
test_async_outer.py checks that clock on its own)."""

import dataclasses

import pytest
import torch

from p2p_diloco.config import SimConfig, preset
from p2p_diloco.sim.runner import simulate

BASE = preset("test")
BASE = dataclasses.replace(BASE, data=dataclasses.replace(BASE.data, max_corpus_mb=1.0),
                           inner=dataclasses.replace(BASE.inner, inner_steps=5, warmup_steps=5, decay_steps=40,
                                                     schedule_clock="own"))


pytestmark = pytest.mark.corpus_mb(1.0)  # the conftest's `corpus`: 1 MB of the stdlib


@pytest.mark.parametrize("outer", [{}, pytest.param({"momentum": 0.9, "outer_lr": 0.7}, marks=pytest.mark.slow),
                                   pytest.param({"momentum_source": "swarm", "momentum": 0.5},
                                                marks=pytest.mark.slow)],  # an opt-in step: the slow set's
                         ids=["default", "diloco", "swarm-momentum"])
def test_with_zero_delay_async_is_sync_diloco(corpus, outer):
    spec = dataclasses.replace(BASE, outer=dataclasses.replace(BASE.outer, codec="fp32", **outer))
    for rounds, atol in ((1, 1e-6), (6, 1e-3)):
        # One round: equal to float rounding. Six: the merge order differs (sync adds the updates in peer
        # order, async as they arrive) and AdamW amplifies the last bits over the rounds, no more.
        sim = dict(peers=3, total_steps=3 * 5 * rounds, latency_s=0.0, step_time_s=1.0, eval_batches=2)
        a = simulate(spec, SimConfig(method="async", **sim), corpus)
        s = simulate(spec, SimConfig(method="sync", **sim), corpus)
        assert torch.allclose(a.theta, s.theta, rtol=0, atol=atol), (rounds, (a.theta - s.theta).abs().max())
        assert abs(a.eval_loss - s.eval_loss) < 10 * atol
