"""The training text: a corpus that needs no network, deterministic per-peer shards, a held-out split.

Every peer of a run loads the same corpus (the `fingerprint` lets them check) and takes shard k of N, a
contiguous, disjoint slice of the training bytes. `ShardSampler.batch(step)` depends only on
(seed, shard, stream, step), so a peer's position in its data is its step counter: restoring a checkpoint restores
the data stream with no sampler state to save. The eval split is chosen per file by a hash of the file's
relative path, so it is the same on every machine and no training file leaks into eval.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from p2p_diloco.config import ConfigError, DataConfig

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = frozenset({".txt", ".md", ".py", ".rst", ".json", ".csv", ""})
STDLIB_SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "__pycache__"})
FILE_SEPARATOR = b"\n\n"
BINARY_SNIFF_BYTES = 8192
BYTES_PER_MB = 1 << 20


class DataError(ConfigError):
    """A problem with the corpus a person can fix; the message says what and where."""


@dataclass(frozen=True, eq=False)  # eq=False: identity comparison; comparing tensors field-wise is ambiguous
class Corpus:
    """Train and eval bytes (uint8 tensors). Shared between peers of one process: treat as read-only."""

    train: torch.Tensor
    eval: torch.Tensor
    fingerprint: str
    """First 16 hex chars of sha256 over train and eval: equal fingerprints mean the same corpus."""
    source: str
    train_files: tuple[str, ...]
    eval_files: tuple[str, ...]
    """Relative paths; for a single-file corpus both hold that one file (split by bytes)."""

    def describe(self) -> str:
        n_files = len(set(self.train_files) | set(self.eval_files))
        return (f"corpus={self.source} files={n_files} (train={len(self.train_files)} eval={len(self.eval_files)}) "
                f"train_mb={self.train.numel() / BYTES_PER_MB:.2f} eval_mb={self.eval.numel() / BYTES_PER_MB:.2f} "
                f"fingerprint={self.fingerprint}")


# ---- loading ------------------------------------------------------------------------------------------

def load_corpus(cfg: DataConfig, *, block_size: int | None = None) -> Corpus:
    """Load `cfg.corpus` ('stdlib', a text file or a folder), split into train and eval.

    Given `block_size`, also check that train and eval each hold at least one window of block_size+1 bytes,
    so a too-small corpus fails here rather than at the first batch.
    """
    if cfg.corpus == "stdlib":
        corpus = _load_stdlib(cfg.max_corpus_mb, cfg.eval_fraction)
    else:
        corpus = _load_path(Path(cfg.corpus), cfg.max_corpus_mb, cfg.eval_fraction)
    # Without a block_size, still insist on one (input, target) pair per split.
    needed = (block_size or 1) + 1
    for name, part in (("train", corpus.train), ("eval", corpus.eval)):
        if part.numel() < needed:
            raise DataError(
                f"corpus {corpus.source!r} is too small: its {name} split has {part.numel()} bytes but one "
                f"sequence needs block_size+1 = {needed}; use a larger corpus or a smaller block_size"
            )
    return corpus


def stdlib_files() -> tuple[Path, list[str]]:
    """The standard library's .py sources, as (root, sorted relative paths): the same files in the same order on
    every machine with this Python version (the "stdlib" corpus, and the files of "stdlib-bpe")."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_SKIP_DIRS]
        paths += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return root, sorted(p.relative_to(root).as_posix() for p in paths)


@functools.lru_cache(maxsize=4)
def _load_stdlib(max_corpus_mb: float, eval_fraction: float) -> Corpus:
    # Cached per process: the simulator builds many peers from one corpus. Keyed by the fields that
    # decide the bytes (not the whole DataConfig) so that e.g. a different batch_size still hits.
    root, rel_paths = stdlib_files()
    files = _read_files(root, rel_paths, max_corpus_mb)
    if not files:
        raise DataError(f"found no .py files in the Python standard library at {root}")
    return _split(files, eval_fraction, source="stdlib")


def _load_path(path: Path, max_corpus_mb: float, eval_fraction: float) -> Corpus:
    if not path.exists():
        raise DataError(f"corpus path {str(path)!r} does not exist; pass 'stdlib' or a text file or folder")
    if path.is_file():
        files = _read_files(path.parent, [path.name], max_corpus_mb)
        if not files:
            raise DataError(f"corpus file {str(path)!r} is empty, unreadable or not text (NUL bytes in its first 8 KB)")
        return _split(files, eval_fraction, source=str(path))
    rel_paths = sorted(
        p.relative_to(path).as_posix() for p in path.rglob("*")
        if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES
        # Hidden files and folders (.git, .venv) are tooling, not text to learn from.
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    files = _read_files(path, rel_paths, max_corpus_mb)
    if not files:
        raise DataError(
            f"corpus folder {str(path)!r} has no readable, non-empty text files (looked for suffixes "
            f"{', '.join(sorted(s for s in TEXT_SUFFIXES if s))} or none; binaries and hidden paths are skipped)"
        )
    return _split(files, eval_fraction, source=str(path))


def _read_files(root: Path, rel_paths: list[str], max_corpus_mb: float) -> list[tuple[str, bytes]]:
    """(relative path, bytes) in order, skipping binaries, stopping at max_corpus_mb (the last file is cut)."""
    budget = int(max_corpus_mb * BYTES_PER_MB)
    out: list[tuple[str, bytes]] = []
    for rel in rel_paths:
        if budget <= 0:
            break
        try:
            data = (root / rel).read_bytes()
        except OSError as e:
            logger.warning("skipping unreadable corpus file path=%s error=%s", root / rel, e)
            continue
        if b"\0" in data[:BINARY_SNIFF_BYTES]:
            logger.info("skipping binary corpus file path=%s", root / rel)
            continue
        if data:
            out.append((rel, data[:budget]))
            budget -= len(out[-1][1])
    return out


def _split(files: list[tuple[str, bytes]], eval_fraction: float, *, source: str) -> Corpus:
    if len(files) == 1:
        # One file: hold out its tail, so train and eval are still disjoint text.
        rel, data = files[0]
        cut = len(data) - max(1, int(len(data) * eval_fraction))
        return _make_corpus([data[:cut]], [data[cut:]], source, (rel,), (rel,))
    eval_idx = _choose_eval_files(files, eval_fraction)
    train = [(r, d) for i, (r, d) in enumerate(files) if i not in eval_idx]
    held = [(r, d) for i, (r, d) in enumerate(files) if i in eval_idx]
    return _make_corpus([d for _, d in train], [d for _, d in held], source,
                        tuple(r for r, _ in train), tuple(r for r, _ in held))


def _choose_eval_files(files: list[tuple[str, bytes]], eval_fraction: float) -> set[int]:
    """Indices of the eval files: sha256(relative path) mod 1000 < eval_fraction*1000, topped up.

    The hash makes a file's side independent of which other files exist and of the machine. A small
    folder may hash too few bytes into eval, so we then add files from the end until eval holds at least
    half the requested fraction, always leaving at least one training file.
    """
    threshold = eval_fraction * 1000
    chosen = {i for i, (rel, _) in enumerate(files)
              if int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big") % 1000 < threshold}
    total = sum(len(d) for _, d in files)
    wanted = eval_fraction * total / 2
    for i in reversed(range(len(files))):
        eval_bytes = sum(len(files[j][1]) for j in chosen)
        if (chosen and eval_bytes >= wanted) or len(chosen) >= len(files) - 1:
            break
        chosen.add(i)
    if len(chosen) == len(files):  # every path hashed into eval (tiny folder): keep the first for training
        chosen.discard(0)
    return chosen


def _make_corpus(train: list[bytes], held: list[bytes], source: str,
                 train_files: tuple[str, ...], eval_files: tuple[str, ...]) -> Corpus:
    train_bytes, eval_bytes = FILE_SEPARATOR.join(train), FILE_SEPARATOR.join(held)
    h = hashlib.sha256(len(train_bytes).to_bytes(8, "big"))  # the length keeps the train/eval boundary in the hash
    h.update(train_bytes)
    h.update(eval_bytes)
    corpus = Corpus(train=_to_tensor(train_bytes), eval=_to_tensor(eval_bytes), fingerprint=h.hexdigest()[:16],
                    source=source, train_files=train_files, eval_files=eval_files)
    logger.info("loaded corpus %s", corpus.describe())
    return corpus


def _to_tensor(data: bytes) -> torch.Tensor:
    # bytearray gives frombuffer a writable buffer it can own (no warning, no aliasing of `data`).
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


# ---- sampling -----------------------------------------------------------------------------------------

def _seed_from(*parts: int | str) -> int:
    # A hash, not seed + step: nearby (seed, shard, step) triples must give unrelated streams.
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


def _windows(data: torch.Tensor, starts: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = data[starts[:, None] + torch.arange(block_size + 1)].long()  # [B, T+1]
    return rows[:, :-1], rows[:, 1:]  # y is x shifted by one byte: predict the next byte


class ShardSampler:
    """Random windows from shard `shard` of `num_shards` contiguous, disjoint slices of `data`."""

    def __init__(self, data: torch.Tensor, *, shard: int, num_shards: int, block_size: int, batch_size: int,
                 seed: int, stream: str = "") -> None:
        """`stream`: salts the batches. A real peer passes its PeerID: two peers that drew one shard (a 1 in
        `num_shards` chance per pair) would otherwise train on the same batches and, from one theta, publish
        the same update, which vetting takes for a copy (sync/copies.py). The simulator leaves it empty, so its
        runs repeat exactly whatever its random identities."""
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard must be in [0, {num_shards}), got {shard}")
        if block_size < 1 or batch_size < 1:
            raise ValueError(f"block_size and batch_size must be >= 1, got {block_size} and {batch_size}")
        n = data.numel()
        # Integer bounds k*n//N: the shards tile [0, n) exactly, with sizes differing by at most one byte.
        self.start, self.stop = shard * n // num_shards, (shard + 1) * n // num_shards
        self.data = data[self.start:self.stop]
        if self.data.numel() < block_size + 1:
            raise DataError(
                f"shard {shard} of {num_shards} has {self.data.numel()} bytes of the corpus's {n}, fewer than one "
                f"sequence of block_size+1 = {block_size + 1}; use fewer shards (peers), a larger corpus "
                f"(data.max_corpus_mb) or a smaller block_size"
            )
        self.shard, self.num_shards = shard, num_shards
        self.block_size, self.batch_size, self.seed, self.stream = block_size, batch_size, seed, stream

    def position(self, step: int) -> dict[str, int | str]:
        """The data position after `step` inner steps, for a checkpoint: the step is the whole position (batches
        are a pure function of it), the rest says which stream it is a position in."""
        return {"step": int(step), "shard": self.shard, "num_shards": self.num_shards, "seed": self.seed,
                "block_size": self.block_size, "batch_size": self.batch_size, "shard_bytes": self.data.numel(),
                **({"stream": self.stream} if self.stream else {})}

    def resume_step(self, position: dict) -> int:
        """The step to resume at from a checkpointed `position`. A position in another stream (another shard,
        corpus size or batch shape: e.g. the peer was restarted with other options) still resumes at its step,
        so the schedule's clock goes on; the batches then come from the new stream, and we say so."""
        return resume_step(position, self.position(0))

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) LongTensors [batch_size, block_size] on CPU, a pure function of (seed, shard, stream, step)."""
        parts = (self.seed, self.shard, self.stream, step) if self.stream else (self.seed, self.shard, step)
        g = torch.Generator().manual_seed(_seed_from(*parts))
        starts = torch.randint(self.data.numel() - self.block_size, (self.batch_size,), generator=g)
        return _windows(self.data, starts, self.block_size)


def resume_step(position: dict, now: dict) -> int:
    """The step a checkpointed data `position` resumes at; a warning names what differs from the stream `now`
    (a sampler's `position(0)`). Shared by every sampler: a position is a step in a named stream."""
    changed = {k: (position.get(k), v) for k, v in now.items() if k != "step" and position.get(k) != v}
    if changed:
        logger.warning("data stream changed since the checkpoint (checkpoint, now): %s", changed)
    step = position.get("step")
    if type(step) is not int or step < 0:
        raise ValueError(f"bad data position step {step!r}")
    return step


def eval_batches(corpus: Corpus, *, block_size: int, batch_size: int, num_batches: int,
                 seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed list of eval windows: the same for every peer that has the same corpus."""
    n = corpus.eval.numel()
    if n < block_size + 1:
        raise DataError(f"the eval split of corpus {corpus.source!r} has {n} bytes, fewer than one sequence of "
                        f"block_size+1 = {block_size + 1}; use a larger corpus or a larger data.eval_fraction")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(n - block_size, (num_batches, batch_size), generator=g)
    return [_windows(corpus.eval, s, block_size) for s in starts]


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean loss of `model` over `batches`, in eval mode (no dropout); the model's mode is restored."""
    if not batches:
        raise ValueError("evaluate needs at least one batch")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():  # no graph: an evaluation holds no activations for a backward that never comes
            losses = [model(x.to(device), y.to(device))[1].item() for x, y in batches]
    finally:
        model.train(was_training)
    return sum(losses) / len(losses)
