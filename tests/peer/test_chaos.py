"""The chaos harness's arithmetic (benchmarks/chaos_metrics.py): schedules, measured goodput and the replays of
one fault schedule for p2p-diloco, synchronous DiLoCo and data-parallel. Pure functions: no processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.chaos_metrics import (
    Action,
    Replay,
    covered,
    intervals,
    load_schedule,
    measure_peer,
    random_schedule,
    replay_data_parallel,
    replay_p2p,
    replay_sync_diloco,
    restart_costs,
    validate_schedule,
)


def _replay(kills=None, pauses=None, cuts=(), duration_s=100.0, peers=4, P=10.0, R=5.0) -> Replay:
    return Replay(peers, duration_s, P, R, kills=kills or {}, pauses=pauses or {}, cuts=list(cuts))


def test_no_faults_every_method_is_fully_busy() -> None:
    r = _replay()
    for result in (replay_p2p(r), replay_sync_diloco(r), replay_data_parallel(r)):
        assert result["goodput"] == pytest.approx(1.0), result


def test_one_kill_costs_p2p_only_the_lost_phase_and_restart_but_stalls_the_baselines() -> None:
    # peer 1 dies at 25 s (mid-phase: 5 s of work lost), restarts at 35 s, trains again at 40 s (R = 5)
    r = _replay(kills={1: [(25.0, 35.0)]})
    p2p, sync, dp = replay_p2p(r), replay_sync_diloco(r), replay_data_parallel(r)
    allocated = 4 * 100.0 - 10.0  # its 10 s down are not allocated
    # p2p: peer 1 loses 5 s of its phase + 5 s of restart; the others lose nothing
    assert p2p["allocated_peer_s"] == pytest.approx(allocated)
    assert p2p["useful_peer_s"] == pytest.approx(400 - 10 - 10)
    # data-parallel: all four stall from 25 s to 40 s
    assert dp["useful_peer_s"] == pytest.approx(4 * (100 - 15))
    # sync DiLoCo: round 3 (20-30) ends when peer 1 redoes its phase, 40-50; then rounds from 50 on
    assert sync["end_s"] == pytest.approx(100.0) and sync["rounds"] == 8
    assert sync["useful_peer_s"] == pytest.approx(4 * 8 * 10)
    assert p2p["goodput"] > sync["goodput"] and p2p["goodput"] > dp["goodput"]
    assert dp["goodput_with_down"] == pytest.approx(4 * 85 / 400)


def test_sync_diloco_redoes_a_phase_lost_while_waiting_at_the_barrier() -> None:
    # peer 0 is paused 0-15 s, so round 1 ends at 25 s; peer 2 finished at 10 s and dies at 12 s while
    # waiting: its phase is lost, it is back at 20 + 5 and redoes it: round 1 ends at 35 s
    r = _replay(kills={2: [(12.0, 20.0)]}, pauses={0: [(0.0, 15.0)]}, duration_s=36.0)
    sync = replay_sync_diloco(r)
    assert sync["rounds"] == 2 and sync["end_s"] == pytest.approx(45.0)


def test_partition_stalls_the_baselines_not_p2p() -> None:
    r = _replay(cuts=[(30.0, 50.0)])
    assert replay_p2p(r)["goodput"] == pytest.approx(1.0)
    assert replay_data_parallel(r)["goodput"] == pytest.approx(0.8)
    assert replay_sync_diloco(r)["goodput"] < 1.0


def test_measured_goodput_counts_only_surviving_updates_and_removes_pauses() -> None:
    pid = "12D3KooWpeer"
    rounds = [{"t": 10.0, "round_s": 10.0, "seq": 1, "peer_id": pid},
              {"t": 20.0, "round_s": 10.0, "seq": 2, "peer_id": pid},
              {"t": 34.0, "round_s": 14.0, "seq": 3, "peer_id": pid},  # paused 4 s inside
              {"t": 44.0, "round_s": 10.0, "seq": 4, "peer_id": pid}]  # never reached the others (killed)
    lives = [(0.0, 45.0), (55.0, 60.0)]  # killed at 45, restarted at 55, still starting at the stop
    g = measure_peer(0, lives, rounds, {pid: 3}, pauses=[(22.0, 26.0)], window=(0.0, 60.0))
    assert g.allocated_s == pytest.approx(50.0) and g.down_s == pytest.approx(10.0)
    assert g.useful_s == pytest.approx(30.0) and g.busy_s == pytest.approx(40.0)
    assert g.rounds_lost == 1 and g.goodput == pytest.approx(0.6)


def test_a_seq_signed_twice_counts_once() -> None:
    pid = "12D3KooWpeer"
    rounds = [{"t": 10.0, "round_s": 10.0, "seq": 1, "peer_id": pid},
              {"t": 30.0, "round_s": 10.0, "seq": 1, "peer_id": pid}]  # re-signed after a restart
    g = measure_peer(0, [(0.0, 30.0)], rounds, {pid: 1}, pauses=[], window=(0.0, 30.0))
    assert g.useful_s == pytest.approx(10.0) and g.rounds_lost == 1


def test_restart_costs() -> None:
    rounds = [{"t": 10.0, "round_s": 10.0}, {"t": 70.0, "round_s": 10.0}]
    (cost,) = restart_costs([50.0], rounds, [{"t": 58.0, "how": "caught_up", "seconds": 2.0}])
    assert cost["overhead_s"] == pytest.approx(10.0) and cost["to_first_update_s"] == pytest.approx(20.0)
    assert cost["catch_up"] == {"how": "caught_up", "seconds": 2.0}


def test_schedules_are_checked_and_random_ones_are_valid(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps([{"at_s": 10, "action": "kill", "peer": 1, "for_s": 30},
                                {"at_s": 20, "action": "pause", "peer": 0, "for_s": 5}]))
    actions = validate_schedule(load_schedule(path), 4, netns=False)
    assert [(a.at_s, a.action) for a in actions] == [(10, "kill"), (20, "pause"), (25, "resume"), (40, "restart")]
    for bad in ([Action(1, "kill", 0), Action(2, "kill", 0)], [Action(1, "restart", 0)], [Action(1, "kill", 4)],
                [Action(1, "explode", 0)]):
        with pytest.raises(ValueError):
            validate_schedule(bad, 4, netns=False)
    with pytest.raises(ValueError, match="--netns"):
        validate_schedule([Action(1, "partition")], 4, netns=False)
    for seed in range(20):
        schedule = random_schedule(4, 600, kill_every_s=120, down_s=30, seed=seed, pause_every_s=90, pause_s=20)
        validate_schedule(schedule, 4, netns=False)
        kills = [a for a in schedule if a.action == "kill"]
        assert 2 <= len(kills) <= 6 and all(a.at_s <= 600 - 60 - 30 for a in kills)


def test_intervals_and_coverage() -> None:
    done = [{"t": 5.0, "action": "kill", "peer": 1}, {"t": 9.0, "action": "restart", "peer": 1},
            {"t": 20.0, "action": "kill", "peer": 1}]
    assert intervals(done, "kill", "restart", 30.0) == {1: [(5.0, 9.0), (20.0, 30.0)]}
    assert covered([(0, 10), (5, 15), (20, 25)], (2, 22)) == pytest.approx(15.0)


def test_outputs_are_written_from_a_report(tmp_path: Path) -> None:
    from benchmarks.chaos import with_replays
    from benchmarks.chaos_metrics import summarize
    from benchmarks.chaos_plot import write_outputs

    pid = "12D3KooWpeer"
    rounds = [{"t": 10.0 * i, "round_s": 10.0, "seq": i, "peer_id": pid, "vv_total": 2 * i, "loss": 3.0 / i,
               "eval_loss": None, "tau": 0} for i in range(1, 7)]
    slot = measure_peer(0, [(0.0, 25.0), (35.0, 60.0)], rounds, {pid: 6}, pauses=[], window=(0.0, 60.0))
    slot.restarts = restart_costs([35.0], rounds)
    report = {"date": "2026-11-21", "command": "chaos.py --test", "config": {"peers": 1, "preset": "test",
              "inner_steps": 10}, "machine": {"cpus": 2, "loadavg_start": (1.0, 1.0, 1.0),
              "loadavg_end": (2.0, 2.0, 2.0)}, "executed": [{"t": 25.0, "action": "kill", "peer": 0},
              {"t": 35.0, "action": "restart", "peer": 0}], "t_stop": 60.0, "phase_s": 10.0,
              "restart_overhead_s": 5.0, "p2p": summarize([slot]),
              "final": {"divergence": 0.0, "digests_equal": True, "vv_totals": [12], "lost": {}},
              "checkpoint_s_mean": 0.1, "series": {"divergence": [{"t": 5.0, "divergence": 1e-3}],
                                                   "rounds": {"peer0": rounds}}}
    paths = write_outputs(with_replays(report), tmp_path / "chaos")
    md = paths["md"].read_text()
    assert "| p2p-diloco (measured) |" in md and "| data-parallel |" in md and "chaos.py --test" in md
    assert paths["png"].stat().st_size > 10_000 and json.loads(paths["json"].read_text())["replays"]
