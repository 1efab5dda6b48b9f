"""Hugging Face causal LMs as learner models: llama, qwen2, mistral, gpt2, or any local config.json / model folder.

`build_hf_model(cfg, seed)` returns an `HFCausalLM`: a thin nn.Module around a `transformers` model whose
`forward(idx, targets) -> (logits, loss)` is the built-in GPT's, so the learner, the simulator and the baselines
have one model path (train/models/build.py `build_model` picks). Its `parameters()` are the HF model's, in its order,
each tied tensor once: `flat_params` / `load_flat_params` work unchanged.

Same theta on every peer. HF's own `_init_weights` draws from the global RNG in an order and with rules that change
between transformers versions; two peers on different versions would start from different parameters and never
know. So after `from_config` every parameter is drawn again here from a local generator seeded from the run's
seed, by a rule that depends only on parameter names, shapes and order (GPT-2 / Llama init: N(0, std), residual
output projections std/sqrt(2 n_layer), norms 1, biases 0). Starting from a model folder instead, the weights
are loaded from its safetensors files and the spec carries their sha256 (`weights_sha256`), checked here.

Nothing here touches the network: configs and weights come from local files only (`local_files_only`).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from p2p_diloco.config import ConfigError, ModelConfig

# Fields that say how a config was saved, not what the model is: left out of the spec's canonical JSON.
_VOLATILE_KEYS = frozenset({"transformers_version", "_name_or_path", "architectures", "torch_dtype", "dtype",
                            "_attn_implementation_autoset", "use_cache", "output_attentions",
                            "output_hidden_states", "return_dict"})
_RESIDUAL_PROJECTIONS = ("o_proj.weight", "down_proj.weight", "c_proj.weight")
WEIGHTS_FILES = ("model.safetensors",)
_weights_folders: dict[str, Path] = {}
"""sha256 of a model folder's weights -> the folder, for this process (`resolve_model_path` fills it)."""


def family_config(cfg: ModelConfig) -> dict:
    """The HF config dict of a family preset (`arch` llama|qwen2|mistral|gpt2 and the size fields)."""
    if cfg.hf_config:
        d = json.loads(cfg.hf_config)
        d["max_position_embeddings" if "max_position_embeddings" in d else "n_positions"] = max(
            cfg.block_size, d.get("max_position_embeddings", d.get("n_positions", 0)))
        return d
    if cfg.arch == "gpt2":
        return {"model_type": "gpt2", "vocab_size": cfg.vocab_size, "n_positions": cfg.block_size,
                "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
                "n_inner": cfg.ffn_hidden or None, "activation_function": "gelu",
                "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
                "bos_token_id": None, "eos_token_id": None, "tie_word_embeddings": True}
    ffn = cfg.ffn_hidden or 64 * math.ceil(8 * cfg.n_embd / 3 / 64)  # SwiGLU's 2/3 of 4x, rounded to 64
    d = {"model_type": cfg.arch, "vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd,
         "intermediate_size": ffn, "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
         "num_key_value_heads": cfg.n_kv_head or cfg.n_head, "max_position_embeddings": cfg.block_size,
         "attention_dropout": cfg.dropout, "tie_word_embeddings": False,
         "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if cfg.arch == "mistral":
        d["sliding_window"] = None  # the training context is block_size; no window inside it
    return d


def hf_config(cfg: ModelConfig):
    """A `transformers.PretrainedConfig` for `cfg`, built locally."""
    from transformers import AutoConfig

    d = dict(family_config(cfg))
    model_type = d.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **d)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"transformers cannot build a {model_type!r} config: {e}") from e
    config._attn_implementation = "sdpa"
    return config


class HFCausalLM(nn.Module):
    """A transformers causal LM with the built-in GPT's interface: forward(idx, targets) -> (logits, loss)."""

    def __init__(self, hf: nn.Module, block_size: int) -> None:
        super().__init__()
        self.hf = hf
        self.block_size = block_size
        self._checkpointing = False

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        if idx.shape[1] > self.block_size:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds the run's block_size {self.block_size}")
        logits = self.hf(input_ids=idx, use_cache=False).logits
        if targets is None:
            return logits, None
        # targets are already the next tokens (the sampler shifts): no HF label shift here.
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def set_activation_checkpointing(self, on: bool) -> None:
        # transformers 5.2x renamed gradient_ to activation_checkpointing_*; older ones have only the first.
        prefix = "activation" if hasattr(self.hf, "activation_checkpointing_enable") else "gradient"
        if on:
            getattr(self.hf, f"{prefix}_checkpointing_enable")(
                **{f"{prefix}_checkpointing_kwargs": {"use_reentrant": False}})
        elif self._checkpointing:
            getattr(self.hf, f"{prefix}_checkpointing_disable")()
        self._checkpointing = on


@torch.no_grad()
def init_weights(model: nn.Module, generator: torch.Generator, n_layer: int, std: float = 0.02) -> None:
    """Draw every parameter from `generator`, by name and shape only (same theta whatever transformers does)."""
    residual_std = std / math.sqrt(2 * n_layer)
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            p.zero_()
        elif p.dim() < 2:  # RMSNorm / LayerNorm gains
            p.fill_(1.0)
        else:
            p.normal_(0.0, residual_std if name.endswith(_RESIDUAL_PROJECTIONS) else std, generator=generator)


def build_hf_model(cfg: ModelConfig, seed: int) -> HFCausalLM:
    """The run's initial HF model on the CPU in float32: from the seed, or from a model folder's weights."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its config warnings are about fields we set on purpose (no bos/eos ids)
    config = hf_config(cfg)
    if cfg.weights_sha256:
        hf = _load_weights(cfg.weights_sha256)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        n_layer: int = getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 1)  # 0 if absent (as None)
        init_weights(hf, torch.Generator().manual_seed(seed), n_layer, getattr(config, "initializer_range", 0.02))
    hf.train()
    return HFCausalLM(hf, cfg.block_size)


# ---- configs and weights from local files ----------------------------------------------------------------------

def cached_hub_folder(name: str) -> Path | None:
    """The local folder of a Hugging Face hub model `org/name` when the hub cache holds it (no network)."""
    if Path(name).expanduser().exists() or name.count("/") != 1 or name.startswith((".", "/", "~")):
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # not cached, or not a repo id: the caller says what was looked for
        return None


def canonical_config(path: Path) -> tuple[str, dict]:
    """(model_type, the config as a dict without its volatile keys) of a config.json or a model folder."""
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"--model {path}: no config.json there (nor a hub model of that name in the local cache); "
                          f"pass llama, qwen2, mistral, gpt2, a config.json or a local model folder")
    try:
        d = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--model {path}: {file} is not readable JSON: {e}") from e
    if not isinstance(d, dict) or not isinstance(d.get("model_type"), str):
        raise ConfigError(f"--model {path}: {file} has no model_type; is it a Hugging Face config.json?")
    return d["model_type"], {k: v for k, v in sorted(d.items()) if k not in _VOLATILE_KEYS}


def weights_digest(folder: Path) -> str:
    """sha256 over a model folder's safetensors files (names and bytes, in name order)."""
    files = sorted(folder.glob("*.safetensors"))
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(8 << 20):
                h.update(chunk)
    return h.hexdigest()


def resolve_model_path(path: str) -> dict:
    """The ModelConfig fields for `--model PATH`: arch, hf_config, and weights_sha256 for a folder with weights
    (which this process then loads from there). Sizes come from the config, so they are set too."""
    p = cached_hub_folder(path) or Path(path).expanduser()  # a hub name works when the local cache has it
    model_type, d = canonical_config(p)
    fields: dict = {"arch": model_type, "hf_config": json.dumps({"model_type": model_type, **d}, sort_keys=True,
                                                                separators=(",", ":"))}
    fields["vocab_size"] = int(d.get("vocab_size", 0)) or 256
    fields["n_layer"] = int(d.get("num_hidden_layers", d.get("n_layer", 1)))
    fields["n_head"] = int(d.get("num_attention_heads", d.get("n_head", 1)))
    fields["n_embd"] = int(d.get("hidden_size", d.get("n_embd", fields["n_head"])))
    if p.is_dir() and any(p.glob("*.safetensors")):
        digest = weights_digest(p)
        _weights_folders[digest] = p
        fields["weights_sha256"] = digest
    return fields


def _load_weights(digest: str) -> nn.Module:
    """The model of the folder whose weights have sha256 `digest` (from_pretrained: it knows each family's key
    names and prefixes), in float32."""
    from transformers import AutoModelForCausalLM

    folder = _weights_folders.get(digest)
    if folder is None:
        raise ConfigError(f"this run starts from weights with sha256 {digest[:16]}...; pass --model FOLDER with "
                          f"that model folder (its *.safetensors files)")
    try:
        hf = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    except (OSError, ValueError, RuntimeError) as e:
        raise ConfigError(f"--model {folder}: transformers cannot load its weights: {e}") from e
    hf.config._attn_implementation = "sdpa"
    return hf
