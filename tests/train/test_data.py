"""The corpus, its train/eval split, the per-peer shards and the fixed eval set."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch

from p2p_diloco.config import DataConfig, preset
from p2p_diloco.train.data.corpus import Corpus, DataError, ShardSampler, eval_batches, evaluate, load_corpus
from p2p_diloco.train.models.build import build_model

SPEC = preset("test")
BLOCK = SPEC.model.block_size


@pytest.fixture(scope="module")
def stdlib() -> Corpus:
    return load_corpus(SPEC.data, block_size=BLOCK)


def _sampler(data: torch.Tensor, **overrides: int) -> ShardSampler:
    kwargs = dict(shard=0, num_shards=1, block_size=16, batch_size=4, seed=0) | overrides
    return ShardSampler(data, **kwargs)


# ---- the stdlib corpus -----------------------------------------------------------------------------------

def test_stdlib_corpus_loads_with_disjoint_file_split(stdlib: Corpus) -> None:
    assert stdlib.train.dtype == torch.uint8 and stdlib.eval.dtype == torch.uint8
    assert stdlib.train.numel() > 100_000 and stdlib.eval.numel() > BLOCK
    assert stdlib.train.numel() + stdlib.eval.numel() <= SPEC.data.max_corpus_mb * 2**20 + 2 * 1000  # + separators
    assert stdlib.eval_files and not set(stdlib.train_files) & set(stdlib.eval_files)
    assert all(f.endswith(".py") and not f.startswith(("site-packages/", "test/", "idlelib/"))
               for f in stdlib.train_files + stdlib.eval_files)
    assert len(stdlib.fingerprint) == 16
    assert "files=" in stdlib.describe() and "train_mb=" in stdlib.describe()


def test_stdlib_corpus_is_cached_per_process(stdlib: Corpus) -> None:
    # A different batch_size reads the same bytes, so it shares the cached corpus.
    again = load_corpus(DataConfig(batch_size=3, max_corpus_mb=SPEC.data.max_corpus_mb))
    assert again is stdlib


def test_eval_files_follow_the_path_hash(stdlib: Corpus) -> None:
    # Files whose hash says "eval" are never trained on, whatever machine computes the split.
    threshold = SPEC.data.eval_fraction * 1000
    for rel in stdlib.train_files:
        assert int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big") % 1000 >= threshold


# ---- shards and batches ------------------------------------------------------------------------------------

def test_shards_are_disjoint_and_cover_the_data() -> None:
    data = torch.arange(1001)  # positions as values, so a window shows where it came from
    samplers = [_sampler(data, shard=k, num_shards=3) for k in range(3)]
    assert [s.start for s in samplers] == [0, *(s.stop for s in samplers[:-1])]
    assert samplers[-1].stop == data.numel()
    for s in samplers:
        for step in range(5):
            x, y = s.batch(step)
            assert x.min() >= s.start and y.max() < s.stop


def test_batch_shape_and_targets_are_shifted_inputs(stdlib: Corpus) -> None:
    x, y = _sampler(stdlib.train, block_size=BLOCK, batch_size=8).batch(0)
    assert x.shape == y.shape == (8, BLOCK) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    x, y = _sampler(torch.arange(500)).batch(3)
    assert torch.equal(y, x + 1)


def test_batch_is_a_function_of_seed_shard_and_step(stdlib: Corpus) -> None:
    def batch(seed: int = 0, shard: int = 0, step: int = 0) -> torch.Tensor:
        return _sampler(stdlib.train, seed=seed, shard=shard, num_shards=4).batch(step)[0]

    # A fresh sampler (a restarted peer) resumes the same stream from its step counter alone.
    assert torch.equal(batch(step=5), batch(step=5))
    assert not torch.equal(batch(step=5), batch(step=6))
    assert not torch.equal(batch(shard=0), batch(shard=1))
    assert not torch.equal(batch(seed=0), batch(seed=1))


def test_shard_arguments_are_checked() -> None:
    data = torch.zeros(1000, dtype=torch.uint8)
    with pytest.raises(ValueError, match="num_shards"):
        _sampler(data, num_shards=0)
    with pytest.raises(ValueError, match="shard must be in"):
        _sampler(data, shard=3, num_shards=3)
    with pytest.raises(DataError, match="fewer shards"):
        _sampler(data, num_shards=100, block_size=16)


def test_eval_batches_are_fixed_and_evaluate_restores_mode(stdlib: Corpus) -> None:
    a = eval_batches(stdlib, block_size=BLOCK, batch_size=4, num_batches=3)
    b = eval_batches(stdlib, block_size=BLOCK, batch_size=4, num_batches=3)
    assert len(a) == 3
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b, strict=True))
    assert a[0][0].shape == (4, BLOCK)
    model = build_model(SPEC.model, seed=0)
    model.train()
    loss = evaluate(model, a)
    assert model.training
    assert abs(loss - math.log(256)) < 0.1
    model.eval()
    evaluate(model, a)
    assert not model.training


# ---- user corpora and errors ---------------------------------------------------------------------------------

def _write(root: Path, rel: str, data: bytes) -> None:
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_bytes(data)


def test_folder_corpus_reads_text_and_skips_binaries(tmp_path: Path) -> None:
    for i in range(6):
        _write(tmp_path, f"doc{i}.txt", f"document {i} ".encode() * 200)
    _write(tmp_path, "sub/notes.md", b"# notes\n" * 100)
    _write(tmp_path, "sub/README", b"no suffix is text too\n" * 50)
    _write(tmp_path, "sub/blob.txt", b"looks like text\0but is not" * 10)
    _write(tmp_path, "image.png", b"\x89PNG not in the suffix list")
    _write(tmp_path, ".git/HEAD", b"ref: refs/heads/main\n")
    corpus = load_corpus(DataConfig(corpus=str(tmp_path), eval_fraction=0.2), block_size=32)
    files = set(corpus.train_files) | set(corpus.eval_files)
    assert files == {f"doc{i}.txt" for i in range(6)} | {"sub/notes.md", "sub/README"}
    assert corpus.eval_files and corpus.train_files and not set(corpus.train_files) & set(corpus.eval_files)
    everything = bytes(corpus.train.tolist()) + bytes(corpus.eval.tolist())
    assert b"\0" not in everything and b"document 3" in everything
    # The same folder gives the same corpus: peers can compare fingerprints.
    assert load_corpus(DataConfig(corpus=str(tmp_path), eval_fraction=0.2)).fingerprint == corpus.fingerprint


def test_folder_corpus_respects_max_corpus_mb(tmp_path: Path) -> None:
    for i in range(4):
        _write(tmp_path, f"f{i}.txt", b"x" * 1000)
    corpus = load_corpus(DataConfig(corpus=str(tmp_path), max_corpus_mb=2500 / 2**20))
    assert corpus.train.numel() + corpus.eval.numel() <= 2500 + 2 * 2  # + separators


def test_single_file_corpus_holds_out_its_tail(tmp_path: Path) -> None:
    text = bytes(range(32, 127)) * 100
    _write(tmp_path, "book.txt", text)
    corpus = load_corpus(DataConfig(corpus=str(tmp_path / "book.txt"), eval_fraction=0.1))
    cut = len(text) - len(text) // 10
    assert bytes(corpus.train.tolist()) == text[:cut] and bytes(corpus.eval.tolist()) == text[cut:]


def test_missing_path_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(DataError, match="does not exist") as err:
        load_corpus(DataConfig(corpus=str(missing)))
    assert str(missing) in str(err.value)


def test_folder_without_text_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no readable, non-empty text files"):
        load_corpus(DataConfig(corpus=str(tmp_path)))
    _write(tmp_path, "a.bin.txt", b"\0\1\2")
    with pytest.raises(DataError, match="no readable, non-empty text files"):
        load_corpus(DataConfig(corpus=str(tmp_path)))


def test_binary_single_file_is_rejected(tmp_path: Path) -> None:
    _write(tmp_path, "x.txt", b"abc\0def" * 10)
    with pytest.raises(DataError, match="not text"):
        load_corpus(DataConfig(corpus=str(tmp_path / "x.txt")))


def test_too_small_corpus(tmp_path: Path) -> None:
    _write(tmp_path, "tiny.txt", b"hello world, too short for a window\n")
    cfg = DataConfig(corpus=str(tmp_path / "tiny.txt"))
    with pytest.raises(DataError, match="too small.*block_size"):
        load_corpus(cfg, block_size=BLOCK)
    corpus = load_corpus(DataConfig(corpus=str(tmp_path / "tiny.txt"), eval_fraction=0.3))  # no block_size: loads
    with pytest.raises(DataError, match="block_size"):
        _sampler(corpus.train, block_size=BLOCK)
    with pytest.raises(DataError, match="eval split"):
        eval_batches(corpus, block_size=BLOCK, batch_size=2, num_batches=1)


def test_peers_on_one_shard_draw_other_batches_when_salted_by_their_ids() -> None:
    """Two peers whose ids hash to one shard must not train on the same batches (from one theta they would
    publish one update, which vetting takes for a copy); an empty stream keeps the simulator's batches."""
    data = torch.arange(10_000, dtype=torch.int64).to(torch.uint8)
    make = lambda stream: ShardSampler(data, shard=1, num_shards=4, block_size=16, batch_size=4, seed=0,  # noqa: E731
                                       stream=stream)
    a, b, plain = make("peer-a"), make("peer-b"), make("")
    assert not torch.equal(a.batch(3)[0], b.batch(3)[0])
    assert torch.equal(a.batch(3)[0], make("peer-a").batch(3)[0])  # still a pure function of the step
    assert torch.equal(plain.batch(3)[0], ShardSampler(data, shard=1, num_shards=4, block_size=16, batch_size=4,
                                                       seed=0).batch(3)[0])
    assert a.position(0)["stream"] == "peer-a" and "stream" not in plain.position(0)
