"""The state manager: one peer's checkpoint folder wired to its learner, so a restarted learner unit resumes
(ARCHITECTURE.md "Invariants", 5): the folder's ownership and lock, the journal of signed updates, save and
restore. The checkpoints themselves are train/state/checkpoint.py's.

The sequence-number trap. Receivers treat two different updates with one (sender, seq) as equivocation and
ban the sender, so a restarted peer must never sign other content under a seq it used before. Rule: an update
is written to the journal (temp file, fsync, rename, fsync) *before* it is merged into our replica (which the
snapshot server hands to joiners) or published, i.e. before anyone can see it. Then, whenever the process
dies:
  - before the journal write: nobody saw that update, so its seq is still free; the restart signs a new one;
  - after it (published or not, checkpointed or not): the restart loads the newest checkpoint, then offers
    the journaled updates newer than the checkpoint's V to the replica (so our own update is merged exactly
    once: V says what theta holds) and publishes them again, the same bytes, which receivers count as
    duplicates. The next seq is one past the highest journaled one, even if that file were unreadable.
  - m and e of rounds after the checkpoint are lost: `OuterState.skip_rounds` keeps the part of m that is
    exact and drops the spent e; the data position moves past those rounds' batches.
The journal is pruned only up to what the oldest kept checkpoint holds, so falling back to an older
checkpoint (the newest torn) still finds every later update of ours.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from p2p_diloco.config import ConfigError
from p2p_diloco.sync.intake import max_update_bytes
from p2p_diloco.train.state.checkpoint import Checkpoint, CheckpointError, CheckpointStore
from p2p_diloco.train.state.journal import UpdateJournal, write_durable
from p2p_diloco.wire.envelope import OuterUpdate

if TYPE_CHECKING:
    from p2p_diloco.train.learner import Learner

logger = logging.getLogger(__name__)

LOCK_WAIT_S = 15.0
"""How long a start waits for the folder's lock: a killed predecessor's child processes may hold it briefly."""
JOURNAL_KEEP_RECENT = 4
"""Own updates kept in the journal although every checkpoint holds them: a restarted peer publishes them again,
because peers may never have got them (a peer that leaves right after a round leaves its last updates in its
store only; without them its restart turns them into holes that the others wait out for gap_timeout_s, found
by tests/peer/test_restart.py under load). Costs 4 updates on disk (int8: 4 bytes per parameter in all)."""


class CheckpointFolderError(ConfigError):
    """The checkpoint folder is someone else's or in use; the message says what to do."""


class StateManager:
    """A peer's checkpoint folder: ownership and a lock, the journal hooked into the learner, save, restore.

    `open()` first (it fails with CheckpointFolderError if the folder is another peer's or run's, or in use);
    `attach(learner)` before the first round; `restore(learner)` at start-up; `save(learner, round=...)`
    between rounds; `close()` at exit.
    """

    def __init__(self, folder: str | Path, *, run_id: str, spec_hash: str, peer_id: str, keep: int = 2,
                 max_update_bytes: int = 0) -> None:
        """`max_update_bytes` bounds a journal entry read back (`attach` sets it from the run's spec)."""
        self.folder = Path(folder).expanduser()
        self.run_id, self.spec_hash, self.peer_id = run_id, spec_hash, peer_id
        self.store = CheckpointStore(self.folder, keep)
        self.journal = UpdateJournal(self.folder / "journal", run_id=run_id, spec_hash=spec_hash,
                                     peer_id=peer_id, max_update_bytes=max_update_bytes)
        self._lock_file: IO[bytes] | None = None

    def open(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock()
        owner = {"run_id": self.run_id, "spec_hash": self.spec_hash, "peer_id": self.peer_id}
        owner_path = self.folder / "owner.json"
        if owner_path.exists():
            try:
                theirs = json.loads(owner_path.read_text())
            except (OSError, ValueError):
                theirs = None  # a torn owner file: written atomically, so only by hand; take the folder
            if isinstance(theirs, dict) and theirs != owner:
                self.close()
                raise CheckpointFolderError(
                    f"checkpoint folder {self.folder} belongs to peer {theirs.get('peer_id')} of run "
                    f"{theirs.get('run_id')!r} (spec {str(theirs.get('spec_hash'))[:12]}); this is peer "
                    f"{self.peer_id} of run {self.run_id!r} (spec {self.spec_hash[:12]}): give this peer its own "
                    "--checkpoint-dir (or --out-dir), or remove that folder to start over")
        write_durable(owner_path, json.dumps(owner, indent=1).encode())
        self.store.remove_temp()  # what a crash mid-write left
        self.journal.prune(0)  # (only its temp files)

    def _lock(self) -> None:
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock (the identity's live-record warning remains)
            return
        self._lock_file = open(self.folder / "lock", "a+b")  # noqa: SIM115 (held until close())
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError:
                if time.monotonic() > deadline:
                    self._lock_file.close()
                    self._lock_file = None
                    raise CheckpointFolderError(
                        f"checkpoint folder {self.folder} is in use by another process (a peer with this "
                        "identity already running?): two processes must not sign updates as one peer; give "
                        "each peer its own --identity and --checkpoint-dir") from None
                time.sleep(0.2)

    def close(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # releases the lock
            self._lock_file = None

    def attach(self, learner: Learner) -> None:
        """Journal every update the learner signs, before it is merged or published."""
        self.journal.max_update_bytes = max_update_bytes(learner.spec, learner.numel)
        learner.persist_update = self.journal.append

    def restore(self, learner: Learner) -> dict[str, Any] | None:
        """Load the newest good checkpoint into `learner`, then take back our journaled updates. None if no
        checkpoint could be used (call `adopt_journal` after the state sync then)."""
        def accept(checkpoint: Checkpoint) -> None:
            meta = checkpoint.meta
            for key in ("run_id", "spec_hash", "peer_id"):
                if meta.get(key) != getattr(self, key):
                    raise CheckpointError(f"{key} is {meta.get(key)!r}, ours {getattr(self, key)!r}")
            if not isinstance(meta.get("round"), int):
                raise CheckpointError("no round in the manifest")
            learner.load_state_dict(checkpoint.tensors, meta)

        checkpoint = self.store.load_newest(accept)
        if checkpoint is None:
            return None
        replayed = self.adopt_journal(learner)
        vv = learner.replica.version_vector
        return {"checkpoint": str(checkpoint.path), "number": checkpoint.number,
                "round": checkpoint.meta["round"] + replayed, "checkpoint_round": checkpoint.meta["round"],
                "replayed": replayed, "step": learner.step, "last_seq": learner.last_seq,
                "own_merged": vv.get(self.peer_id), "vv_total": vv.total(),
                "skipped": [f"{name}: {reason}" for name, reason in self.store.skipped]}

    def adopt_journal(self, learner: Learner) -> int:
        """Offer our journaled updates to the learner's replica (after a checkpoint or a state sync loaded
        it); returns the rounds they add beyond the loaded sender state. The next seq is past every journaled
        name, readable or not."""
        own_merged = learner.replica.version_vector.get(self.peer_id)
        rounds = learner.adopt_own_updates(self.journal.updates(after=own_merged))
        seqs = self.journal.seqs()
        if seqs and seqs[-1] > learner.last_seq:
            logger.warning("journal entries up to seq=%d unreadable: skipping those seqs", seqs[-1])
            learner.last_seq = seqs[-1]
        return rounds

    def journaled(self) -> Iterator[OuterUpdate]:
        """Our journaled updates, oldest first, one at a time: to publish again after a restart. Peers may lack
        any of them (a crash right after a publish, or a peer away since), and we were their only source."""
        return self.journal.updates()

    def save(self, learner: Learner, *, round: int) -> Path:
        """Checkpoint the learner (between rounds), prune old checkpoints, then the journal entries that every
        kept checkpoint holds, but the newest JOURNAL_KEEP_RECENT of them."""
        tensors, meta = learner.state_dict()
        meta.update(round=round, step=learner.step, run_id=self.run_id, spec_hash=self.spec_hash,
                    peer_id=self.peer_id)
        spec = getattr(learner, "spec", None)
        if spec is not None:  # the run's spec, so `p2p-diloco export` rebuilds the model from a checkpoint alone
            meta["spec"] = spec.to_dict()
        path = self.store.save(tensors, meta)
        kept = self.store.prune()
        own = [int(body["meta"]["version_vector"].get(self.peer_id, 0)) for body in kept]
        if own:
            self.journal.prune(min(own) - JOURNAL_KEEP_RECENT)
        return path
