"""The journal of a peer's own signed updates, and the durable-file helpers it and the checkpoints use.

Every update a peer signs is written here (temp file, fsync, rename, fsync of the folder) before it is merged
into the peer's replica or published: see train/state/manager.py for why (the sequence-number trap). Entries
are kept until every kept checkpoint holds them, so the journal holds at most about
(keep_checkpoints + 1) * checkpoint_every updates.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

from p2p_diloco.wire.envelope import OuterUpdate, WireError, decode_update, encode_update

logger = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"
"""Names that interrupted writes leave behind; never read, removed at the next start."""


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically and durably: a temp file in the same folder, fsync, rename, fsync."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class UpdateJournal:
    """Our own signed updates, one durable file per seq (`<seq>.update`, the encoded envelope)."""

    def __init__(self, folder: Path, *, run_id: str, spec_hash: str, peer_id: str, max_update_bytes: int) -> None:
        self.folder = Path(folder)
        self.run_id, self.spec_hash, self.peer_id = run_id, spec_hash, peer_id
        self.max_update_bytes = max_update_bytes

    def _path(self, seq: int) -> Path:
        return self.folder / f"{seq:012d}.update"

    def seqs(self) -> list[int]:
        if not self.folder.is_dir():
            return []
        return sorted(int(p.stem) for p in self.folder.glob("*.update") if p.stem.isdigit())

    def append(self, update: OuterUpdate) -> None:
        """Durable before it returns (the learner's `persist_update` hook)."""
        if update.sender != self.peer_id:
            raise ValueError("the journal holds only our own updates")
        self.folder.mkdir(parents=True, exist_ok=True)
        write_durable(self._path(update.seq), encode_update(update))

    def updates(self, after: int = 0) -> Iterator[OuterUpdate]:
        """The readable journaled updates with seq > `after`, by seq, read one at a time (each can be as large
        as the model); an unreadable one is logged and skipped (its seq still counts: `seqs` reads names)."""
        for seq in self.seqs():
            if seq <= after:
                continue
            try:
                update = decode_update(self._path(seq).read_bytes(), max_bytes=self.max_update_bytes,
                                       run_id=self.run_id, spec_hash=self.spec_hash)
                if update.sender != self.peer_id or update.seq != seq:
                    raise WireError("bad_header", f"journal entry {seq} holds sender {update.sender} seq {update.seq}")
            except (OSError, WireError) as e:
                logger.warning("journal entry unreadable seq=%d error=%s", seq, e)
                continue
            yield update

    def prune(self, up_to_seq: int) -> int:
        """Delete entries with seq <= up_to_seq (every kept checkpoint holds them); returns how many."""
        removed = 0
        for seq in self.seqs():
            if seq <= up_to_seq:
                self._path(seq).unlink(missing_ok=True)
                removed += 1
        for tmp in self.folder.glob(TMP_PREFIX + "*") if self.folder.is_dir() else []:
            tmp.unlink(missing_ok=True)
        return removed
