"""The discrete-event scale simulator (p2p_diloco/sim/scale*.py): accounting, failures, gossip, replicas."""

from __future__ import annotations

import dataclasses
import math
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p_diloco.sim.scale import ScaleConfig, simulate_scale
from p2p_diloco.sim.scale_model import CATEGORIES, progress, recover, wall_s

# A small job: 5-minute rounds, a 10M-parameter model (5 MB int4 updates) on 1 Gbps links.
SMALL = ScaleConfig(chips=64, units=8, mtbf_chip_h=200.0, repair_s=300.0, restart_s=120.0,
                    checkpoint_interval_s=120.0, params=10_000_000, bandwidth_mbps=1000.0, duration_h=12.0,
                    samples=20)
NO_FAILURES = 1e12  # hours


def run(**changes) -> dict:
    return simulate_scale(dataclasses.replace(SMALL, **changes)).methods


def test_checkpointed_work_timeline():
    # [work 10][ckpt 2][work 10][ckpt 2][work 5][ckpt 2]: 25 s of work take 31 s of wall time.
    assert wall_s(25.0, 10.0, 2.0) == 31.0
    assert progress(11.0, 25.0, 10.0, 2.0) == (10.0, 0.0, 1.0)  # inside the first checkpoint: nothing saved
    assert progress(12.5, 25.0, 10.0, 2.0) == (10.5, 10.0, 2.0)
    assert progress(30.0, 25.0, 10.0, 2.0) == (25.0, 20.0, 5.0)  # in the last checkpoint: the tail is unsaved


def test_recovery_restarts_when_a_failure_hits_the_restart():
    failures = [105.0, 150.0]  # one during the repair (extends it), one during the restart (starts it over)

    def nxt() -> float:
        return failures[0] if failures else math.inf

    up_at, extra = recover(100.0, nxt, lambda: failures.pop(0), repair_s=10.0, restart_s=50.0, horizon_s=1e9)
    assert (up_at, extra) == (150.0 + 10.0 + 50.0, 2)


def test_one_unit_is_the_same_job_for_every_method():
    # With one unit there is nothing to decouple: DP, sync DiLoCo and the unit see the same failures, lose the
    # same work (checkpoints every round) and must reach the same goodput.
    res = run(units=1, chips=8, mtbf_chip_h=4.0, checkpoint_interval_s=SMALL.round_s, duration_h=48.0)
    assert res["dp"].failures == res["sync"].failures == res["decoupled"].failures > 50
    assert res["decoupled"].goodput == pytest.approx(res["dp"].goodput, abs=0.01)
    assert res["sync"].goodput == pytest.approx(res["dp"].goodput, abs=0.01)


def test_no_failures_no_spread_everything_is_useful():
    res = run(mtbf_chip_h=NO_FAILURES, speed_sigma=0.0)
    tail = SMALL.round_s / SMALL.duration_s  # the phase still running when the allocation ends
    assert res["decoupled"].failures == 0
    assert res["decoupled"].goodput >= 1 - tail - 1e-9
    assert res["dp"].goodput == pytest.approx(1.0)
    # tau: every phase sees the other units' previous round (equal speeds, so exactly units - 1 at the median)
    assert res["decoupled"].staleness["p50"] == SMALL.units - 1


def test_stragglers_cost_the_synchronous_methods_only():
    res = run(mtbf_chip_h=NO_FAILURES, speed_sigma=0.3)
    dec, sync, dp = (res[m] for m in ("decoupled", "sync", "dp"))
    assert dec.goodput > 0.98
    assert sync.goodput < dec.goodput - 0.1 and dp.goodput < dec.goodput - 0.1
    assert sync.breakdown["wait"] > 0.1 and dec.breakdown["wait"] == 0.0


def test_failures_hit_data_parallel_hardest():
    res = run(chips=4096, mtbf_chip_h=2_000.0, duration_h=24.0)
    dec, sync, dp = (res[m] for m in ("decoupled", "sync", "dp"))
    assert dec.failures == dp.failures > 20  # the same failure trace for every method
    assert dec.goodput > sync.goodput > dp.goodput
    assert dec.breakdown["wait"] == 0.0 and dp.breakdown["down"] > dec.breakdown["down"]


@settings(max_examples=12, deadline=None, derandomize=True)
@given(seed=st.integers(0, 1000))
def test_dp_goodput_falls_as_the_failure_rate_rises(seed):
    goodputs = []
    for mtbf_h in (400_000.0, 200_000.0, 100_000.0, 50_000.0):
        cfg = dataclasses.replace(ScaleConfig(), mtbf_chip_h=mtbf_h, methods=("dp",), duration_h=336.0, seed=seed)
        goodputs.append(simulate_scale(cfg).methods["dp"].goodput)
    assert goodputs == sorted(goodputs, reverse=True) and goodputs[0] > goodputs[-1] + 0.2


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(units=st.integers(1, 10), chips_per_unit=st.integers(1, 64), mtbf_h=st.floats(50.0, 1e6),
       repair_s=st.floats(0.0, 900.0), restart_s=st.floats(0.0, 600.0), ckpt_s=st.floats(30.0, 1200.0),
       ckpt_cost_s=st.floats(0.0, 20.0), sigma=st.floats(0.0, 0.5), gossip=st.sampled_from(["full", "tree"]),
       dedup=st.booleans(), seed=st.integers(0, 10_000))
def test_accounting_and_replicas_hold_for_any_job(units, chips_per_unit, mtbf_h, repair_s, restart_s, ckpt_s,
                                                  ckpt_cost_s, sigma, gossip, dedup, seed):
    cfg = dataclasses.replace(SMALL, units=units, chips=units * chips_per_unit, mtbf_chip_h=mtbf_h,
                              repair_s=repair_s, restart_s=restart_s, checkpoint_interval_s=ckpt_s,
                              checkpoint_cost_s=ckpt_cost_s, speed_sigma=sigma, gossip=gossip, dedup_inflight=dedup,
                              duration_h=6.0, seed=seed)
    for method, res in simulate_scale(cfg).methods.items():
        assert 0.0 <= res.goodput <= 1.0, method
        assert set(res.breakdown) == set(CATEGORIES)
        assert min(res.breakdown.values()) >= -1e-9, (method, res.breakdown)
        assert sum(res.breakdown.values()) == pytest.approx(1.0, abs=1e-9), (method, res.breakdown)
    dec = simulate_scale(dataclasses.replace(cfg, methods=("decoupled",))).methods["decoupled"]
    assert dec.gossip["audited"] == 1 and dec.double_merges == 0  # no update merged twice by any replica
    assert dec.converged  # once quiet, every replica holds every published update
    assert sum(dec.tau_histogram.values()) == dec.gossip["published"]


def test_full_dissemination_traffic_grows_linearly_and_tree_stays_flat():
    copies = {}
    for gossip in ("full", "tree"):
        for n in (4, 16, 64):
            res = run(units=n, chips=n, mtbf_chip_h=NO_FAILURES, gossip=gossip, dedup_inflight=True,
                      duration_h=1.0, methods=("decoupled",))["decoupled"]
            assert res.converged
            copies[gossip, n] = res.traffic["copies_sent_mean"]
    for n in (4, 16, 64):  # full: each unit sends about one copy of every other unit's update
        assert n - 1 <= copies["full", n] <= 1.3 * (n - 1), copies
        assert 1.4 <= copies["tree", n] <= 2.0, copies  # tree: one sum up and its share of the k copies down
    assert copies["full", 64] / copies["full", 4] > 12


def test_the_real_tree_rules_cost_more_than_the_ideal_tree_and_stay_flat():
    """int32 sums, leaves' updates whole and audit answers (`tree_rules="real"`): more bytes than sums the size of
    an update, still independent of N, still every update delivered."""
    sent = {}
    for rules in ("ideal", "real"):
        for n in (4, 16, 64):
            res = run(units=n, chips=n, mtbf_chip_h=NO_FAILURES, gossip="tree", tree_rules=rules,
                      duration_h=1.0, methods=("decoupled",))["decoupled"]
            assert res.converged
            sent[rules, n] = res.traffic["sent_mean"]
    for n in (4, 16, 64):
        assert sent["real", n] > 2 * sent["ideal", n], sent  # a sum is 4 bytes a parameter, an update less
    assert max(sent["real", n] for n in (4, 16, 64)) < 2 * min(sent["real", n] for n in (4, 16, 64)), sent


def test_gossip_without_claims_pulls_duplicates_that_the_real_gossip_avoids():
    # 5 MB updates take 40 ms on 1 Gbps: a second announcer often arrives while the first pull is in flight.
    base = dict(mtbf_chip_h=NO_FAILURES, units=16, chips=16, duration_h=2.0, methods=("decoupled",))
    real = run(**base)["decoupled"]  # the default: the real gossip's claims (net/gossip/pulls.py)
    unclaimed = run(**base, dedup_inflight=False)["decoupled"]
    assert unclaimed.gossip["duplicates"] > 0 and real.gossip["duplicates"] == 0
    assert unclaimed.traffic["payload_sent_mean"] > real.traffic["payload_sent_mean"]


def test_deterministic_by_seed():
    cfg = dataclasses.replace(SMALL, duration_h=4.0)
    a = simulate_scale(cfg).to_dict()
    b = simulate_scale(cfg).to_dict()
    c = simulate_scale(dataclasses.replace(cfg, seed=1)).to_dict()
    for d in (a, b, c):
        for res in d["methods"].values():
            res.pop("wall_s")
    assert a == b and a != c


def test_a_million_chips_simulate_quickly():
    # DeepMind's 1.2M-chip setting (8 learner units, the default config) for two simulated days.
    res = simulate_scale(dataclasses.replace(ScaleConfig(), duration_h=48.0, samples=10))
    dec, dp = res.methods["decoupled"], res.methods["dp"]
    assert dec.failures > 200  # 1.2M chips / 210,000 h = 5.7 failures an hour
    assert dec.goodput > dp.goodput + 0.3
    assert dec.wall_s < 60, f"{dec.wall_s:.1f}s of wall time for {dec.events} events"
    print(f"1.2M chips, 48 h: decoupled {dec.goodput:.3f} in {dec.wall_s:.1f}s, dp {dp.goodput:.3f}",
          file=sys.stderr)


def test_config_validation_names_the_problem():
    with pytest.raises(ValueError, match="units"):
        dataclasses.replace(SMALL, units=0).validate()
    with pytest.raises(ValueError, match="gossip"):
        dataclasses.replace(SMALL, gossip="flood").validate()
    with pytest.raises(ValueError, match="methods"):
        dataclasses.replace(SMALL, methods=("spmd",)).validate()


def test_the_simulator_needs_no_torch():
    import subprocess

    code = "import sys, p2p_diloco.sim.scale; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
