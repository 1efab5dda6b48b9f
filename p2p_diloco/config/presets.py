"""Presets: plain functions returning a RunSpec (torchtitan's style), chosen by name with `--preset`."""

from __future__ import annotations

from p2p_diloco.config.errors import ConfigError
from p2p_diloco.config.spec import DataConfig, InnerConfig, ModelConfig, RunSpec


def _preset_test() -> RunSpec:
    # < 1M parameters (0.12M): the CI model, trains in seconds on a laptop core.
    return RunSpec(
        model=ModelConfig(n_layer=2, n_head=2, n_embd=64, block_size=64),
        data=DataConfig(batch_size=8, max_corpus_mb=4.0),
        inner=InnerConfig(inner_steps=20, lr=3e-3, warmup_steps=20, decay_steps=600),
    )


def _preset_tiny() -> RunSpec:
    # 0.84M parameters: the CPU benchmark model.
    return RunSpec(
        model=ModelConfig(n_layer=4, n_head=4, n_embd=128, block_size=128),
        data=DataConfig(batch_size=8, max_corpus_mb=8.0),
        inner=InnerConfig(inner_steps=50, lr=2e-3, warmup_steps=50, decay_steps=3000),
    )


def _preset_small() -> RunSpec:
    # ~10.8M parameters: the default "real" model; ~1.4 s/step on 2 CPU cores, fast on any GPU.
    return RunSpec(
        model=ModelConfig(n_layer=6, n_head=6, n_embd=384, block_size=256),
        data=DataConfig(batch_size=8, max_corpus_mb=16.0),
        inner=InnerConfig(inner_steps=100, lr=1e-3, warmup_steps=100, decay_steps=5000),
    )


def _preset_base() -> RunSpec:
    # ~128M parameters (GPT-2 small width, 18 layers: a byte vocabulary has no 38M-parameter embedding): GPUs.
    return RunSpec(
        model=ModelConfig(n_layer=18, n_head=12, n_embd=768, block_size=1024),
        data=DataConfig(batch_size=16, max_corpus_mb=64.0),
        inner=InnerConfig(inner_steps=500, lr=6e-4, warmup_steps=500, decay_steps=50_000),
    )


PRESETS = {"test": _preset_test, "tiny": _preset_tiny, "small": _preset_small, "base": _preset_base}


def preset(name: str) -> RunSpec:
    """The RunSpec of a named preset; a clear error names the valid ones."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]()
