"""Writing token datasets (the format is in train/data/tokens.py): read documents, train or load a tokenizer,
tokenize.

The inputs and the eval split by document are train/data/tokens_sources.py's. If a split ends up empty (one
document, a tiny folder), the tokens' tail (or head) is moved across. Documents end with the eos token.

Memory stays bounded: documents stream through, long files in line-aligned pieces, tokenized in batches
and appended to the split files. Everything is built in a hidden temporary folder beside `out` and renamed
into place at the end, so a failure leaves no half-written dataset.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from p2p_diloco import __version__
from p2p_diloco.train.data.corpus import BYTES_PER_MB, DataError
from p2p_diloco.train.data.tokens_format import (
    DTYPES,
    FORMAT_VERSION,
    MANIFEST_NAME,
    SPLITS,
    TOKENIZER_DIR,
    TOKENS_FORMAT,
    dataset_fingerprint,
    token_dtype,
    tokenizer_fingerprint,
)
from p2p_diloco.train.data.tokens_sources import STDLIB_SOURCE, Inputs, Piece

EOS_TOKEN = "<|endoftext|>"
BATCH_BYTES = 4 << 20  # text per tokenizer batch call
MIN_VOCAB = 257
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json")  # 256 bytes + end-of-text

Progress = Callable[[str, int, int], None]  # (stage, done bytes, total bytes)


# ---- the tokenizer -----------------------------------------------------------------------------------

def _train_tokenizer(texts: Iterator[str], vocab_size: int, folder: Path) -> None:
    """A byte-level BPE (GPT-2 style) with one special token, <|endoftext|>, serving as eos/bos/unk/pad.

    Written with `tokenizers` alone, as PreTrainedTokenizerFast.save_pretrained would write it (transformers
    takes seconds to import and is not needed to train): AutoTokenizer loads the folder.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 60, "bos_token": EOS_TOKEN,
              "eos_token": EOS_TOKEN, "unk_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "clean_up_tokenization_spaces":
              False, "added_tokens_decoder": {"0": {"content": EOS_TOKEN, "special": True, "lstrip": False,
                                                    "rstrip": False, "normalized": False, "single_word": False}}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {k: EOS_TOKEN for k in ("bos_token", "eos_token", "unk_token", "pad_token")}, indent=1) + "\n")


def _copy_tokenizer(source: str, folder: Path) -> None:
    from transformers import AutoTokenizer

    path = Path(source).expanduser()
    fix = "pass a folder written by save_pretrained (with tokenizer.json), or --vocab-size N to train one"
    if not path.is_dir():
        raise DataError(f"--tokenizer {source!r} is not a folder; {fix}")
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 (transformers raises OSError, ValueError, KeyError, ... here)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DataError(f"--tokenizer {source!r} is not a tokenizer ({type(e).__name__}: {first[:200]}); "
                        f"{fix}") from None
    if not getattr(tok, "is_fast", False):
        raise DataError(f"--tokenizer {source!r} has no fast (tokenizers) version; {fix}")
    if tok.eos_token is not None and (path / "tokenizer.json").is_file():
        # Copied as they are, so the tokenizer fingerprint is that of the user's tokenizer.json (only the
        # tokenizer's files: the folder may also hold a model's weights).
        folder.mkdir(parents=True)
        for name in TOKENIZER_FILES:
            if (path / name).is_file():
                shutil.copyfile(path / name, folder / name)
        return
    if tok.eos_token is None:  # documents need a separator: reuse sep, or add <|endoftext|>
        tok.add_special_tokens({"eos_token": tok.sep_token or EOS_TOKEN})
    tok.save_pretrained(str(folder))
    if not (folder / "tokenizer.json").is_file():
        raise DataError(f"--tokenizer {source!r} did not save a tokenizer.json; {fix}")


def _saved_tokenizer(folder: Path):
    """(tokenizers.Tokenizer, len(tokenizer) with the added tokens, eos id) of a saved tokenizer folder."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = None
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if eos is None and (folder / name).is_file():
            eos = json.loads((folder / name).read_text()).get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    eos_id = backend.token_to_id(eos) if isinstance(eos, str) else None
    if eos_id is None:
        raise DataError(f"the tokenizer in {folder} has no eos token in its vocabulary; pass a tokenizer with "
                        f"one, or --vocab-size N to train one")
    # len(tokenizer), and past any id gap, so that every id is < vocab_size
    vocab = max(backend.get_vocab_size(with_added_tokens=True), max(backend.get_vocab(True).values()) + 1)
    return backend, vocab, eos_id


# ---- writing -----------------------------------------------------------------------------------------

def prepare(sources: list[str], out: str, *, tokenizer: str | None, vocab_size: int, eval_fraction: float,
            max_mb: float, text_field: str = "text", hf_dataset: str | None = None, split: str = "train",
            progress: Progress | None = None, force: bool = False, source_name: str | None = None,
            tokenizer_sample_mb: float = 256.0) -> dict:
    """Tokenize `sources` into a token dataset at `out`; returns its manifest. `tokenizer`: a local tokenizer
    folder, or None to train a byte-level BPE of `vocab_size` on the training documents."""
    final = Path(out).expanduser()
    if final.exists() and not (final.is_dir() and not any(final.iterdir())) and not force:
        raise DataError(f"--out {out} already exists and is not empty; pass --force to replace it or choose "
                        f"another --out")
    if tokenizer is None and not MIN_VOCAB <= vocab_size <= 1 << 31:
        raise DataError(f"--vocab-size must be at least {MIN_VOCAB} (256 bytes + end-of-text), got {vocab_size}")
    if not 0.0 < eval_fraction < 0.5:
        raise DataError(f"--eval-fraction must be in (0, 0.5), got {eval_fraction}")
    if max_mb <= 0:
        raise DataError(f"--max-mb must be > 0, got {max_mb}")
    inputs = Inputs(sources, eval_fraction=eval_fraction, max_mb=max_mb, text_field=text_field,
                     hf_dataset=hf_dataset, split=split)
    empty = f"no text found in {', '.join(sources) or hf_dataset} (empty files, empty records or binaries only)"
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the dataset is an ordinary folder
    try:
        report = _stage(progress, "tokenizer", inputs.total)
        if tokenizer is None:
            # On every document, eval included: a tiny input may have all its text in eval; merges learnt
            # from the held-out text leak nothing that matters to the loss.
            # On at most tokenizer_sample_mb of text: every k-th piece, spread over the whole input.
            k = max(1, -(-inputs.total // int(tokenizer_sample_mb * BYTES_PER_MB)))
            seen = [0]
            sample = (text for i, (_, text, _) in enumerate(_counted(inputs.pieces(), report, seen)) if i % k == 0)
            _train_tokenizer(sample, vocab_size, tmp / TOKENIZER_DIR)
            if not seen[0]:
                raise DataError(empty)
        else:
            _copy_tokenizer(tokenizer, tmp / TOKENIZER_DIR)
        backend, vocab, eos_id = _saved_tokenizer(tmp / TOKENIZER_DIR)
        dtype = token_dtype(vocab)
        counts, docs = _tokenize(inputs.pieces(), backend, eos_id, DTYPES[dtype], tmp,
                                 _stage(progress, "tokenize", inputs.total))
        if sum(counts.values()) == 0:
            raise DataError(empty)
        counts = _rebalance(tmp, counts, eval_fraction, DTYPES[dtype])
        manifest = {
            "format": TOKENS_FORMAT, "format_version": FORMAT_VERSION, "fingerprint": "",
            "tokenizer_fingerprint": tokenizer_fingerprint(tmp / TOKENIZER_DIR), "vocab_size": vocab,
            "dtype": dtype, "eos_id": eos_id,
            **{s: {"tokens": counts[s], "files": [f"{s}.bin"], "documents": docs[s]} for s in SPLITS},
            "source": source_name or ",".join([*sources, *([f"hf:{hf_dataset}/{split}"] if hf_dataset else [])]),
            "sources": [*sources, *([f"hf:{hf_dataset}/{split}"] if hf_dataset else [])],
            "tokenizer": {"from": str(tokenizer)} if tokenizer else {
                "trained": "byte-level BPE", "vocab_size": vocab_size, "sample_mb": tokenizer_sample_mb},
            "eval_fraction": eval_fraction, "max_mb": max_mb, "text_field": text_field,
            "created_by": f"p2p-diloco {__version__} data prepare",
        }
        manifest["fingerprint"] = dataset_fingerprint(tmp, manifest)
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n")
        _replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def prepare_stdlib(out: Path, *, vocab_size: int, max_mb: float, eval_fraction: float) -> dict:
    return prepare([STDLIB_SOURCE], str(out), tokenizer=None, vocab_size=vocab_size, eval_fraction=eval_fraction,
                   max_mb=max_mb, force=True, source_name="stdlib-bpe", tokenizer_sample_mb=max_mb / 4)


def _stage(progress: Progress | None, stage: str, total: int) -> Callable[[int], None]:
    return (lambda done: progress(stage, done, total)) if progress else (lambda done: None)


def _counted(pieces: Iterator[Piece], report: Callable[[int], None], seen: list[int]) -> Iterator[Piece]:
    for piece in pieces:
        seen[0] += len(piece[1])
        report(seen[0])
        yield piece


def _tokenize(pieces: Iterator[Piece], backend, eos_id: int, dtype: np.dtype, folder: Path,
              report: Callable[[int], None]) -> tuple[dict[str, int], dict[str, int]]:
    counts, docs = dict.fromkeys(SPLITS, 0), dict.fromkeys(SPLITS, 0)
    files = {s: open(folder / f"{s}.bin", "wb") for s in SPLITS}  # noqa: SIM115 (closed below)
    done = 0
    try:
        batch: list[Piece] = []
        size = 0

        def flush() -> None:
            encodings = backend.encode_batch([text for _, text, _ in batch], add_special_tokens=False)
            out: dict[str, list[int]] = {s: [] for s in SPLITS}
            for (is_eval, _, end), enc in zip(batch, encodings):
                s = "eval" if is_eval else "train"
                out[s] += enc.ids
                if end:
                    out[s].append(eos_id)
                    docs[s] += 1
            for s, ids in out.items():
                files[s].write(np.asarray(ids, dtype=dtype).tobytes())
                counts[s] += len(ids)
            batch.clear()

        for piece in pieces:
            batch.append(piece)
            size += len(piece[1])
            if size >= BATCH_BYTES:
                flush()
                done, size = done + size, 0
                report(done)
        if batch:
            flush()
            report(done + size)
    finally:
        for f in files.values():
            f.close()
    return counts, docs


def _rebalance(folder: Path, counts: dict[str, int], eval_fraction: float, dtype: np.dtype) -> dict[str, int]:
    """If a split is empty (one document, a tiny folder), move the train tail (or eval head) across."""
    n = sum(counts.values())
    if (counts["train"] and counts["eval"]) or n < 2:
        return counts
    n_eval = max(1, int(n * eval_fraction))
    tokens = np.fromfile(folder / ("train.bin" if counts["train"] else "eval.bin"), dtype=dtype)
    tokens[: n - n_eval].tofile(folder / "train.bin")
    tokens[n - n_eval:].tofile(folder / "eval.bin")
    return {"train": n - n_eval, "eval": n_eval}


def _replace(tmp: Path, final: Path) -> None:
    """Rename the finished `tmp` to `final`, replacing whatever is there (the caller checked --force)."""
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        os.rename(final, old)
    os.rename(tmp, final)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()
