"""Reading the inputs of `data prepare` (train/data/tokens_prepare.py) as a stream of document pieces.

Inputs: text files (.txt .md .py .rst .csv, no suffix) and folders of them (one file = one document), .json (a
list of objects, or one object per line) and .jsonl (one document per record, field `text_field`), .parquet
(column `text_field`), "stdlib" (the Python standard library's .py files, as train/data/corpus.py reads them) and
cached Hugging Face datasets (offline only: a dataset in the local cache, or a save_to_disk folder).

The eval split is by document: sha256(document id) mod 1000 < eval_fraction * 1000, where the id is a file's
path relative to its source folder, or "<file>#<record index>". Text files are topped up as in corpus.py so a
small folder still gets an eval split; "stdlib" uses corpus.py's split itself.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from p2p_diloco.train.data.corpus import (
    BINARY_SNIFF_BYTES,
    BYTES_PER_MB,
    DataError,
    _choose_eval_files,
    _read_files,
    stdlib_files,
)
from p2p_diloco.train.data.tokens_format import MANIFEST_NAME, is_token_dataset

STDLIB_SOURCE = "stdlib"
TEXT_SUFFIXES = frozenset({".txt", ".md", ".py", ".rst", ".csv", ".text", ""})
RECORD_SUFFIXES = frozenset({".json", ".jsonl", ".parquet"})
PIECE_BYTES = 1 << 20  # a long text file is tokenized in line-aligned pieces of about this size

Piece = tuple[bool, str, bool]  # (is_eval, text, ends its document)


def _eval_hash(doc_id: str, eval_fraction: float) -> bool:
    return int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "big") % 1000 < eval_fraction * 1000


# ---- inputs ------------------------------------------------------------------------------------------

class Inputs:
    """The resolved sources: text files (with their split), record files, the stdlib, an HF dataset."""

    def __init__(self, sources: list[str], *, eval_fraction: float, max_mb: float, text_field: str,
                 hf_dataset: str | None, split: str) -> None:
        self.eval_fraction, self.text_field = eval_fraction, text_field
        self.budget = int(max_mb * BYTES_PER_MB)
        self.items: list[tuple[str, Path, str]] = []  # (kind, path, document id), in order
        self.memory: dict[str, bytes] = {}  # stdlib documents, read up front (<= max_mb)
        self.text_eval: set[str] = set()
        self.total = 0  # bytes, for progress
        for source in sources:
            if source == STDLIB_SOURCE:
                self._add_stdlib()
            else:
                self._add_path(source)
        self.hf = _load_hf(hf_dataset, split, text_field) if hf_dataset else None
        self.hf_name = f"{hf_dataset}/{split}"
        if self.hf is not None:
            self.total += int(getattr(self.hf.data, "nbytes", 0) or 0)
        if not self.items and self.hf is None:
            raise DataError("no sources: pass files or folders of text, .json/.jsonl/.parquet files, --stdlib "
                            "or --hf-dataset NAME")
        self._choose_text_eval()
        self.total = min(self.total, self.budget)

    def _add_stdlib(self) -> None:
        root, rel_paths = stdlib_files()
        files = _read_files(root, rel_paths, self.budget / BYTES_PER_MB)
        if not files:
            raise DataError(f"found no .py files in the Python standard library at {root}")
        eval_idx = _choose_eval_files(files, self.eval_fraction)  # the same split as corpus.py's "stdlib"
        for i, (rel, data) in enumerate(files):
            doc_id = f"stdlib/{rel}"
            self.memory[doc_id] = data
            self.items.append(("memory", root / rel, doc_id))
            if i in eval_idx:
                self.text_eval.add(doc_id)
            self.total += len(data)

    def _add_path(self, source: str) -> None:
        path = Path(source).expanduser()
        if not path.exists():
            raise DataError(f"source {source!r} does not exist; pass a text/.json/.jsonl/.parquet file, a folder "
                            f"of them, --stdlib or --hf-dataset NAME")
        if path.is_file():
            kind = _kind(path)
            if kind is None:
                raise DataError(f"source {source!r} has an unsupported suffix {path.suffix!r}; use text "
                                f"({', '.join(sorted(s for s in TEXT_SUFFIXES if s))}), .json, .jsonl or .parquet")
            self._add_file(kind, path, path.name)
            return
        # Hidden paths are tooling (.git, .venv); a token dataset inside the folder is not text to read.
        datasets = {m.parent for m in path.rglob(MANIFEST_NAME) if is_token_dataset(m.parent)}
        found = sorted((p.relative_to(path).as_posix(), p) for p in path.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(path).parts)
                       and not datasets.intersection(p.parents))
        before = len(self.items)
        for rel, p in found:
            kind = _kind(p)
            if kind is not None:
                self._add_file(kind, p, rel)
        if len(self.items) == before:
            raise DataError(f"source folder {source!r} holds no text, .json, .jsonl or .parquet files "
                            f"(hidden paths are skipped)")

    def _add_file(self, kind: str, path: Path, doc_id: str) -> None:
        self.items.append((kind, path, doc_id))
        self.total += path.stat().st_size

    def _choose_text_eval(self) -> None:
        """Text files: corpus.py's rule (hash of the id, topped up from the end to half the fraction) by size."""
        texts = [(doc_id, path.stat().st_size) for kind, path, doc_id in self.items if kind == "text"]
        if len(texts) < 2:
            return  # one file: the split is made by moving its tokens' tail afterwards
        chosen = {d for d, _ in texts if _eval_hash(d, self.eval_fraction)}
        wanted = self.eval_fraction * sum(s for _, s in texts) / 2
        sizes = dict(texts)
        for doc_id, _ in reversed(texts):
            if (chosen and sum(sizes[d] for d in chosen) >= wanted) or len(chosen) >= len(texts) - 1:
                break
            chosen.add(doc_id)
        if len(chosen) == len(texts):
            chosen.discard(texts[0][0])
        self.text_eval |= chosen

    def pieces(self) -> Iterator[Piece]:
        """Every document, in order, as pieces of text; stops after max_mb of text (the last document cut)."""
        budget = self.budget
        streams = [(doc_id, self._read(kind, path, doc_id)) for kind, path, doc_id in self.items]
        if self.hf is not None:
            streams.append((self.hf_name, _hf_pieces(self.hf, self.hf_name, self.text_field, self.eval_fraction)))
        for _, stream in streams:
            for is_eval, text, end in stream:
                data = text.encode("utf-8", "surrogatepass")
                if len(data) >= budget:
                    yield is_eval, data[:budget].decode("utf-8", "ignore"), True
                    return
                budget -= len(data)
                if text:
                    yield is_eval, text, end

    def _read(self, kind: str, path: Path, doc_id: str) -> Iterator[Piece]:
        if kind == "memory":
            data = self.memory[doc_id]
            yield doc_id in self.text_eval, data.decode("utf-8", "replace"), True
        elif kind == "text":
            yield from _text_pieces(path, doc_id in self.text_eval)
        else:
            for i, text in enumerate(_records(kind, path, self.text_field)):
                yield _eval_hash(f"{doc_id}#{i}", self.eval_fraction), text, True


def _kind(path: Path) -> str | None:
    suffix = path.suffix.lower()
    if suffix in RECORD_SUFFIXES:
        return suffix[1:]
    return "text" if suffix in TEXT_SUFFIXES else None


def _text_pieces(path: Path, is_eval: bool) -> Iterator[Piece]:
    with open(path, "rb") as f:
        if b"\0" in f.read(BINARY_SNIFF_BYTES):
            return  # a binary file in a text folder: skipped, as corpus.py does
        f.seek(0)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        buf, pending = "", None
        while block := f.read(PIECE_BYTES):
            buf += decoder.decode(block)
            cut = buf.rfind("\n") + 1 or len(buf)
            if pending:
                yield is_eval, pending, False
            pending, buf = buf[:cut], buf[cut:]
        buf += decoder.decode(b"", final=True)
        if buf:
            if pending:
                yield is_eval, pending, False
            pending = buf
        if pending:
            yield is_eval, pending, True


def _records(kind: str, path: Path, field: str) -> Iterator[str]:
    if kind == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"reading {path} needs pyarrow: pip install pyarrow") from None
        pf = pq.ParquetFile(path)
        if field not in pf.schema_arrow.names:
            raise DataError(f"{path} has no column {field!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                            f"pass --text-field COLUMN")
        for batch in pf.iter_batches(columns=[field], batch_size=1024):
            for i, text in enumerate(batch.column(0).to_pylist()):
                yield _text_of({field: text}, field, f"{path} row {i}")
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        first = f.read(1)
        while first.isspace():
            first = f.read(1)
        f.seek(0)
        if kind == "json" and first == "[":
            try:
                records = json.load(f)
            except ValueError as e:
                raise DataError(f"{path} is not valid JSON ({e}); use a list of objects or one object per "
                                f"line") from None
            for i, record in enumerate(records):
                yield _text_of(record, field, f"{path} item {i}")
            return
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise DataError(f"{path} line {n} is not a JSON object; use one object per line (JSONL) or a "
                                f"list of objects") from None
            yield _text_of(record, field, f"{path} line {n}")


def _text_of(record: object, field: str, where: str) -> str:
    if not isinstance(record, dict) or field not in record:
        keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{where} has no field {field!r} (it has: {keys}); pass --text-field FIELD")
    text = record[field]
    if text is None:
        return ""
    if not isinstance(text, str):
        raise DataError(f"{where}: field {field!r} is {type(text).__name__}, not text; pass --text-field FIELD")
    return text


def _load_hf(name: str, split: str, field: str):
    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"  # never a download
    try:
        import datasets
    except ImportError:
        raise DataError("--hf-dataset needs the `datasets` package: pip install datasets") from None
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    try:
        if Path(name).expanduser().is_dir() and (Path(name).expanduser() / "dataset_info.json").exists():
            ds = datasets.load_from_disk(str(Path(name).expanduser()))
            ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        else:
            ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # noqa: BLE001 (datasets raises many kinds: not cached, bad split, bad name)
        raise DataError(f"cannot load HF dataset {name!r} split {split!r} from the local cache "
                        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); download it where "
                        f"there is internet (datasets.load_dataset) into this cache, or pass local files") from None
    if field not in ds.column_names:
        raise DataError(f"HF dataset {name!r} has no column {field!r} (columns: {', '.join(ds.column_names)}); "
                        f"pass --text-field COLUMN")
    return ds


def _hf_pieces(ds, name: str, field: str, eval_fraction: float) -> Iterator[Piece]:
    i = 0
    for batch in ds.select_columns([field]).iter(batch_size=1024):
        for text in batch[field]:
            yield _eval_hash(f"{name}#{i}", eval_fraction), _text_of({field: text}, field, f"{name} row {i}"), True
            i += 1
