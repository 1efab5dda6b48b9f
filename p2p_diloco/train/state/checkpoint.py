"""Checkpoints on disk: numbered folders, each committed atomically and verified before it is trusted (the
folder's owner, lock and journal are train/state/manager.py's).

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from p2p_diloco.train.state.journal import TMP_PREFIX, fsync_dir
from p2p_diloco.train.state.tensorfile import save_tensors

logger = logging.getLogger(__name__)

FORMAT = "p2p-diloco/checkpoint"
FORMAT_VERSION = 1
STATE_FILE = "state.safetensors"
MANIFEST_FILE = "manifest.json"
CKPT_PREFIX = "ckpt-"
MAX_MANIFEST_BYTES = 64 << 20  # a manifest holds a version vector: ~60 bytes per sender
HASH_CHUNK_BYTES = 8 << 20


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message says why (torn, corrupt, another run or peer)."""


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
            save_tensors(tensors, state)  # streamed: no second copy of the state in memory
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

    def load_newest(self, accept: Callable[[Checkpoint], object] | None = None) -> Checkpoint | None:
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
