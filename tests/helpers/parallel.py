"""How the suite shares the machine under pytest-xdist (pyproject addopts: `-n 4 --dist loadfile
--no-loadscope-reorder`).

Each test module is one unit of work, run whole on one worker, so a module-scoped fixture (a swarm of processes,
three SwarmNodes) is built once. The modules that run real multi-process swarms form two larger units instead
(`SWARM_GROUPS`): the tests of one never load the machine at the same time, and two of them leave the other
workers to the in-process tests. They are the longest units, so they are handed out first; then the tests of the
long in-process modules (`SPREAD`), each a unit of its own.

xdist's own `--dist loadgroup` would say this with `xdist_group` marks, but it passes the groups by rewriting
test ids, which pytest 9.2's structured ids ignore (pytest-xdist issue 1386): the scheduler below reads the groups
from the module paths instead.
"""

from __future__ import annotations

import pytest

SWARM_GROUPS: dict[str, str] = {
    # Longest first within each group. The slow and netns ones (`-m slow`, `-m netns`) keep to the same groups.
    "tests/peer/test_swarm.py": "swarm-1",
    "tests/peer/test_resync_swarm.py": "swarm-1",
    "tests/peer/test_isolation.py": "swarm-1",
    "tests/net/test_crowd.py": "swarm-1",
    "tests/net/test_hostile.py": "swarm-1",
    "tests/peer/test_partition.py": "swarm-1",
    "tests/peer/test_nat.py": "swarm-1",
    "tests/peer/test_real_model.py": "swarm-2",
    "tests/peer/test_restart.py": "swarm-2",
    "tests/view/test_live_views.py": "swarm-2",
    "tests/train/test_unit.py": "swarm-2",
    "tests/peer/test_faults.py": "swarm-2",
}

SPREAD = (
    # Long modules of independent in-process tests (simulations, one-shot commands; no module-scoped fixture but
    # the cheap `corpus`): each test is a unit of its own, handed out right after the swarms, longest first.
    "tests/sim/test_crowd_poison.py",
    "tests/sim/test_async_outer_step.py",
    "tests/sync/test_intake.py",
    "tests/sim/test_sim.py",
    "tests/cli/test_cli.py",
    "tests/cli/test_doctor.py",
)


def unit_of_work(nodeid: str) -> str:
    """The unit a test runs in: its swarm group, itself (a `SPREAD` module's test), else its module."""
    path = nodeid.split("::", 1)[0]
    return nodeid if path in SPREAD else SWARM_GROUPS.get(path, path)


def make_scheduler(config: pytest.Config, log: object) -> object | None:
    """A `--dist loadfile` scheduler whose units are `unit_of_work`; None (xdist's own) for any other --dist."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SwarmGroupScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of_work(nodeid)

    return SwarmGroupScheduling(config, log)


def swarms_first(items: list[pytest.Item]) -> None:
    """Sort the swarm modules' tests to the front in `SWARM_GROUPS`' order, then the `SPREAD` ones (a stable sort:
    the rest keep their order); with --no-loadscope-reorder the scheduler hands out units in this order."""
    rank = {path: i for i, path in enumerate([*SWARM_GROUPS, *SPREAD])}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
