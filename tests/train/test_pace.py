"""train/pace.py: a unit sharing its machine computes `duty_cycle` of the wall time over its inner steps."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2p_diloco.train.pace import Pace


def test_half_duty_rests_as_long_as_each_step_took():
    pace = Pace(0.5)
    pace.begin(10.0)
    assert pace.rest_s(11.0) == pytest.approx(1.0)  # a 1 s step, then 1 s of rest
    assert pace.rest_s(12.5) == pytest.approx(0.5)  # the next step began after the rest, at 12.0
    pace.begin(100.0)  # a new phase: the outer step and the wait before it are not paced
    assert pace.rest_s(100.2) == pytest.approx(0.2)


def test_flat_out_never_rests_and_bad_duty_cycles_are_refused():
    pace = Pace()
    pace.begin(0.0)
    assert pace.rest_s(5.0) == 0.0
    for bad in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match="duty_cycle"):
            Pace(bad)


@given(st.floats(0.05, 1.0), st.lists(st.floats(0.001, 10.0), min_size=1, max_size=50))
def test_over_a_phase_the_unit_computes_its_duty_cycle_of_the_wall_time(duty, steps):
    pace, now, busy = Pace(duty), 0.0, 0.0
    pace.begin(now)
    for step in steps:
        now += step
        busy += step
        now += pace.rest_s(now)
    assert busy / now == pytest.approx(duty, rel=1e-9)
