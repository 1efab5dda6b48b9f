"""`p2p-diloco data prepare SOURCE... --out DIR`: tokenize text into a token dataset (train/data/tokens_prepare.py).

The heavy imports (tokenizers, datasets, torch) happen only when the command runs: every `p2p-diloco ...`
invocation builds all sub-parsers.
"""

from __future__ import annotations

import argparse
import sys
import time

from p2p_diloco.config import ConfigError

NO_LIMIT_MB = 1e9


def add_data_command(sub: argparse._SubParsersAction) -> None:
    """Register `data` (with its sub-command `prepare`) on the CLI's sub-parsers."""
    text = "prepare training data: tokenize text into a token dataset that --corpus DIR reads"
    p = sub.add_parser("data", help=text, description=text + ".")
    data_sub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    data_sub.required = True
    text = "tokenize local text, JSON, JSONL or Parquet files, the standard library or a cached HF dataset"
    q = data_sub.add_parser(
        "prepare", help=text,
        description=text + ". Writes memory-mapped token files (train.bin, eval.bin), the tokenizer and a "
        "manifest with a fingerprint into --out; every peer of a run must use the same dataset (same "
        "fingerprint). Nothing is downloaded: --tokenizer is a local folder and --hf-dataset is read from the "
        "local Hugging Face cache only. The eval split is chosen by document, deterministically.")
    q.add_argument("sources", nargs="*", metavar="SOURCE",
                   help="a text file (.txt .md .py .rst .csv), .json (list of objects or one per line), .jsonl, "
                        ".parquet, or a folder of them (hidden paths are skipped)")
    q.add_argument("--stdlib", action="store_true", help="also read the Python standard library's .py sources")
    q.add_argument("--out", required=True, metavar="DIR", help="the dataset folder to write")
    tok = q.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", metavar="DIR",
                     help="a local Hugging Face tokenizer folder (save_pretrained, with tokenizer.json); "
                          "default: train a byte-level BPE on the training documents")
    tok.add_argument("--vocab-size", type=int, default=8192, metavar="N",
                     help="vocabulary of the trained tokenizer, including <|endoftext|> (default: %(default)s)")
    q.add_argument("--hf-dataset", metavar="NAME",
                   help="a dataset in the local HF cache (datasets.load_dataset(NAME), offline) or a "
                        "save_to_disk folder")
    q.add_argument("--split", default="train", help="the --hf-dataset split to read (default: %(default)s)")
    q.add_argument("--text-field", default="text", metavar="F",
                   help="the JSON field or Parquet/HF column holding the text (default: %(default)s)")
    q.add_argument("--eval-fraction", type=float, default=0.05, metavar="X",
                   help="fraction of documents held out for eval (default: %(default)s)")
    q.add_argument("--max-mb", type=float, default=None, metavar="M",
                   help="read at most M MB of text (default: all of it)")
    q.add_argument("--force", action="store_true", help="replace an existing --out")
    q.set_defaults(func=cmd_data_prepare)


class _Progress:
    """A line per ~10% of each stage on a pipe or file; one line rewritten in place on a terminal."""

    LABELS = {"tokenizer": "training the tokenizer", "tokenize": "tokenizing"}

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.monotonic()
        self.stage, self.decile = "", -1

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage != self.stage:
            if self.tty and self.stage:
                self.stream.write("\n")
            self.stage, self.decile = stage, -1
        frac = min(1.0, done / max(1, total))
        line = (f"[data prepare] {self.LABELS.get(stage, stage)}: {int(frac * 100)}% ({done / 2**20:.1f} of "
                f"{total / 2**20:.1f} MB) {time.monotonic() - self.t0:.0f}s")
        if self.tty:
            self.stream.write("\r" + line.ljust(78))
        elif int(frac * 10) > self.decile:
            self.decile = int(frac * 10)
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self.stage:
            self.stream.write("\n")
            self.stream.flush()


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from p2p_diloco.train.data.tokens_prepare import prepare
    from p2p_diloco.train.data.tokens_sources import STDLIB_SOURCE

    sources = list(args.sources) + ([STDLIB_SOURCE] if args.stdlib else [])
    if not sources and not args.hf_dataset:
        raise ConfigError("nothing to prepare: give SOURCE files or folders, --stdlib or --hf-dataset NAME")
    progress = _Progress()
    try:
        manifest = prepare(sources, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                           eval_fraction=args.eval_fraction, max_mb=args.max_mb or NO_LIMIT_MB,
                           text_field=args.text_field, hf_dataset=args.hf_dataset, split=args.split,
                           progress=progress, force=args.force)
    finally:
        progress.close()
    train, held = manifest["train"], manifest["eval"]
    print(f"wrote {args.out}: train {train['tokens']} tokens ({train['documents']} documents), eval "
          f"{held['tokens']} tokens ({held['documents']} documents), vocab {manifest['vocab_size']} "
          f"({manifest['dtype']}), fingerprint {manifest['fingerprint']}")
    print(f"use it with: --corpus {args.out}")
    return 0
