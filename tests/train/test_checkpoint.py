"""Checkpoints and the journal of signed updates (train/state/checkpoint.py): round trips, torn checkpoints, pruning,
the sequence-number trap, and a process SIGKILLed while it writes checkpoints."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import p2p_diloco.train.state.checkpoint as checkpoint_module
import p2p_diloco.train.state.manager as manager_module
from p2p_diloco.config import preset
from p2p_diloco.sync.intake import Intake
from p2p_diloco.sync.types import MergeOutcome
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.train.exchange import CollectingExchange
from p2p_diloco.train.learner import Learner, SwarmView
from p2p_diloco.train.loop import run_rounds
from p2p_diloco.train.outer import OuterState
from p2p_diloco.train.state.checkpoint import CheckpointStore
from p2p_diloco.train.state.manager import CheckpointFolderError, StateManager
from p2p_diloco.wire.envelope import encode_update
from p2p_diloco.wire.identity import Identity

pytestmark = pytest.mark.timeout(180)

BASE = preset("test")
SPEC = dataclasses.replace(BASE, inner=dataclasses.replace(BASE.inner, inner_steps=2))
VIEW = SwarmView(num_peers=2, samples_per_round=2 * SPEC.inner.inner_steps * SPEC.data.batch_size)


def Collect() -> CollectingExchange:
    """An exchange that keeps what is published: one peer, no network."""
    return CollectingExchange(VIEW)


def one_round(lrn: Learner, exchange) -> tuple:
    """One round of the round loop (train/loop.py): (update, inner result)."""
    (done,) = run_rounds(lrn, exchange)
    return done.update, done.result


class Crash(Exception):
    """Stands for a SIGKILL at a chosen line (the multi-process tests kill for real)."""


@pytest.fixture(scope="module")
def identity() -> Identity:
    return Identity.generate()


def learner(identity: Identity, corpus) -> Learner:
    return Learner(SPEC, identity, corpus, shard=1, num_shards=4)


def manager(folder: Path, identity: Identity, keep: int = 2) -> StateManager:
    state = StateManager(folder, run_id=SPEC.run_id, spec_hash=SPEC.spec_hash(), peer_id=identity.peer_id, keep=keep)
    state.open()
    return state


def restarted(folder: Path, identity: Identity, corpus) -> tuple[Learner, StateManager, dict | None]:
    """A new process's view: a fresh learner, the folder opened again, the newest checkpoint restored."""
    fresh = learner(identity, corpus)
    state = manager(folder, identity)
    state.attach(fresh)
    return fresh, state, state.restore(fresh)


def checkpointed_after_one_round(folder: Path, identity: Identity, corpus) -> tuple[Learner, StateManager]:
    """A learner with its journal attached that published seq 1 and checkpointed right after it."""
    lrn = learner(identity, corpus)
    state = manager(folder, identity)
    state.attach(lrn)
    one_round(lrn, Collect())
    state.save(lrn, round=1)
    return lrn, state


def optimizer_tensors(lrn: Learner) -> dict[str, torch.Tensor]:
    return {f"{i}.{k}": v.cpu() for i, s in lrn.optimizer.state_dict()["state"].items() for k, v in s.items()}


# ---- the learner's state --------------------------------------------------------------------------------

def test_learner_state_round_trip_resumes_identically(tmp_path: Path, identity: Identity, corpus) -> None:
    a, exchange = learner(identity, corpus), Collect()
    state = manager(tmp_path / "a", identity)
    state.attach(a)
    for _ in range(2):
        one_round(a, exchange)
    state.save(a, round=2)
    rng_at_save = torch.get_rng_state()
    torch.rand(10)  # the process's RNG moves on; the restored one must be the checkpoint's
    shutil.copytree(tmp_path / "a", tmp_path / "b", ignore=shutil.ignore_patterns("lock"))
    b, _, info = restarted(tmp_path / "b", identity, corpus)
    assert info is not None and info["round"] == 2 and info["replayed"] == 0 and info["skipped"] == []
    theta_a, vv_a = a.replica.snapshot()
    theta_b, vv_b = b.replica.snapshot()
    assert torch.equal(theta_a, theta_b) and vv_a == vv_b and vv_b.get(identity.peer_id) == 2
    assert torch.equal(a.outer_state.momentum, b.outer_state.momentum)
    assert torch.equal(a.outer_state.error, b.outer_state.error) and a.outer_state.error.abs().sum() > 0
    opt_a, opt_b = optimizer_tensors(a), optimizer_tensors(b)
    assert opt_a.keys() == opt_b.keys() and all(torch.equal(opt_a[k], opt_b[k]) for k in opt_a)
    assert (a.step, a.last_seq) == (b.step, b.last_seq) == (4, 2)
    assert torch.equal(torch.get_rng_state(), rng_at_save)
    # the uninterrupted learner and the restored one take the very same next step (same data, same state)
    update_a, _ = one_round(a, exchange)
    update_b, _ = one_round(b, Collect())
    assert update_a.seq == update_b.seq == 3 and update_a.payload == update_b.payload
    assert torch.equal(a.replica.snapshot()[0], b.replica.snapshot()[0])


def test_outer_state_after_lost_rounds_keeps_the_exact_part() -> None:
    state = OuterState(momentum=torch.full((4,), 2.0), error=torch.full((4,), 0.5))
    saved = state.state_dict()
    state.skip_rounds(0, 0.9)
    assert torch.equal(state.momentum, saved["momentum"]) and torch.equal(state.error, saved["error"])
    state.skip_rounds(2, 0.9)
    assert torch.allclose(state.momentum, torch.full((4,), 2.0 * 0.81)) and not state.error.any()
    state.load_state_dict(saved)
    assert torch.equal(state.momentum, saved["momentum"])
    with pytest.raises(ValueError, match="shape"):
        state.load_state_dict({"momentum": torch.zeros(3), "error": torch.zeros(3)})


def test_data_position_resumes_at_its_step_and_says_when_the_stream_changed(corpus, caplog) -> None:
    lrn = Learner(SPEC, Identity.generate(), corpus, shard=0, num_shards=4)
    position = lrn.sampler.position(123)
    assert lrn.sampler.resume_step(position) == 123 and "changed" not in caplog.text
    assert lrn.sampler.resume_step({**position, "shard": 3}) == 123 and "data stream changed" in caplog.text
    with pytest.raises(ValueError):
        lrn.sampler.resume_step({**position, "step": -1})


# ---- the store: round trip, torn checkpoints, pruning ------------------------------------------------------

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool]
json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.text(max_size=8)
                           | st.floats(allow_nan=False, allow_infinity=False),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                        max_size=3), max_leaves=8)


@st.composite
def tensor_dicts(draw) -> dict[str, torch.Tensor]:
    out = {}
    for name in draw(st.lists(st.text("abcdefgh.0123", min_size=1, max_size=10), min_size=1, max_size=5,
                              unique=True)):
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        seed = draw(st.integers(0, 2**31))
        dtype = draw(st.sampled_from(DTYPES))
        values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 100
        out[name] = values.to(dtype)
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tensors=tensor_dicts(), meta=st.dictionaries(st.text(max_size=8), json_values, max_size=4))
def test_load_of_save_is_the_identity(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    with tempfile.TemporaryDirectory() as folder:
        store = CheckpointStore(Path(folder), keep=2)
        store.save(tensors, meta)
        loaded = store.load_newest()
        assert loaded is not None and loaded.number == 1 and loaded.meta == meta
        assert loaded.tensors.keys() == tensors.keys()
        for name, tensor in tensors.items():
            assert loaded.tensors[name].dtype == tensor.dtype and torch.equal(loaded.tensors[name], tensor)


def _two_checkpoints(folder: Path) -> CheckpointStore:
    store = CheckpointStore(folder, keep=3)
    for value in (1.0, 2.0):
        store.save({"x": torch.full((1000,), value)}, {"value": value})
    return store


def _truncate(path: Path) -> None:
    state = path / checkpoint_module.STATE_FILE
    state.write_bytes(state.read_bytes()[:-100])


def _flip_byte(path: Path) -> None:
    state = path / checkpoint_module.STATE_FILE
    data = bytearray(state.read_bytes())
    data[-7] ^= 0x40
    state.write_bytes(bytes(data))


def _edit_manifest(path: Path) -> None:
    manifest_path = path / checkpoint_module.MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    manifest["body"]["meta"]["value"] = 3.0  # valid JSON, wrong content
    manifest_path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("damage, reason", [
    (_truncate, "bytes"),
    (_flip_byte, "sha256 mismatch"),
    (lambda p: (p / checkpoint_module.MANIFEST_FILE).unlink(), "no manifest"),
    (lambda p: (p / checkpoint_module.MANIFEST_FILE).write_text('{"body": {"form'), "unreadable manifest"),
    (_edit_manifest, "manifest digest mismatch"),
    (lambda p: (p / checkpoint_module.STATE_FILE).unlink(), "missing"),
])
def test_a_torn_checkpoint_is_detected_and_the_previous_one_used(tmp_path: Path, damage, reason: str) -> None:
    store = _two_checkpoints(tmp_path)
    damage(store.numbered()[-1][1])
    loaded = store.load_newest()
    assert loaded is not None and loaded.number == 1 and loaded.meta == {"value": 1.0}
    assert torch.equal(loaded.tensors["x"], torch.full((1000,), 1.0))
    assert len(store.skipped) == 1 and store.skipped[0][0] == "ckpt-00000002" and reason in store.skipped[0][1]
    # both torn: nothing to load (the caller then state-syncs), never a crash
    damage(store.numbered()[0][1])
    assert store.load_newest() is None and len(store.skipped) == 2


def test_a_write_killed_midway_leaves_only_a_temp_folder(tmp_path: Path, identity: Identity) -> None:
    store = _two_checkpoints(tmp_path)
    partial = tmp_path / ".tmp-ckpt-00000003-deadbeef"  # what a SIGKILL before the rename leaves
    partial.mkdir()
    (partial / checkpoint_module.STATE_FILE).write_bytes(b"\0" * 10)
    loaded = store.load_newest()
    assert loaded is not None and loaded.number == 2 and store.skipped == []
    manager(tmp_path, identity).close()  # opening the folder clears what interrupted writes left
    assert not partial.exists() and [n for n, _ in store.numbered()] == [1, 2]


def test_keep_last_k_checkpoints(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    for value in range(5):
        store.save({"x": torch.tensor([float(value)])}, {"value": value})
        store.prune()
    assert [n for n, _ in store.numbered()] == [3, 4, 5]
    _truncate(store.numbered()[-1][1])  # torn newest: pruning drops it and keeps K whole ones at most
    kept = store.prune()
    assert [n for n, _ in store.numbered()] == [3, 4] and [b["number"] for b in kept] == [4, 3]


def test_another_runs_checkpoint_is_skipped(tmp_path: Path) -> None:
    store = _two_checkpoints(tmp_path)

    def accept(checkpoint) -> None:
        if checkpoint.meta["value"] == 2.0:
            raise ValueError("spec_hash is another run's")

    loaded = store.load_newest(accept)
    assert loaded is not None and loaded.number == 1 and "another run" in store.skipped[0][1]


def test_a_folder_in_use_or_of_another_peer_is_refused(tmp_path: Path, identity: Identity, monkeypatch) -> None:
    monkeypatch.setattr(manager_module, "LOCK_WAIT_S", 0.5)
    first = manager(tmp_path, identity)
    with pytest.raises(CheckpointFolderError, match="in use by another process"):
        manager(tmp_path, identity)
    first.close()
    manager(tmp_path, identity).close()  # free again
    with pytest.raises(CheckpointFolderError, match="belongs to peer"):
        manager(tmp_path, Identity.generate())


# ---- the sequence-number trap ---------------------------------------------------------------------------------

def test_restart_takes_back_every_published_update_and_goes_on_at_the_next_seq(
        tmp_path: Path, identity: Identity, corpus) -> None:
    a, exchange = learner(identity, corpus), Collect()
    state = manager(tmp_path, identity)
    state.attach(a)
    one_round(a, exchange)
    state.save(a, round=1)
    m_ckpt = a.outer_state.momentum.clone()
    one_round(a, exchange)
    one_round(a, exchange)  # seqs 2 and 3: published after the checkpoint, then the process dies
    state.close()

    b, state, info = restarted(tmp_path, identity, corpus)
    assert info is not None and info["checkpoint_round"] == 1 and info["replayed"] == 2 and info["round"] == 3
    assert b.last_seq == 3 and b.replica.version_vector.get(identity.peer_id) == 3 and b.step == a.step
    assert torch.allclose(b.replica.snapshot()[0], a.replica.snapshot()[0], rtol=0, atol=1e-6)  # merged once each
    assert torch.allclose(b.outer_state.momentum, m_ckpt * SPEC.outer.momentum ** 2)
    assert not b.outer_state.error.any()
    # publishing the journal again sends the very bytes: a receiver sees duplicates, never equivocation
    receiver = learner(Identity.generate(), corpus)
    intake = Intake(SPEC, receiver.numel, receiver.replica)  # the receiver's network side
    for update in exchange.sent:
        assert intake.receive(encode_update(update))[0] == MergeOutcome.MERGED.value
    for update in state.journaled():
        assert intake.receive(encode_update(update))[0] == MergeOutcome.DUPLICATE.value
    update, _ = one_round(b, Collect())
    assert update.seq == 4 and intake.receive(encode_update(update))[0] == MergeOutcome.MERGED.value
    assert not receiver.replica.banned and receiver.replica.stats["equivocation"] == 0
    assert torch.allclose(receiver.replica.snapshot()[0], b.replica.snapshot()[0], rtol=0, atol=1e-6)


def test_killed_after_the_journal_write_the_update_is_merged_once(tmp_path: Path, identity: Identity,
                                                                   corpus) -> None:
    a, state = checkpointed_after_one_round(tmp_path, identity, corpus)

    def journal_then_die(update) -> None:
        state.journal.append(update)
        raise Crash()

    a.persist_update = journal_then_die  # durable, then killed before the merge and the publish
    with pytest.raises(Crash):
        one_round(a, Collect())
    assert a.replica.version_vector.get(identity.peer_id) == 1
    state.close()
    b, _, info = restarted(tmp_path, identity, corpus)
    assert info["replayed"] == 1 and b.replica.version_vector.get(identity.peer_id) == 2 and b.last_seq == 2
    assert one_round(b, Collect())[0].seq == 3


def test_killed_before_the_journal_write_the_seq_is_still_free(tmp_path: Path, identity: Identity, corpus) -> None:
    a, state = checkpointed_after_one_round(tmp_path, identity, corpus)

    def die(update) -> None:
        raise Crash()

    a.persist_update = die  # nobody can have seen seq 2: it was never written, merged or published
    with pytest.raises(Crash):
        one_round(a, Collect())
    state.close()
    b, _, info = restarted(tmp_path, identity, corpus)
    assert info["replayed"] == 0 and b.last_seq == 1 and one_round(b, Collect())[0].seq == 2


def test_an_unreadable_journal_entry_still_reserves_its_seq(tmp_path: Path, identity: Identity, corpus) -> None:
    a, state = checkpointed_after_one_round(tmp_path, identity, corpus)
    (state.journal.folder / "000000000002.update").write_bytes(b"bit rot")
    state.close()
    b, _, _ = restarted(tmp_path, identity, corpus)
    assert b.last_seq == 2
    # seq 2 may have been published: never sign it again. Our own merge waits for a peer to send seq 2.
    update, _ = one_round(b, Collect())
    assert update.seq == 3 and b.replica.version_vector.get(identity.peer_id) == 1 and b.replica.n_buffered == 1


def test_a_journal_entry_under_the_wrong_name_is_skipped_not_fatal(tmp_path: Path, identity: Identity,
                                                                    corpus) -> None:
    a, state = checkpointed_after_one_round(tmp_path, identity, corpus)
    one_round(a, Collect())  # journals seq 2 after the checkpoint
    folder = state.journal.folder
    # seq 2's bytes under seq 3's name (a bad copy, a restored backup): readable, signed, but not what the name says.
    (folder / "000000000003.update").write_bytes((folder / "000000000002.update").read_bytes())
    state.close()
    b, _, info = restarted(tmp_path, identity, corpus)
    assert info["replayed"] == 1 and b.last_seq == 3  # seq 2 taken back; seq 3 skipped yet still reserved


def test_without_a_checkpoint_the_journal_alone_keeps_seqs_unique(tmp_path: Path, identity: Identity,
                                                                   corpus) -> None:
    a = learner(identity, corpus)
    state = manager(tmp_path, identity)
    state.attach(a)
    one_round(a, Collect())
    one_round(a, Collect())
    state.close()
    b, state, info = restarted(tmp_path, identity, corpus)
    assert info is None  # no checkpoint: the peer state-syncs, then takes its journal back
    assert state.adopt_journal(b) == 2 and b.last_seq == 2 and one_round(b, Collect())[0].seq == 3


# ---- a real process killed while it writes checkpoints ------------------------------------------------------

WRITER = """
import sys, time, torch
from p2p_diloco.train.state.checkpoint import CheckpointStore
store = CheckpointStore(sys.argv[1], keep=2)
value = float(time.time())
while True:
    value += 1.0
    store.save({"a": torch.full((1 << 20,), value), "b": torch.full((1 << 19,), -value)}, {"value": value})
    store.prune()
"""


def _temp_entries(folder: Path) -> list[Path]:
    return list(folder.glob(checkpoint_module.TMP_PREFIX + "*"))


def test_sigkill_while_writing_checkpoints_always_leaves_a_good_one(tmp_path: Path) -> None:
    """A subprocess writes 6 MB checkpoints back to back; it is SIGKILLed, restarted and killed again: twice
    the moment a temp folder appears (mid-write, for sure), twice at a random moment. After every kill the
    newest good checkpoint loads, is internally consistent, and is never older than one seen before."""
    store = CheckpointStore(tmp_path, keep=2)
    rng = random.Random(0)
    newest_seen, mid_write_kills, attempts = 0, 0, 0
    for mode in ("mid_write", "mid_write", "random", "random"):
        while True:
            attempts += 1
            assert attempts <= 12, "could not land a kill inside a checkpoint write"
            proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE)
            try:
                deadline = time.monotonic() + 90
                while len(store.numbered()) <= 1 or not store.numbered()[-1][0] > newest_seen:
                    assert proc.poll() is None, proc.stderr.read().decode()
                    assert time.monotonic() < deadline, "the writer made no checkpoint"
                    time.sleep(0.01)
                if mode == "mid_write":
                    while not _temp_entries(tmp_path) and time.monotonic() < deadline:
                        time.sleep(0.001)
                else:
                    time.sleep(rng.uniform(0.0, 0.3))
                os.kill(proc.pid, signal.SIGKILL)
            finally:
                proc.kill()
                proc.wait(10)
                proc.stderr.close()
            torn = bool(_temp_entries(tmp_path))
            loaded = store.load_newest()
            assert loaded is not None and loaded.number >= newest_seen
            value = loaded.meta["value"]
            assert torch.all(loaded.tensors["a"] == value) and torch.all(loaded.tensors["b"] == -value)
            newest_seen = loaded.number
            store.remove_temp()
            if mode == "random" or torn:
                mid_write_kills += torn
                break
    print(f"kills={attempts} mid_write={mid_write_kills}")
    assert mid_write_kills >= 2


def test_default_folder_is_keyed_by_run_spec_and_peer() -> None:
    from p2p_diloco.peer.resume import default_checkpoint_dir

    assert default_checkpoint_dir("/tmp/out", "r", "f" * 64, "12D3KooWx") == Path("/tmp/out/checkpoints")
    home = default_checkpoint_dir("", "default", "ab" * 32, "12D3KooWx")
    assert home.parts[-3:] == ("p2p-diloco", "default-abababababab", "12D3KooWx")
    hostile = default_checkpoint_dir("", "../../etc", "ab" * 32, "12D3KooWx")
    assert hostile.parent.parent == home.parent.parent and ".." not in hostile.parts


def test_holes_survive_a_checkpoint(identity: Identity, corpus) -> None:
    # a skipped (or taken-back) seq read back as merged would make its late arrival a duplicate here only
    a = learner(identity, corpus)
    theta, _ = a.replica.snapshot()
    a.replica.load(theta, VersionVector({"other": 5}, holes={"other": [2, 3]}))
    tensors, meta = a.state_dict()
    b = learner(identity, corpus)
    b.load_state_dict(tensors, meta)
    assert b.replica.version_vector == a.replica.version_vector and b.replica.version_vector.holes("other") == {2, 3}


def test_the_journal_keeps_the_newest_own_updates_to_publish_them_again(tmp_path: Path, identity: Identity,
                                                                          corpus) -> None:
    """A peer that leaves right after a round may be the only one holding its last updates. Its checkpoints
    hold them, but a restart must publish them again: the journal keeps the newest few, so nobody has to wait
    out a gap for them (and they never become holes)."""
    from p2p_diloco.train.state.manager import JOURNAL_KEEP_RECENT
    a = learner(identity, corpus)
    state = manager(tmp_path, identity)
    state.attach(a)
    rounds = JOURNAL_KEEP_RECENT + 3
    for _ in range(rounds):
        one_round(a, Collect())
    state.save(a, round=rounds)
    state.save(a, round=rounds)  # the exit checkpoint: every kept checkpoint holds every seq
    assert [u.seq for u in state.journaled()] == list(range(rounds - JOURNAL_KEEP_RECENT + 1, rounds + 1))
    state.close()
    b, state, info = restarted(tmp_path, identity, corpus)
    assert info["replayed"] == 0 and b.last_seq == rounds  # journaled but not newer: nothing is counted twice
    assert [u.seq for u in state.journaled()][-1] == rounds


def test_a_checkpoint_with_float32_outer_state_still_loads(identity: Identity, corpus) -> None:
    # Checkpoints written before m and e were stored in bfloat16 hold them in float32: they load, rounded.
    a = learner(identity, corpus)
    one_round(a, Collect())
    tensors, meta = a.state_dict()
    older = {**tensors, "outer.momentum": tensors["outer.momentum"].float(),
             "outer.error": tensors["outer.error"].float()}
    b = learner(identity, corpus)
    b.load_state_dict(older, meta)
    assert b.outer_state.momentum.dtype == torch.bfloat16
    assert torch.equal(b.outer_state.momentum, a.outer_state.momentum)
    assert torch.equal(b.outer_state.error, a.outer_state.error)
    assert float(a.outer_state.momentum.float().abs().max()) > 0  # a real state, not zeros
    with pytest.raises(ValueError, match="outer.momentum"):
        b.load_state_dict({**tensors, "outer.momentum": tensors["outer.momentum"].half()}, meta)
