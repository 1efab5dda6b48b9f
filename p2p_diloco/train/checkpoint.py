"""The state manager: checkpoints and the journal of signed updates, so a restarted learner unit resumes
(ARCHITECTURE.md "Invariants", 5).

Layout of a peer's folder (one per peer and run; `owner.json` says whose, and `lock` keeps a second process
out):

    ckpt-00000007/                one checkpoint, committed by a directory rename
        state.safetensors         theta, outer m and e, inner AdamW state, CPU RNG
        manifest.json             {"body": {format, format_version, number, created_at, files: {name: {bytes,
                                  sha256}}, meta: {round, version_vector, last_seq, data position, spec, ...}},
                                  "sha256": digest of the canonical JSON of body}
    journal/000000000042.update   every update this peer signed since the oldest kept checkpoint, encoded

Atomicity: a checkpoint is written into `.tmp-...`, every file fsynced, the manifest last, then the folder is
renamed to `ckpt-N` and the parent fsynced. A crash at any moment leaves either a `.tmp-` folder (ignored,
removed at the next start) or a complete `ckpt-N`. Loading still trusts nothing: the newest checkpoint whose
manifest parses, whose own digest and every file's size and sha256 match, and whose run, peer and model are
ours wins; each one skipped is logged with its reason (torn, bit rot, a different run), and the previous one
is tried. The last `keep` good ones are kept.

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

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from p2p_diloco.config import ConfigError
from p2p_diloco.sync.intake import max_update_bytes
from p2p_diloco.train.journal import TMP_PREFIX, UpdateJournal, fsync_dir, write_durable
from p2p_diloco.wire.envelope import OuterUpdate

logger = logging.getLogger(__name__)

FORMAT = "p2p-diloco/checkpoint"
FORMAT_VERSION = 1
STATE_FILE = "state.safetensors"
MANIFEST_FILE = "manifest.json"
CKPT_PREFIX = "ckpt-"
MAX_MANIFEST_BYTES = 64 << 20  # a manifest holds a version vector: ~60 bytes per sender
HASH_CHUNK_BYTES = 8 << 20
LOCK_WAIT_S = 15.0
"""How long a start waits for the folder's lock: a killed predecessor's child processes may hold it briefly."""
JOURNAL_KEEP_RECENT = 4
"""Own updates kept in the journal although every checkpoint holds them: a restarted peer publishes them again,
because peers may never have got them (a peer that leaves right after a round leaves its last updates in its
store only; without them its restart turns them into holes that the others wait out for gap_timeout_s, found
by tests/peer/test_restart.py under load). Costs 4 updates on disk (int8: 4 bytes per parameter in all)."""


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message says why (torn, corrupt, another run or peer)."""


class CheckpointFolderError(ConfigError):
    """The checkpoint folder is someone else's or in use; the message says what to do."""


# ---- files ---------------------------------------------------------------------------------------------------

def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


# ---- checkpoints --------------------------------------------------------------------------------------------

@dataclass
class Checkpoint:
    """A verified checkpoint: where, its number, its tensors and its meta (round, V, last_seq, ...)."""

    path: Path
    number: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]


@dataclass
class CheckpointStore:
    """Numbered checkpoints in `folder`; `save` commits one atomically, `load_newest` finds the newest good one."""

    folder: Path
    keep: int = 2
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(checkpoint, reason) for each one the last `load_newest` passed over."""

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise ValueError(f"keep must be >= 1, got {self.keep}")
        self.folder = Path(self.folder)

    def numbered(self) -> list[tuple[int, Path]]:
        """Committed checkpoint folders (good or not), oldest first."""
        out = []
        if self.folder.is_dir():
            for path in self.folder.iterdir():
                suffix = path.name[len(CKPT_PREFIX):]
                if path.name.startswith(CKPT_PREFIX) and suffix.isdigit() and path.is_dir():
                    out.append((int(suffix), path))
        return sorted(out)

    def remove_temp(self) -> int:
        """Delete what interrupted writes left (`.tmp-*`); call only while holding the folder."""
        removed = 0
        for path in list(self.folder.glob(TMP_PREFIX + "*")) if self.folder.is_dir() else []:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            removed += 1
        return removed

    def save(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
        """Commit a new checkpoint (number = newest + 1); returns its folder. `prune` then drops old ones."""
        self.folder.mkdir(parents=True, exist_ok=True)
        numbers = self.numbered()
        number = (numbers[-1][0] + 1) if numbers else 1
        tmp = self.folder / f"{TMP_PREFIX}{CKPT_PREFIX}{number:08d}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            state = tmp / STATE_FILE
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(state))
            _fsync_file(state)
            body = {"format": FORMAT, "format_version": FORMAT_VERSION, "number": number, "created_at": time.time(),
                    "files": {STATE_FILE: {"bytes": state.stat().st_size, "sha256": sha256_file(state)}},
                    "meta": meta}
            manifest = {"body": body, "sha256": hashlib.sha256(_canonical(body)).hexdigest()}
            with open(tmp / MANIFEST_FILE, "wb") as f:  # last: a folder without it was never finished
                f.write(json.dumps(manifest, indent=1).encode())
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
            final = self.folder / f"{CKPT_PREFIX}{number:08d}"
            os.rename(tmp, final)  # the commit point
            fsync_dir(self.folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def read_manifest(self, path: Path) -> dict[str, Any]:
        """The manifest body of the checkpoint in `path`, its own digest and shape checked; CheckpointError."""
        manifest_path = path / MANIFEST_FILE
        try:
            if manifest_path.stat().st_size > MAX_MANIFEST_BYTES:
                raise CheckpointError(f"manifest larger than {MAX_MANIFEST_BYTES} bytes")
            manifest = json.loads(manifest_path.read_bytes())
        except FileNotFoundError:
            raise CheckpointError("no manifest (the write did not finish)") from None
        except (OSError, ValueError) as e:
            raise CheckpointError(f"unreadable manifest: {e}") from None
        body = manifest.get("body") if isinstance(manifest, dict) else None
        if not isinstance(body, dict) or manifest.get("sha256") != hashlib.sha256(_canonical(body)).hexdigest():
            raise CheckpointError("manifest digest mismatch (corrupt)")
        if body.get("format") != FORMAT or body.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"format {body.get('format')!r} version {body.get('format_version')!r}, this "
                                  f"version reads {FORMAT!r} version {FORMAT_VERSION}")
        files = body.get("files")
        if not isinstance(files, dict) or set(files) != {STATE_FILE} or not isinstance(body.get("meta"), dict):
            raise CheckpointError("manifest lacks its file list or meta")
        return body

    def verify(self, path: Path, *, digests: bool = True) -> dict[str, Any]:
        """The manifest body if every file is whole (sizes; and sha256 when `digests`); else CheckpointError."""
        body = self.read_manifest(path)
        for name, info in body["files"].items():
            file = path / name
            if not file.is_file():
                raise CheckpointError(f"{name} is missing")
            if file.stat().st_size != info.get("bytes"):
                raise CheckpointError(f"{name} has {file.stat().st_size} bytes, the manifest says {info.get('bytes')}")
            if digests and sha256_file(file) != info.get("sha256"):
                raise CheckpointError(f"{name} sha256 mismatch (corrupt)")
        return body

    def load_newest(self, accept: Callable[[Checkpoint], None] | None = None) -> Checkpoint | None:
        """The newest checkpoint that verifies and that `accept` does not reject (it raises to reject, e.g.
        another run's), or None. Each one passed over is logged and listed in `skipped` with its reason."""
        self.skipped = []
        for number, path in reversed(self.numbered()):
            try:
                body = self.verify(path)
                tensors = load_file(str(path / STATE_FILE))
                checkpoint = Checkpoint(path, number, tensors, body["meta"])
                if accept is not None:
                    accept(checkpoint)
            except Exception as e:  # whatever makes one unusable (safetensors' own errors too): try the next
                reason = f"{type(e).__name__}: {e}" if not isinstance(e, CheckpointError) else str(e)
                logger.warning("checkpoint skipped path=%s reason=%s", path, reason)
                self.skipped.append((path.name, reason))
                continue
            return checkpoint
        return None

    def prune(self) -> list[dict[str, Any]]:
        """Keep the newest `keep` checkpoints that look whole (manifest and sizes: cheap); delete the rest,
        torn ones included. Returns the kept manifests' bodies, newest first."""
        kept: list[dict[str, Any]] = []
        for _, path in reversed(self.numbered()):
            body = None
            if len(kept) < self.keep:
                with contextlib.suppress(CheckpointError, OSError):
                    body = self.verify(path, digests=False)
            if body is not None:
                kept.append(body)
            else:
                shutil.rmtree(path, ignore_errors=True)
        return kept


# ---- one peer's folder, wired to its learner -------------------------------------------------------------

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
        self._lock_file: Any = None

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

    def attach(self, learner: Any) -> None:
        """Journal every update the learner signs, before it is merged or published."""
        self.journal.max_update_bytes = max_update_bytes(learner.spec, learner.numel)
        learner.persist_update = self.journal.append

    def restore(self, learner: Any) -> dict[str, Any] | None:
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

    def adopt_journal(self, learner: Any) -> int:
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

    def save(self, learner: Any, *, round: int) -> Path:
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
