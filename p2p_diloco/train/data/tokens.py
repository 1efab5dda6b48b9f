"""Token datasets: a prepared folder of token shards, memory-mapped, and how each learner unit walks it.

A prepared folder (`p2p-diloco data prepare`, train/data/tokens_prepare.py) holds `manifest.json` (format
"p2p-diloco/tokens", version 1), `train.bin` and `eval.bin` (raw little-endian uint16, or uint32 when the
vocabulary exceeds 65536 ids; documents end with the eos token) and `tokenizer/`, which
`transformers.AutoTokenizer.from_pretrained` loads offline. The fingerprint is the first 16 hex chars of
sha256 over the format, dtype, the two token counts, the train then eval token bytes and the tokenizer's
fingerprint (sha256 of its tokenizer.json): equal fingerprints mean the same tokens from the same tokenizer.
Loading maps the files; nothing is read into memory until a batch touches it.

Which data each learner unit reads (`WalkSampler`), with no coordination between units:

- The train tokens are cut into windows of block_size+1 tokens (window k: tokens [k*T, k*T+T+1)), n of them.
- Unit u reads them in epochs: in its epoch e, its i-th read is window pi_{u,e}(i), where pi_{u,e} is a keyed
  pseudo-random permutation of [0, n) (`KeyedPermutation`, keyed by sha256(seed, PeerID, e)); row j of the
  batch at step s is read s * batch_size + j. So every batch is spread over the whole dataset, as a shuffled
  data loader's is, and a unit reads every window once per epoch before it repeats one.
- Units are independent shuffles: the share of a unit's first k reads that one of N-1 others also read is
  1 - (1 - k/n)^(N-1) (about k(N-1)/n), for every unit alike, and no two units are ever paired for good. The
  byte path's sha256(PeerID) mod 16 shards overlap less on average at 4 units (0.15) but all-or-nothing: two of
  4 units share a shard, and all of its bytes, for the whole run about 1 time in 3, and at 16 units 62% of
  reads are duplicates from the start (tests/train/test_tokens.py prints both). Joining and leaving need no
  coordination. (Coordinated partitions, a joiner taking the largest unread gap from the others' records, would
  overlap less; not built.)
- Two earlier designs: one contiguous, phase-sized chunk per unit and round made each inner phase train on one
  or two source files, and the eval loss swung by up to 1.5 nats from round to round (BENCHMARKS.md, "Real
  models"); one shared permutation read from a per-unit offset paired a unit that started just behind another
  with it, epoch after epoch.

The batch at step s is a pure function of (seed, peer_id, step) and the data, so a restarted unit resumes its
data position from its step counter alone (`position` / `resume_step`, as `ShardSampler`).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from p2p_diloco.train.data.corpus import DataError, _windows, resume_step
from p2p_diloco.train.data.tokens_format import (  # noqa: F401 (re-exported: the format's names live here too)
    DTYPES,
    FORMAT_VERSION,
    MANIFEST_NAME,
    SPLITS,
    TOKENIZER_DIR,
    TOKENS_FORMAT,
    _read_manifest,
    cache_root,
    dataset_fingerprint,
    is_token_dataset,
    token_dtype,
    tokenizer_fingerprint,
)

logger = logging.getLogger(__name__)

# ---- loading -----------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class TokenDataset:
    """Train and eval token ids (1-D tensors over memory maps; read-only), duck-compatible with data.Corpus."""

    train: torch.Tensor
    eval: torch.Tensor
    fingerprint: str
    tokenizer_fingerprint: str
    vocab_size: int
    eos_id: int
    source: str
    tokenizer_dir: Path
    dtype: str
    manifest: dict = field(repr=False)

    def describe(self) -> str:
        return (f"corpus={self.source} tokens train={self.train.numel()} eval={self.eval.numel()} "
                f"vocab={self.vocab_size} dtype={self.dtype} tokenizer={self.tokenizer_fingerprint} "
                f"fingerprint={self.fingerprint}")


def load_token_dataset(path: str | os.PathLike, *, block_size: int | None = None,
                       verify: bool = False) -> TokenDataset:
    """Map a prepared folder. Checks the manifest and the file sizes; `verify` also re-hashes the fingerprint.

    Given `block_size`, also check that each split holds one sequence of block_size+1 tokens.
    """
    folder = Path(path).expanduser()
    fix = f"prepare it again with `p2p-diloco data prepare ... --out {folder} --force`"
    if not folder.is_dir():
        raise DataError(f"token dataset {str(folder)!r} does not exist or is not a folder; "
                        f"create it with `p2p-diloco data prepare SOURCE --out {folder}`")
    manifest = _read_manifest(folder)
    if manifest is None:
        raise DataError(f"{str(folder)!r} has no readable {MANIFEST_NAME} of format {TOKENS_FORMAT!r}; {fix}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DataError(f"token dataset {str(folder)!r} has format_version {manifest.get('format_version')!r}, "
                        f"this p2p-diloco reads {FORMAT_VERSION}; {fix} (or upgrade p2p-diloco)")
    try:
        dtype = DTYPES[manifest["dtype"]]
        parts = {}
        for name in SPLITS:
            files, n = manifest[name]["files"], int(manifest[name]["tokens"])
            if len(files) != 1:
                raise DataError(f"token dataset {str(folder)!r}: format_version 1 holds one file per split, "
                                f"{name} lists {len(files)}; {fix}")
            parts[name] = (folder / files[0], n)
        fingerprint, tok_fp = str(manifest["fingerprint"]), str(manifest["tokenizer_fingerprint"])
        vocab_size, eos_id = int(manifest["vocab_size"]), int(manifest["eos_id"])
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"the manifest of token dataset {str(folder)!r} is corrupt ({type(e).__name__}: {e}); "
                        f"{fix}") from None
    tokenizer_dir = folder / TOKENIZER_DIR
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise DataError(f"token dataset {str(folder)!r} has no {TOKENIZER_DIR}/tokenizer.json; {fix}")
    for file, n in parts.values():
        size = file.stat().st_size if file.is_file() else None
        if size != n * dtype.itemsize:
            raise DataError(f"token dataset {str(folder)!r}: {file.name} is {size} bytes but the manifest says "
                            f"{n} {manifest['dtype']} tokens ({n * dtype.itemsize} bytes): truncated or "
                            f"modified; {fix}")
    if verify:
        actual = dataset_fingerprint(folder, manifest)
        if actual != fingerprint or tokenizer_fingerprint(tokenizer_dir) != tok_fp:
            raise DataError(f"token dataset {str(folder)!r} does not match its manifest's fingerprint "
                            f"{fingerprint} (the files hash to {actual}); {fix}")
    needed = (block_size or 1) + 1
    for name, (_, n) in parts.items():
        if n < needed:
            raise DataError(f"token dataset {str(folder)!r} is too small: its {name} split has {n} tokens but one "
                            f"sequence needs block_size+1 = {needed}; prepare more text, a larger eval fraction "
                            f"or use a smaller block_size")
    dataset = TokenDataset(
        train=_map(*parts["train"], dtype), eval=_map(*parts["eval"], dtype), fingerprint=fingerprint,
        tokenizer_fingerprint=tok_fp, vocab_size=vocab_size, eos_id=eos_id,
        source=str(manifest.get("source") or folder), tokenizer_dir=tokenizer_dir, dtype=manifest["dtype"],
        manifest=manifest)
    logger.info("loaded token dataset %s", dataset.describe())
    return dataset


def _map(file: Path, n: int, dtype: np.dtype) -> torch.Tensor:
    # Copy-on-write map: pages are read only when a batch touches them, and the array is writable, which
    # torch.from_numpy wants; nobody writes, and a write would stay private to this process anyway.
    array = np.memmap(file, dtype=dtype, mode="c", shape=(n,))
    if dtype == DTYPES["uint32"]:
        # torch has no general uint32 indexing; token ids < 2**31 read the same as int32.
        return torch.from_numpy(array.view(np.int32))
    if _uint16_indexes():
        return torch.from_numpy(array)
    logger.warning("this torch cannot index uint16 tensors: reading %s into memory as int32", file)
    return torch.from_numpy(np.asarray(array, dtype=np.int32))


_UINT16_OK: bool | None = None


def _uint16_indexes() -> bool:
    global _UINT16_OK
    if _UINT16_OK is None:
        try:
            probe = torch.from_numpy(np.arange(8, dtype="<u2"))
            rows = probe[torch.tensor([[1, 2], [3, 4]])].long()
            _UINT16_OK = rows.tolist() == [[1, 2], [3, 4]] and probe[2:4].numel() == 2
        except (TypeError, RuntimeError, AttributeError):
            _UINT16_OK = False
    return _UINT16_OK


# ---- sampling ----------------------------------------------------------------------------------------

def _hash_int(*parts: object) -> int:
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a cheap, well-mixed 64-bit hash of an integer."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


class KeyedPermutation:
    """A pseudo-random permutation of [0, n) from a key, evaluated per index in O(1) memory: a 4-round Feistel
    network on the smallest even bit width covering n, with cycle-walking (re-encrypt until the value is < n;
    fewer than 4 tries on average). A bijection whatever the round function, so every index maps to a distinct
    value; 10^9 windows cost nothing to hold, unlike randperm."""

    ROUNDS = 4

    def __init__(self, n: int, key: int) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)  # 2 * half bits cover [0, n)
        self.keys = [_mix(key + 0x9E3779B97F4A7C15 * (i + 1) & _MASK64) for i in range(self.ROUNDS)]

    def __call__(self, i: int) -> int:
        x = i
        mask = (1 << self.half) - 1
        while True:
            left, right = x >> self.half, x & mask
            for k in self.keys:
                left, right = right, left ^ (_mix(right ^ k) & mask)
            x = (left << self.half) | right
            if x < self.n:
                return x


class WalkSampler:
    """Unit `peer_id`'s reads of `data` (module docstring): every window of block_size+1 tokens once per epoch, in
    an order keyed by (seed, PeerID, epoch)."""

    def __init__(self, data: torch.Tensor, *, peer_id: str, block_size: int, batch_size: int, seed: int,
                 inner_steps: int) -> None:
        if block_size < 1 or batch_size < 1 or inner_steps < 1:
            raise ValueError(f"block_size, batch_size and inner_steps must be >= 1, got {block_size}, "
                             f"{batch_size} and {inner_steps}")
        n = data.numel()
        if n < block_size + 1:
            raise DataError(f"the training data has {n} tokens, fewer than one sequence of block_size+1 = "
                            f"{block_size + 1}; prepare more text or use a smaller block_size")
        self.data, self.n_tokens = data, n
        self.peer_id, self.seed = str(peer_id), seed
        self.block_size, self.batch_size, self.inner_steps = block_size, batch_size, inner_steps
        self.n_windows = (n - 1) // block_size  # window k: tokens [k*T, k*T + T + 1)
        self._epoch: tuple[int, KeyedPermutation] | None = None  # a cache, not state

    def window(self, read: int) -> int:
        """The window this unit reads as its `read`-th sequence (read = step * batch_size + row)."""
        epoch, i = divmod(read, self.n_windows)
        if self._epoch is None or self._epoch[0] != epoch:
            key = _hash_int("walk-epoch", self.seed, self.peer_id, epoch)
            self._epoch = (epoch, KeyedPermutation(self.n_windows, key))
        return self._epoch[1](i)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) LongTensors [batch_size, block_size] on CPU, a pure function of (seed, peer_id, step)."""
        first = step * self.batch_size
        starts = torch.tensor([self.window(first + j) * self.block_size for j in range(self.batch_size)])
        return _windows(self.data, starts, self.block_size)

    def position(self, step: int) -> dict:
        """The data position after `step` inner steps: the step; the rest names the stream it is a position in."""
        return {"step": int(step), "scheme": "permuted-windows", "peer_id": self.peer_id, "seed": self.seed,
                "block_size": self.block_size, "batch_size": self.batch_size, "n_tokens": self.n_tokens}

    def resume_step(self, position: dict) -> int:
        """The step to resume at from a checkpointed `position` (another stream still resumes at its step, and
        we say so: e.g. the unit was restarted with other options or data)."""
        return resume_step(position, self.position(0))


# ---- the embedded default: the standard library, tokenized -------------------------------------------

STDLIB_MAX_MB = 8.0
STDLIB_EVAL_FRACTION = 0.05


def stdlib_token_dataset(vocab_size: int = 4096, *, max_mb: float = STDLIB_MAX_MB,
                         cache_dir: str | os.PathLike | None = None) -> Path:
    """The corpus "stdlib-bpe": this Python's standard-library .py sources (corpus.py's file list and eval split)
    with a byte-level BPE tokenizer trained on them. Built once per machine into
    <cache>/tokens/stdlib-bpe<vocab>-py<major.minor>, atomically and under a file lock, then reused."""
    name = f"stdlib-bpe{vocab_size}-py{sys.version_info.major}.{sys.version_info.minor}"
    if max_mb != STDLIB_MAX_MB:
        name += f"-{max_mb:g}mb"
    parent = (Path(cache_dir).expanduser() if cache_dir is not None else cache_root()) / "tokens"
    final = parent / name
    if is_token_dataset(final):
        return final
    parent.mkdir(parents=True, exist_ok=True)
    with open(parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second peer on this machine waits here, then finds it built
        try:
            if is_token_dataset(final):
                return final
            if final.exists():  # not a dataset (an old, broken one): replace it
                shutil.rmtree(final)
            from p2p_diloco.train.data.tokens_prepare import prepare_stdlib

            prepare_stdlib(final, vocab_size=vocab_size, max_mb=max_mb, eval_fraction=STDLIB_EVAL_FRACTION)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return final
