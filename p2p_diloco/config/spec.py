"""The RunSpec every peer of a run shares: model, data, inner and outer optimizers, defences.

Frozen dataclasses with a docstring under each field (torchtitan's style); the CLI reads those docstrings
to build `--help` (see `p2p_diloco.cli.args`). Nothing here reads the environment.

The RunSpec is content-hashed: two peers train the same run only if their `spec_hash()` values are equal.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from p2p_diloco.config.defence import DefenceConfig
from p2p_diloco.config.errors import require

CODECS = ("fp32", "fp16", "int8", "int4")
"""Payload codec names, in their wire order (wire/codecs.py imports them as CODEC_NAMES)."""


MODEL_ARCHS = ("gpt", "llama", "qwen2", "mistral", "gpt2")
"""`model.arch`: the built-in byte-level GPT, or a Hugging Face causal-LM family (train/models/hf.py)."""


def is_model_path(arch: str) -> bool:
    """Whether `--model` names a file or folder rather than a family."""
    return "/" in arch or arch.endswith(".json") or arch in (".", "..")


@dataclass(frozen=True)
class ModelConfig:
    """The model every peer trains: the built-in byte-level GPT (nanoGPT-style) or a Hugging Face causal LM."""

    arch: str = "gpt"
    """gpt (the built-in byte-level GPT), or a Hugging Face family built with transformers: llama, qwen2,
    mistral, gpt2. `join --model` also takes a config.json, a local model folder (its weights are the start) or
    a hub name in the local cache; any model_type transformers builds then works."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 128
    """Width of the residual stream."""
    block_size: int = 128
    """Context length in tokens (bytes for the built-in GPT)."""
    vocab_size: int = 256
    """Vocabulary size (256: bytes); a token dataset sets it to its tokenizer's."""
    dropout: float = 0.0
    """Dropout probability (0 for short runs)."""
    n_kv_head: int = 0
    """Key/value heads of grouped-query attention (0: n_head); Hugging Face families only."""
    ffn_hidden: int = 0
    """MLP width (0: the family's default: 4 x n_embd for gpt/gpt2, 8/3 x n_embd rounded up to 64 otherwise)."""
    hf_config: str = ""
    """The whole Hugging Face config as canonical JSON, when the model came from a config.json or a model folder
    (it then decides the architecture; block_size still sets the training context)."""
    weights_sha256: str = ""
    """sha256 of the starting weights when the run starts from a model folder's weights (empty: random init
    from the run's seed); every peer needs those weights (`--model FOLDER`)."""

    def validate(self) -> None:
        # A path (config.json or model folder) is allowed here; train/data/resolve.py turns it into arch + hf_config
        # before the spec is hashed or published.
        require(self.arch in MODEL_ARCHS or is_model_path(self.arch) or bool(self.hf_config),
                f"model.arch must be one of {', '.join(MODEL_ARCHS)}, a config.json or a model folder, "
                f"got {self.arch!r}")
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            require(getattr(self, name) > 0, f"model.{name} must be > 0, got {getattr(self, name)}")
        require(self.n_embd % self.n_head == 0,
                f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})")
        require(0.0 <= self.dropout < 1.0, f"model.dropout must be in [0, 1), got {self.dropout}")
        require(self.n_kv_head >= 0 and (self.n_kv_head == 0 or self.n_head % self.n_kv_head == 0),
                f"model.n_kv_head must be 0 or divide model.n_head ({self.n_head}), got {self.n_kv_head}")
        require(self.ffn_hidden >= 0, f"model.ffn_hidden must be >= 0, got {self.ffn_hidden}")
        require(self.arch != "gpt" or not (self.hf_config or self.weights_sha256 or self.n_kv_head),
                "model.hf_config, model.weights_sha256 and model.n_kv_head need a Hugging Face model.arch")
        require(self.arch != "gpt" or self.vocab_size <= 256,
                f"the built-in byte-level gpt has at most 256 tokens, got model.vocab_size {self.vocab_size}; "
                f"use --model llama (or qwen2, mistral, gpt2) for a tokenized dataset")


@dataclass(frozen=True)
class DataConfig:
    """Where the training text comes from and how it is split."""

    corpus: str = "stdlib"
    """'stdlib' (the running Python's standard-library sources as bytes, no download), 'stdlib-bpe' (the same,
    tokenized with a BPE tokenizer made from them at set-up), a folder made by `p2p-diloco data prepare`, or a
    path to a text file or folder (bytes)."""
    fingerprint: str = ""
    """A token dataset's fingerprint (its manifest's; set when the dataset is loaded): peers with other data are
    refused."""
    tokenizer_fingerprint: str = ""
    """A token dataset's tokenizer fingerprint (set when the dataset is loaded)."""
    batch_size: int = 8
    """Sequences per inner step, per peer."""
    eval_fraction: float = 0.05
    """Fraction of the corpus held out for evaluation (chosen by file, deterministically)."""
    max_corpus_mb: float = 16.0
    """Read at most this many MB of the corpus (keeps start-up fast)."""

    def validate(self) -> None:
        require(self.batch_size > 0, f"data.batch_size must be > 0, got {self.batch_size}")
        require(0.0 < self.eval_fraction < 0.5, f"data.eval_fraction must be in (0, 0.5), got {self.eval_fraction}")
        require(self.max_corpus_mb > 0, f"data.max_corpus_mb must be > 0, got {self.max_corpus_mb}")


@dataclass(frozen=True)
class InnerConfig:
    """The inner phase: H steps of AdamW on local data."""

    inner_steps: int = 50
    """H: inner steps per outer round."""
    lr: float = 1e-3
    """Peak AdamW learning rate."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    warmup_steps: int = 50
    """Linear warm-up length, in the peer's cumulative inner steps."""
    decay_steps: int = 2000
    """Horizon of the cosine schedule, in the peer's cumulative inner steps (lr stays at the floor after)."""
    min_lr_ratio: float = 0.1
    """Cosine floor as a fraction of lr."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    schedule_clock: str = "swarm"
    """What the lr schedule counts: swarm (the rounds the swarm has done, from the replica's version vector, in
    steps: a slow or late unit takes the swarm's lr) or own (this unit's inner steps, DiLoCo's)."""
    rebase_window: float = 1.0
    """Updates merged while the first this fraction of a phase runs are added to the local model at the next
    step; later ones wait for the next phase (1: always at the next step)."""

    def validate(self) -> None:
        require(self.schedule_clock in ("own", "swarm"),
                f"inner.schedule_clock must be own or swarm, got {self.schedule_clock!r}")
        require(0 <= self.rebase_window <= 1, f"inner.rebase_window must be in [0, 1], got {self.rebase_window}")
        require(self.inner_steps > 0, f"inner.inner_steps must be > 0, got {self.inner_steps}")
        require(self.lr > 0 and math.isfinite(self.lr), f"inner.lr must be a positive number, got {self.lr}")
        require(self.weight_decay >= 0, f"inner.weight_decay must be >= 0, got {self.weight_decay}")
        require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "inner.beta1 and inner.beta2 must be in [0, 1)")
        require(self.warmup_steps >= 0, f"inner.warmup_steps must be >= 0, got {self.warmup_steps}")
        require(self.decay_steps > 0, f"inner.decay_steps must be > 0, got {self.decay_steps}")
        require(0 <= self.min_lr_ratio <= 1, f"inner.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        require(self.grad_clip >= 0, f"inner.grad_clip must be >= 0, got {self.grad_clip}")


@dataclass(frozen=True)
class OuterConfig:
    """The outer step: sender-side Nesterov, compression with error feedback, weighting."""

    outer_lr: float = 1.4
    """Outer learning rate, and the one receivers merge at (DiLoCo: 0.7 with mu 0.9; an async swarm's loss then
    depends on when updates land, with 1.4 and mu 0.3 half as much: BENCHMARKS.md "Async quality"). With the ramp
    (`schedule`) it holds until `ramp_from` swarm rounds; DiLoCo's step is then better over long runs."""
    momentum: float = 0.3
    """Outer momentum mu (DiLoCo: 0.9); 0 gives plain averaging."""
    schedule: str = "ramp"
    """How the outer step follows the swarm's clock (`swarm_rounds`, train/phase.py): ramp (outer_lr and momentum
    until `ramp_from` swarm rounds, then linearly to late_lr and late_momentum by `ramp_to`: the step that is best
    over 10 rounds, then DiLoCo's, best over 100; the best synchronous step at both horizons too), or constant.
    The ramp wants the grace window (`training.grace`, on by default): without one, with a data shard per unit,
    the model between two updates swings by 17-18% in loss under mu 0.9 (BENCHMARKS.md "The outer step's ramp")."""
    late_lr: float = 0.7
    """The ramp's outer lr from `ramp_to` on (DiLoCo's)."""
    late_momentum: float = 0.9
    """The ramp's momentum from `ramp_to` on (DiLoCo's)."""
    ramp_from: float = 10.0
    """Swarm rounds at which the ramp leaves outer_lr and momentum."""
    ramp_to: float = 30.0
    """Swarm rounds at which the ramp reaches late_lr and late_momentum."""
    nesterov: bool = True
    """Nesterov momentum (DiLoCo); False gives heavy-ball."""
    codec: str = "int8"
    """Payload codec: fp32, fp16, int8 or int4 (blockwise absmax)."""
    codec_block: int = 256
    """Values per absmax block for int8/int4."""
    error_feedback: bool = True
    """Carry the compression error into the next round's update."""
    staleness_power: float = 0.5
    """Damp an update's weight by (1 + excess_staleness/N)^-power; 0 disables damping."""
    max_weight: float = 1.0
    """Receivers clamp an update's signed weight to [0, max_weight]."""
    momentum_source: str = "own"
    """What the sender's momentum follows: own (its own pseudo-gradients, DiLoCo's Nesterov per sender) or swarm
    (the swarm's last outer step, read from how far the replica's theta moved over our last round: every sender
    adds nearly the same momentum, not its own shard's; heavy-ball, or Nesterov's look-ahead with `nesterov`;
    one more float32 vector per unit). BENCHMARKS.md "Async at parity"."""

    def step_at(self, clock: float) -> tuple[float, float]:
        """(outer lr, momentum) at `clock` swarm rounds. Linear in both between ramp_from and ramp_to."""
        if self.schedule == "constant":
            return self.outer_lr, self.momentum
        f = min(1.0, max(0.0, (clock - self.ramp_from) / (self.ramp_to - self.ramp_from)))
        return (self.outer_lr + (self.late_lr - self.outer_lr) * f,
                self.momentum + (self.late_momentum - self.momentum) * f)

    def validate(self) -> None:
        require(self.outer_lr > 0 and math.isfinite(self.outer_lr),
                f"outer.outer_lr must be a positive number, got {self.outer_lr}")
        require(0 <= self.momentum < 1, f"outer.momentum must be in [0, 1), got {self.momentum}")
        require(self.schedule in ("constant", "ramp"),
                f"outer.schedule must be constant or ramp, got {self.schedule!r}")
        require(self.late_lr > 0 and math.isfinite(self.late_lr),
                f"outer.late_lr must be a positive number, got {self.late_lr}")
        require(0 <= self.late_momentum < 1, f"outer.late_momentum must be in [0, 1), got {self.late_momentum}")
        require(0 <= self.ramp_from < self.ramp_to and math.isfinite(self.ramp_to),
                f"outer.ramp_from and ramp_to must satisfy 0 <= ramp_from < ramp_to, got {self.ramp_from}, "
                f"{self.ramp_to}")
        require(self.codec in CODECS, f"outer.codec must be one of {', '.join(CODECS)}, got {self.codec!r}")
        require(self.codec_block > 0 and self.codec_block % 2 == 0,
                f"outer.codec_block must be a positive even number, got {self.codec_block}")
        require(self.staleness_power >= 0, f"outer.staleness_power must be >= 0, got {self.staleness_power}")
        require(self.max_weight > 0, f"outer.max_weight must be > 0, got {self.max_weight}")
        require(self.momentum_source in ("own", "swarm"),
                f"outer.momentum_source must be own or swarm, got {self.momentum_source!r}")


@dataclass(frozen=True)
class RunSpec:
    """Everything the peers of one run must agree on. Content-hashed by `spec_hash()`."""

    run_id: str = "default"
    """Name of the run; peers of different runs ignore each other."""
    seed: int = 0
    """Seed for the initial parameters (every peer starts from the same theta)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model every peer trains."""
    data: DataConfig = field(default_factory=DataConfig)
    """The training text and its split."""
    inner: InnerConfig = field(default_factory=InnerConfig)
    """The inner phase (AdamW on local data)."""
    outer: OuterConfig = field(default_factory=OuterConfig)
    """The outer step and what is sent."""
    defence: DefenceConfig = field(default_factory=DefenceConfig)
    """What every peer does with hostile input."""

    def validate(self) -> RunSpec:
        require(bool(self.run_id) and len(self.run_id) <= 64 and self.run_id.isprintable(),
                f"run_id must be 1-64 printable characters, got {self.run_id!r}")
        for part in (self.model, self.data, self.inner, self.outer, self.defence):
            part.validate()
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunSpec:
        subs = {"model": ModelConfig, "data": DataConfig, "inner": InnerConfig, "outer": OuterConfig,
                "defence": DefenceConfig}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        require(not unknown, f"unknown RunSpec fields: {sorted(unknown)}")
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if key in subs:
                require(isinstance(value, dict), f"{key} must be an object of fields, got {value!r}")
                sub_known = {f.name for f in dataclasses.fields(subs[key])}
                bad = set(value) - sub_known
                require(not bad, f"unknown {key} fields: {sorted(bad)}")
                kwargs[key] = subs[key](**{k: _typed(subs[key], k, v, f"{key}.") for k, v in value.items()})
            else:
                kwargs[key] = _typed(cls, key, value, "")
        return cls(**kwargs)

    def spec_hash(self) -> str:
        """sha256 over the canonical JSON of every field; equal hashes mean the same run."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    def differing_fields(self, other: RunSpec) -> list[str]:
        """Dotted names of the fields where two specs differ (for a clear mismatch error)."""
        return _diff(self.to_dict(), other.to_dict(), "")


_SCALARS = {"int": int, "float": float, "str": str, "bool": bool}


def _typed(cls: type, name: str, value: Any, prefix: str) -> Any:
    """A JSON value checked against the field's annotation (an int is accepted where a float is asked)."""
    annotation = next(f.type for f in dataclasses.fields(cls) if f.name == name)
    expected = _SCALARS.get(annotation if isinstance(annotation, str) else getattr(annotation, "__name__", ""))
    if str(annotation).startswith("tuple[str") and isinstance(value, (list, tuple)):
        require(all(isinstance(v, str) for v in value), f"{prefix}{name} must be a list of strings, got {value!r}")
        return tuple(value)  # JSON has lists; a frozen config holds tuples
    if expected is None:
        return value
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    ok = isinstance(value, expected) and (expected is bool or not isinstance(value, bool))
    require(ok, f"{prefix}{name} must be {expected.__name__}, got {value!r}")
    return value


def _diff(a: dict[str, Any], b: dict[str, Any], prefix: str) -> list[str]:
    out: list[str] = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if key == "hf_config" and va and vb and va != vb:  # name the field inside the model's config, not 2 KB of it
            try:
                va, vb = json.loads(va), json.loads(vb)
            except ValueError:
                pass
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _diff(va, vb, f"{prefix}{key}.")
        elif va != vb:
            out.append(f"{prefix}{key}: {va!r} != {vb!r}")
    return out
