"""Fixtures shared by the whole suite, defined once here; the helpers they use live in `tests.helpers`.

Light to import: the network stack (hivemind) loads only where a network fixture is used, so the GPU tests run on
a machine that has only torch and the package's training side."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from p2p_diloco.config import preset
from p2p_diloco.train.data.corpus import Corpus, load_corpus

if TYPE_CHECKING:
    from tests.helpers.net import LoopThread, Member


@functools.cache
def _stdlib_corpus(max_corpus_mb: float | None) -> Corpus:
    """The `test` preset's stdlib corpus (its own size, or `max_corpus_mb`), loaded once per process: a corpus
    is read-only once loaded (`Corpus`), so every module that asks for the same size shares it."""
    spec = preset("test")
    data = spec.data if max_corpus_mb is None else dataclasses.replace(spec.data, max_corpus_mb=max_corpus_mb)
    return load_corpus(data, block_size=spec.model.block_size)


@pytest.fixture(scope="module")
def corpus(request: pytest.FixtureRequest) -> Corpus:
    """The `test` preset's stdlib corpus; a module marked `pytest.mark.corpus_mb(n)` gets an n-MB one instead
    (the simulator's tests train on 1 MB)."""
    marker = request.node.get_closest_marker("corpus_mb")
    return _stdlib_corpus(float(marker.args[0]) if marker else None)


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    """One asyncio loop in a daemon thread per test module, closed (leftover tasks cancelled) at its end."""
    from tests.helpers.net import LoopThread

    lt = LoopThread()
    try:
        yield lt
    finally:
        lt.close()


@pytest.fixture(scope="module")
def members(loop: LoopThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Member]]:
    """Three SwarmNodes on 127.0.0.1 (port 0) per module: the first, and two bootstrapped from it."""
    from tests.helpers.net import start_member

    out: list[Member] = []
    try:
        for _ in range(3):
            out.append(loop.run(start_member(tmp_path_factory, tuple(out[0].node.visible_maddrs()) if out else ())))
        yield out
    finally:
        for m in out:
            loop.run(m.node.shutdown(), timeout_s=30)


# ---------------------------------------------------------------------------------------------- parallel runs


def pytest_configure(config: pytest.Config) -> None:
    """One torch thread per xdist worker: 4 workers on 2 cores each running torch's default 2 threads spin against
    each other (a simulation ran 20x slower). OMP_NUM_THREADS=1 does the same for the processes a test starts
    without --torch-threads (torch reads it when it loads; the children inherit it); it did not change the suite's
    time measurably (320 s either way). Why an in-process test beside the swarms is still 10x slower than alone
    (72 s against 6 s): tests/helpers/swarm.py `Launcher.peer`, on the kernel's autogroups."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which a run with `-p no:xdist` does not load
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`--dist loadfile` (pyproject addopts), with the real-process swarms in two units of work of their own."""
    from tests.helpers.parallel import make_scheduler

    return make_scheduler(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The swarms first, then the long in-process tests: the longest units of work must not start last."""
    from tests.helpers.parallel import swarms_first

    swarms_first(items)
