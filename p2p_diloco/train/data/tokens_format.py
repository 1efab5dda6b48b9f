"""The token dataset format (train/data/tokens.py describes it): names, the manifest, the fingerprints.

Shared by the reading side (train/data/tokens.py) and the writing side (train/data/tokens_prepare.py,
train/data/tokens_sources.py), so neither imports the other.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

TOKENS_FORMAT = "p2p-diloco/tokens"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
TOKENIZER_DIR = "tokenizer"
SPLITS = ("train", "eval")
DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
HASH_CHUNK_BYTES = 1 << 24


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def cache_root() -> Path:
    """$P2P_DILOCO_CACHE, default ~/.cache/p2p-diloco."""
    return Path(os.environ.get("P2P_DILOCO_CACHE") or Path.home() / ".cache" / "p2p-diloco").expanduser()


# ---- fingerprints (shared with tokens_prepare.py) -----------------------------------------------------

def tokenizer_fingerprint(tokenizer_dir: Path) -> str:
    path = Path(tokenizer_dir) / "tokenizer.json"
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def dataset_fingerprint(folder: Path, manifest: dict) -> str:
    """Re-hash the token files of `folder` as described by `manifest` (the module docstring's definition)."""
    h = hashlib.sha256(f"{TOKENS_FORMAT}/{FORMAT_VERSION}:{manifest['dtype']}".encode())
    for name in SPLITS:
        h.update(int(manifest[name]["tokens"]).to_bytes(8, "big"))
    for name in SPLITS:
        for file in manifest[name]["files"]:
            with open(Path(folder) / file, "rb") as f:
                while block := f.read(HASH_CHUNK_BYTES):
                    h.update(block)
    h.update(manifest["tokenizer_fingerprint"].encode())
    return h.hexdigest()[:16]


def _read_manifest(folder: Path) -> dict | None:
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == TOKENS_FORMAT else None


def is_token_dataset(path: str | os.PathLike) -> bool:
    """True for a folder whose manifest.json says it is a p2p-diloco token dataset."""
    folder = Path(path).expanduser()
    return folder.is_dir() and _read_manifest(folder) is not None
