"""Token datasets: prepare (text, JSON, JSONL, Parquet, a tokenizer folder), load (memory-mapped, checked), the
walk sampler's partition of the data between units, and the cached stdlib dataset."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from p2p_diloco.train.data.corpus import DataError, eval_batches
from p2p_diloco.train.data.tokens import (
    TOKENS_FORMAT,
    KeyedPermutation,
    WalkSampler,
    dataset_fingerprint,
    is_token_dataset,
    load_token_dataset,
    stdlib_token_dataset,
)
from p2p_diloco.train.data.tokens_prepare import prepare

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega def return class import self value data peer round").split()


def _text(seed: int, n_words: int = 300) -> str:
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(n_words // 12)) + "\n"


def _folder(root: Path, n_files: int = 12) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        (root / f"doc{i:02d}.txt").write_text(_text(i))
    (root / "sub").mkdir()
    (root / "sub" / "notes.md").write_text(_text(99))
    (root / ".git").mkdir()
    (root / ".git" / "HEAD.txt").write_text("not data\n")
    (root / "blob.txt").write_bytes(b"\0\1\2binary")
    return root


def _prepare(sources, out, **kw):
    args = {"tokenizer": None, "vocab_size": 300, "eval_fraction": 0.1, "max_mb": 100.0, **kw}
    return prepare([str(s) for s in sources], str(out), **args)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tokens")
    _prepare([_folder(root / "corpus")], root / "ds")
    return root / "ds"


def test_prepare_writes_a_loadable_token_dataset(prepared):
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["format"] == TOKENS_FORMAT and manifest["format_version"] == 1
    assert manifest["dtype"] == "uint16" and manifest["vocab_size"] == 300 and manifest["eos_id"] == 0
    assert len(manifest["fingerprint"]) == 16 and len(manifest["tokenizer_fingerprint"]) == 16
    assert manifest["train"]["documents"] + manifest["eval"]["documents"] == 13  # no hidden or binary file
    assert manifest["eval"]["documents"] >= 1 and manifest["train"]["documents"] >= 1
    assert is_token_dataset(str(prepared)) and not is_token_dataset(str(prepared / "tokenizer"))
    ds = load_token_dataset(str(prepared), block_size=16, verify=True)
    assert ds.fingerprint == manifest["fingerprint"] and ds.vocab_size == 300 and ds.eos_id == 0
    assert ds.train.numel() == manifest["train"]["tokens"] and ds.train.dtype == torch.uint16
    # memory-mapped, not read in: the tensor's storage is the file's pages
    assert isinstance(ds.train.numpy().base, np.memmap) or ds.train.numpy().base is not None
    assert int((ds.train == ds.eos_id).sum()) == manifest["train"]["documents"]  # one eos ends each document
    assert int(ds.train.numpy().max()) < ds.vocab_size  # (torch has few uint16 ops: indexing and .long() work)
    batches = eval_batches(ds, block_size=16, batch_size=4, num_batches=2)  # corpus.py's eval works unchanged
    assert batches[0][0].shape == (4, 16) and batches[0][0].dtype == torch.long
    assert "fingerprint=" in ds.describe() and "\n" not in ds.describe()

    from transformers import AutoTokenizer  # the tokenizer folder loads offline and decodes the tokens

    tok = AutoTokenizer.from_pretrained(str(ds.tokenizer_dir), local_files_only=True)
    assert len(tok) == ds.vocab_size and tok.eos_token_id == ds.eos_id and tok.pad_token_id == ds.eos_id
    first_doc = ds.train[: int((ds.train == 0).nonzero()[0])].tolist()
    assert tok.decode(first_doc) == _text(0)
    assert tok("alpha beta", add_special_tokens=False)["input_ids"] == \
        tok.backend_tokenizer.encode("alpha beta", add_special_tokens=False).ids


def test_prepare_is_deterministic_and_reuses_a_tokenizer_folder(prepared, tmp_path):
    again = _prepare([prepared.parent / "corpus"], tmp_path / "again")
    assert again["fingerprint"] == load_token_dataset(str(prepared)).fingerprint
    reused = _prepare([prepared.parent / "corpus"], tmp_path / "reused", tokenizer=str(prepared / "tokenizer"))
    assert reused["tokenizer_fingerprint"] == again["tokenizer_fingerprint"]
    assert reused["fingerprint"] == again["fingerprint"]  # same tokenizer and text: the same tokens


def test_records_json_jsonl_parquet(tmp_path):
    rows = [{"text": _text(i, 60), "id": i} for i in range(30)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:10]))
    (tmp_path / "b.json").write_text(json.dumps(rows[10:20]))
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": [r["text"] for r in rows[20:]]}), tmp_path / "c.parquet")
    m = _prepare([tmp_path / "a.jsonl", tmp_path / "b.json", tmp_path / "c.parquet"], tmp_path / "out")
    assert m["train"]["documents"] + m["eval"]["documents"] == 30
    with pytest.raises(DataError, match="no field 'body'.*--text-field"):
        _prepare([tmp_path / "a.jsonl"], tmp_path / "out2", text_field="body")
    with pytest.raises(DataError, match="no column 'body'"):
        _prepare([tmp_path / "c.parquet"], tmp_path / "out2", text_field="body")
    assert not (tmp_path / "out2").exists()


def test_hf_dataset_from_a_save_to_disk_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"content": [_text(i, 40) for i in range(20)]}).save_to_disk(str(tmp_path / "hf"))
    m = _prepare([], tmp_path / "out", hf_dataset=str(tmp_path / "hf"), text_field="content")
    assert m["train"]["documents"] + m["eval"]["documents"] == 20
    with pytest.raises(DataError, match="cannot load HF dataset 'no-such/dataset'.*local cache"):
        _prepare([], tmp_path / "out2", hf_dataset="no-such/dataset")


def test_one_file_and_max_mb(tmp_path):
    (tmp_path / "one.txt").write_text(_text(1, 3000))
    m = _prepare([tmp_path / "one.txt"], tmp_path / "out")
    assert m["eval"]["tokens"] > 0 and m["train"]["tokens"] > 5 * m["eval"]["tokens"]  # its tail is eval
    small = _prepare([tmp_path / "one.txt"], tmp_path / "small", max_mb=2000 / 2**20)
    assert small["train"]["tokens"] + small["eval"]["tokens"] < (m["train"]["tokens"] + m["eval"]["tokens"]) / 4


def test_load_refuses_missing_corrupt_truncated_or_too_small(prepared, tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_token_dataset(str(tmp_path / "nope"))
    broken = tmp_path / "broken"
    shutil.copytree(prepared, broken)
    n_eval = json.loads((prepared / "manifest.json").read_text())["eval"]["tokens"]
    with pytest.raises(DataError, match="too small: its eval split has"):
        load_token_dataset(str(broken), block_size=n_eval)
    with open(broken / "train.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(DataError, match="truncated"):
        load_token_dataset(str(broken))
    shutil.copy(prepared / "train.bin", broken / "train.bin")
    data = bytearray((broken / "train.bin").read_bytes())
    data[10] ^= 1
    (broken / "train.bin").write_bytes(bytes(data))
    load_token_dataset(str(broken))  # sizes match: only verify re-hashes
    with pytest.raises(DataError, match="does not match"):
        load_token_dataset(str(broken), verify=True)
    (broken / "manifest.json").write_text("{not json")
    assert not is_token_dataset(str(broken))
    with pytest.raises(DataError, match="manifest.json"):
        load_token_dataset(str(broken))


def test_uint32_tokens_load_and_index(prepared, tmp_path):
    folder = tmp_path / "u32"
    shutil.copytree(prepared / "tokenizer", folder / "tokenizer")
    ids = {"train": np.arange(1000, dtype="<u4") + 70000, "eval": np.arange(100, dtype="<u4") + 90000}
    manifest = json.loads((prepared / "manifest.json").read_text())
    manifest.update(dtype="uint32", vocab_size=100000)
    for split, arr in ids.items():
        arr.tofile(folder / f"{split}.bin")
        manifest[split] = {"tokens": len(arr), "files": [f"{split}.bin"], "documents": 1}
    manifest["fingerprint"] = dataset_fingerprint(folder, manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    ds = load_token_dataset(str(folder), block_size=8, verify=True)
    x, y = WalkSampler(ds.train, peer_id="p", block_size=8, batch_size=2, seed=0, inner_steps=3).batch(5)
    assert x.dtype == torch.long and int(x.min()) >= 70000 and torch.equal(x[:, 1:], y[:, :-1])


# ---- the walk sampler -----------------------------------------------------------------------------------

def _peer_ids(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["12D3KooW" + "".join(rng.choice("abcdefghijkmnopqrstuvwxyzABCDEFGHJKLMNPQRSTUVWXYZ123456789")
                                 for _ in range(44)) for _ in range(n)]


def test_walk_batches_are_a_pure_function_of_peer_and_step():
    data = torch.arange(50_000, dtype=torch.int32)
    make = lambda peer: WalkSampler(data, peer_id=peer, block_size=16, batch_size=4, seed=7, inner_steps=10)  # noqa: E731
    a, b, other = make("peerA"), make("peerA"), make("peerB")
    steps = [0, 1, 9, 10, 11, 57, 3, 0]  # out of order: a cache must not change anything
    for s in steps:
        xa, ya = a.batch(s)
        xb, yb = b.batch(s)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert xa.shape == (4, 16) and xa.dtype == torch.long and torch.equal(xa[:, 1:], ya[:, :-1])
    assert not torch.equal(a.batch(3)[0], other.batch(3)[0])
    # a restarted unit resumes at its step and reads what the original read from there on
    restarted = make("peerA")
    start = restarted.resume_step(json.loads(json.dumps(a.position(23))))
    assert start == 23
    for s in range(start, start + 15):
        assert torch.equal(restarted.batch(s)[0], a.batch(s)[0])


def test_keyed_permutation_is_a_bijection():
    for n in (1, 2, 3, 17, 1000, 4097):
        values = [KeyedPermutation(n, key=5)(i) for i in range(n)]
        assert sorted(values) == list(range(n))
    a, b = KeyedPermutation(1000, key=1), KeyedPermutation(1000, key=2)
    assert [a(i) for i in range(50)] != [b(i) for i in range(50)]
    assert [a(i) for i in range(50)] != list(range(50))


def test_a_unit_reads_every_window_once_per_epoch_and_each_batch_is_spread(caplog):
    T, B = 8, 4
    data = torch.arange(200 * T + 1, dtype=torch.int32)  # token value == its index: 200 windows
    s = WalkSampler(data, peer_id="u", block_size=T, batch_size=B, seed=1, inner_steps=3)
    assert s.n_windows == 200
    for epoch in range(2):  # 50 steps of 4 rows = one epoch
        starts = torch.cat([s.batch(step)[0][:, 0] for step in range(50 * epoch, 50 * epoch + 50)])
        assert sorted(starts.tolist()) == list(range(0, 200 * T, T))  # every window once
    first_phase = torch.cat([s.batch(step)[0][:, 0] for step in range(3)])  # one inner phase
    assert int(first_phase.max() - first_phase.min()) > 100 * T  # spread over the data, not one chunk of it
    epoch0 = [s.window(i) for i in range(200)]
    assert epoch0 != [s.window(i) for i in range(200, 400)]  # a new order each epoch
    with caplog.at_level(logging.WARNING):
        other = WalkSampler(data, peer_id="u", block_size=T, batch_size=2, seed=1, inner_steps=3)
        assert other.resume_step(s.position(4)) == 4
    assert "data stream changed" in caplog.text


def test_units_overlap_as_independent_shuffles_and_no_pair_is_stuck_as_with_mod16():
    """The share of a unit's first k reads that another unit also read, for N units, against the byte path's
    sha256(PeerID) mod 16 shards (units on one shard read the same bytes for the whole run): the walk is an
    independent shuffle per unit, 1 - (1 - k/n)^(N-1) for every unit; mod 16 is all or nothing per unit, and a
    unit that shares its shard duplicates every read it ever makes."""
    n = 4096
    data = torch.zeros(n * 8 + 1, dtype=torch.int32)
    for n_peers in (4, 16):
        for k in (n // n_peers ** 2, n // (2 * n_peers)):
            walk, mod16 = [], []
            for trial in range(10):
                peers = _peer_ids(n_peers, seed=1000 * n_peers + trial)
                samplers = [WalkSampler(data, peer_id=p, block_size=8, batch_size=1, seed=trial, inner_steps=1)
                            for p in peers]
                reads = [{s.window(i) for i in range(k)} for s in samplers]
                walk += [len(r & set().union(*(o for o in reads if o is not r))) / k for r in reads]
                shards = [int.from_bytes(hashlib.sha256(p.encode()).digest()[:8], "big") % 16 for p in peers]
                mod16 += [float(shards.count(c) > 1) for c in shards]
            w, m = np.mean(walk), np.mean(mod16)
            expected = 1 - (1 - k / n) ** (n_peers - 1)
            print(f"\npeers={n_peers} k={k} (n={n}): share of reads another unit also read: walk {w:.3f} "
                  f"(expected {expected:.3f}, worst unit {max(walk):.2f}), mod16 {m:.3f} (worst unit {max(mod16):.0f})")
            assert w == pytest.approx(expected, abs=0.03)
            assert max(walk) < expected + 0.2 and max(mod16) == 1.0  # nobody reads only what another read


# ---- the embedded default ---------------------------------------------------------------------------------

def test_stdlib_token_dataset_is_built_once_deterministically(tmp_path):
    built: list[Path] = []

    def build(cache):
        built.append(stdlib_token_dataset(300, max_mb=0.25, cache_dir=cache))

    threads = [threading.Thread(target=build, args=(tmp_path / "a",)) for _ in range(2)]  # two peers at once
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert built[0] == built[1] and built[0].name.startswith("stdlib-bpe300-py")
    assert [p.name for p in (tmp_path / "a" / "tokens").iterdir() if not p.name.endswith(".lock")] == \
        [built[0].name]  # no temp folder left behind
    mtime = (built[0] / "manifest.json").stat().st_mtime_ns
    assert stdlib_token_dataset(300, max_mb=0.25, cache_dir=tmp_path / "a") == built[0]
    assert (built[0] / "manifest.json").stat().st_mtime_ns == mtime  # cached: not rebuilt
    other = stdlib_token_dataset(300, max_mb=0.25, cache_dir=tmp_path / "b")
    a, b = load_token_dataset(str(built[0]), block_size=32), load_token_dataset(str(other), block_size=32)
    assert a.fingerprint == b.fingerprint and a.source == "stdlib-bpe"
    assert a.eval.numel() > 100


def test_a_token_folder_is_named_by_its_fingerprint_and_a_broken_one_is_an_error(prepared, tmp_path):
    from p2p_diloco.config import ConfigError, DataConfig, ModelConfig, RunSpec
    from p2p_diloco.train.data.resolve import load_training_data, resolve_spec

    moved = tmp_path / "elsewhere"
    shutil.copytree(prepared, moved)
    specs = [resolve_spec(RunSpec(model=ModelConfig(arch="llama", n_layer=1, n_head=2, n_embd=32, block_size=8),
                                  data=DataConfig(corpus=str(folder)))) for folder in (prepared, moved)]
    assert specs[0].spec_hash() == specs[1].spec_hash()  # two machines, two paths, one run
    assert specs[0].data.corpus.startswith("tokens:") and str(prepared) not in json.dumps(specs[0].to_dict())
    assert load_training_data(specs[0].data, block_size=8).fingerprint == specs[0].data.fingerprint
    broken = tmp_path / "broken"
    shutil.copytree(prepared, broken)
    (broken / "manifest.json").unlink()
    with pytest.raises(ConfigError):  # never read as a folder of text files
        resolve_spec(RunSpec(model=ModelConfig(arch="llama"), data=DataConfig(corpus=str(broken))))
