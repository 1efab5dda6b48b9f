"""From the options a person typed to the RunSpec every peer hashes, and the training data it names.

`resolve_spec` runs once per process before the spec is hashed, published or compared:
- `--model PATH` (a config.json or a model folder) becomes `arch` = its model_type, `hf_config` = its canonical
  JSON and, for a folder with weights, `weights_sha256` (train/models/hf.py); the path itself never enters the
  spec, so two machines with the folder in different places train one run;
- a token dataset (`--corpus stdlib-bpe` or a folder from `data prepare`) sets `model.vocab_size` to its
  tokenizer's and writes its fingerprints into `data.fingerprint` / `data.tokenizer_fingerprint`; a folder
  becomes `data.corpus = tokens:<fingerprint>` (its path stays in this process), so peers that keep the same
  dataset in different places train one run, and a peer with other data is refused, naming the field.
`load_training_data` loads what `data.corpus` names: a byte corpus (train/data/corpus.py) or a token dataset
(train/data/tokens.py), both with `train`, `eval`, `fingerprint`, `source` and `describe()`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from p2p_diloco.config import ConfigError, RunSpec
from p2p_diloco.config.spec import DataConfig, is_model_path

STDLIB_TOKENS = "stdlib-bpe"
STDLIB_VOCAB = 4096
TOKENS_PREFIX = "tokens:"
"""A resolved spec names a prepared token folder as `tokens:<fingerprint>`, not by its path on one machine."""
_token_folders: dict[str, Path] = {}
"""fingerprint -> the folder this process was given for it (`--corpus DIR`), filled by `resolve_spec`."""


def looks_like_token_folder(path: str) -> bool:
    """A folder with any part of a prepared token dataset: it must load as one (a broken one is an error, never
    read as a folder of text)."""
    p = Path(path).expanduser()
    return p.is_dir() and any((p / name).exists() for name in ("manifest.json", "train.bin", "tokenizer"))


def token_dataset_path(cfg: DataConfig) -> Path | None:
    """The prepared folder `data.corpus` names, or None for a byte corpus."""
    from p2p_diloco.train.data.tokens import stdlib_token_dataset

    if cfg.corpus == STDLIB_TOKENS:
        return Path(stdlib_token_dataset(STDLIB_VOCAB))
    if cfg.corpus.startswith(TOKENS_PREFIX):
        folder = _token_folders.get(cfg.corpus[len(TOKENS_PREFIX):])
        if folder is None:
            raise ConfigError(f"the run trains on the token dataset {cfg.corpus}; pass --corpus DIR with that "
                              f"dataset (a folder made by `p2p-diloco data prepare` with this fingerprint)")
        return folder
    return Path(cfg.corpus).expanduser() if looks_like_token_folder(cfg.corpus) else None


def load_training_data(cfg: DataConfig, *, block_size: int | None = None) -> Any:
    """A `Corpus` of bytes or a `TokenDataset`, as `data.corpus` says."""
    from p2p_diloco.train.data.corpus import load_corpus

    path = token_dataset_path(cfg)
    if path is None:
        return load_corpus(cfg, block_size=block_size)
    from p2p_diloco.train.data.tokens import load_token_dataset

    return load_token_dataset(str(path), block_size=block_size)


def resolve_spec(spec: RunSpec) -> RunSpec:
    """The spec with `--model PATH` and the token dataset's facts filled in (see the module's docstring)."""
    model, data = spec.model, spec.data
    if is_model_path(model.arch):
        from p2p_diloco.train.models.hf import resolve_model_path

        model = dataclasses.replace(model, **resolve_model_path(model.arch))
    path = token_dataset_path(data)
    if path is not None:
        from p2p_diloco.train.data.tokens import load_token_dataset

        dataset = load_token_dataset(str(path), block_size=model.block_size)
        for name, have in (("fingerprint", dataset.fingerprint),
                           ("tokenizer_fingerprint", dataset.tokenizer_fingerprint)):
            want = getattr(data, name)
            if want and want != have:
                raise ConfigError(f"data.{name}: the run's is {want} but {dataset.source} has {have}: this peer's "
                                  f"data differs from the run's; prepare it with the run's tokenizer and files")
        corpus = data.corpus
        if corpus != STDLIB_TOKENS:  # a folder: named by its fingerprint, so its path on this machine stays here
            _token_folders[dataset.fingerprint] = path
            corpus = TOKENS_PREFIX + dataset.fingerprint
        data = dataclasses.replace(data, corpus=corpus, fingerprint=dataset.fingerprint,
                                   tokenizer_fingerprint=dataset.tokenizer_fingerprint)
        if model.arch == "gpt":
            raise ConfigError(f"{data.corpus} is a token dataset ({dataset.vocab_size} tokens) but model.arch is the "
                              f"byte-level gpt; pass --model llama (or qwen2, mistral, gpt2)")
        if model.hf_config and model.vocab_size < dataset.vocab_size:
            raise ConfigError(f"the model's vocab_size {model.vocab_size} is smaller than the tokenizer's "
                              f"{dataset.vocab_size} ({dataset.source})")
        if not model.hf_config:
            model = dataclasses.replace(model, vocab_size=dataset.vocab_size)
    return dataclasses.replace(spec, model=model, data=data).validate()
